"""Sparse attention told apart from a dynamic mask by what it computes, and twins that keep width relations
(issue 36), on configs built apart from the families' defaults the way a checkpoint's author writes them."""

from __future__ import annotations

import pytest

from onboard.inspect.inspection import inspect_source
from onboard.source import resolve
from tests.variety.draw import build_config
from tests.variety.structure import disagreements, expected

pytestmark = pytest.mark.family  # each builds and inspects a family's twin: a few seconds


def _inspect(tmp_path, family: str, changes: dict):
    from onboard.twin import instantiate

    build_config(family, changes).save_pretrained(tmp_path / family)
    source = resolve(str(tmp_path / family))
    spec = inspect_source(source)[0]
    return spec, disagreements(spec, expected(source.config, instantiate(source, device="meta")))


def test_a_dynamic_mask_over_keys_is_softmax_attention(tmp_path):
    """Doge keeps each query's `keep_window_size` keys by a top-k over one score per key (from the values), the
    causal mask added: no query meets a key in those scores, so it is a mask, not an indexer."""
    spec, problems = _inspect(tmp_path, "doge", {"hidden_size": 64, "num_attention_heads": 2,
                                                 "num_key_value_heads": 2, "num_hidden_layers": 2,
                                                 "keep_window_size": 8, "vocab_size": 97})
    assert {layer.attention.kind for layer in spec.layers} == {"softmax"} and not problems


def test_an_indexer_that_picks_per_query_in_a_loop_is_sparse_attention(tmp_path):
    """Qwen4-Exp's QSA indexer scores blocks of keys for each query in a Python loop and scatters the picks into a
    mask with one spare column: read as sparse attention."""
    spec, problems = _inspect(tmp_path, "qwen4_exp_text", {
        "hidden_size": 96, "num_hidden_layers": 2, "layer_types": ["linear_attention", "indexed_attention"],
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "indexer_head_dim": 24,
        "indexer_n_heads": 2, "indexer_budget": 16, "indexer_compress_ratio": 4, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 24, "num_experts": 6,
        "num_experts_per_tok": 2, "moe_intermediate_size": 40, "shared_expert_intermediate_size": 56,
        "vocab_size": 320})
    assert [layer.attention.kind for layer in spec.layers] == ["linear:gated_deltanet", "sparse:dsa"]
    assert not problems


def test_an_indexer_that_keeps_every_key_at_the_twins_length_is_still_sparse(tmp_path):
    """DeepSeek-V4's compressed sparse attention: at the twin's 32 tokens its top-k keeps every compressed key,
    yet its scores pair queries with keys (read before issue 36 as sliding attention)."""
    spec, problems = _inspect(tmp_path, "deepseek_v4", {
        "num_hidden_layers": 2, "layer_types": ["heavily_compressed_attention", "compressed_sparse_attention"],
        "mlp_layer_types": ["moe", "moe"], "index_n_heads": 2, "index_head_dim": 32, "index_topk": 16})
    assert spec.layers[1].attention.kind == "sparse:dsa" and not problems


def test_a_width_that_is_twice_the_hidden_size_stays_so_in_the_twin(tmp_path):
    """Zamba's attention reads the hidden state and the embeddings side by side (2 x hidden); with a head size
    of the same value the twin used to shrink it as a head size and did not run."""
    spec, problems = _inspect(tmp_path, "zamba", {
        "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 64,
        "vocab_size": 97, "num_hidden_layers": 5, "attn_layer_period": 3, "attn_layer_offset": 1,
        "layers_block_type": ["hybrid", "linear_attention", "linear_attention", "hybrid", "hybrid"],
        "mamba_d_state": 32, "mamba_dt_rank": 8})
    assert not problems
