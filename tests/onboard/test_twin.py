"""The tiny twin keeps the architecture and shrinks the sizes."""

import math

import pytest
import torch

from onboard.errors import OnboardError
from onboard.source import resolve
from onboard.twin import TEST_SEQ_LEN, Twin, check_runs
from onboard.twin.meanings import meaning_of
from onboard.twin.shrink import shrink_config_dict


def test_meanings_by_field_name():
    assert meaning_of("n_routed_experts") == "experts"
    assert meaning_of("moe_intermediate_size") == "expert_ffn"
    assert meaning_of("num_key_value_heads") == "kv_heads"
    assert meaning_of("index_topk") == "index_topk"
    assert meaning_of("rope_theta") is None


def test_deepseek_v3_twin_keeps_features():
    twin = Twin.build(resolve("deepseek-v3"))
    cfg = twin.config
    assert cfg.hidden_size == 64 and cfg.num_attention_heads == 4
    # dense-first layers and MoE layers are both present, in the original order
    assert cfg.num_hidden_layers == 4 and cfg.first_k_dense_replace == 3
    assert len(set(twin.layer_signatures)) == 2 == len(set(twin.full_layer_signatures))
    assert len(twin.full_layer_signatures) == 61
    # group-limited routing still selects a strict subset of groups, with several experts per group
    assert 1 < cfg.topk_group < cfg.n_group and cfg.n_routed_experts // cfg.n_group >= 2
    assert cfg.num_experts_per_tok <= cfg.topk_group * (cfg.n_routed_experts // cfg.n_group)
    # MLA ranks stay low-rank and the rope head dim still equals the rotary head_dim
    assert cfg.kv_lora_rank < cfg.hidden_size and cfg.head_dim == cfg.qk_rope_head_dim
    changed = {s.meaning: (s.twin, s.full) for s in twin.changes}
    assert changed["top_k"] == (cfg.num_experts_per_tok, 8) and changed["experts"] == (cfg.n_routed_experts, 256)
    # beside the twin, the full model's record: its shapes on the meta device and its sizes by meaning
    assert twin.full_model.model.embed_tokens.weight.shape == (129280, 7168)
    assert twin.full_model.model.embed_tokens.weight.is_meta
    assert twin.full_sizes["experts"] == [("n_routed_experts", 256)]


def test_windows_and_index_topk_are_below_the_test_sequence():
    twin = Twin.build(resolve("deepseek-v3.2"))
    assert twin.config.index_topk < TEST_SEQ_LEN
    twin = Twin.build(resolve("gpt-oss-120b"))
    assert twin.config.sliding_window < TEST_SEQ_LEN
    assert twin.config.layer_types[:2] == ["sliding_attention", "full_attention"]


def test_hybrid_twin_keeps_one_period_of_layer_kinds():
    twin = Twin.build(resolve("qwen3-next-80b-a3b"))
    assert twin.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    twin = Twin.build(resolve("onboard-flagship-2.8t"))
    assert twin.config.layer_types == ["linear_attention"] * 3 + ["sparse_attention"]


def test_twin_trains_a_step():
    """A small random twin predicts about uniformly: its first loss is near ln(vocabulary); a twin whose
    forward yields nan is refused in one line."""
    twin = Twin.build(resolve("qwen3-30b-a3b"))
    n_params = sum(p.numel() for p in twin.model.parameters())
    assert n_params < 2_000_000
    loss = check_runs(twin)
    assert abs(loss - math.log(twin.config.vocab_size)) < 0.1
    with torch.no_grad():
        twin.model.get_input_embeddings().weight[:] = float("nan")
    with pytest.raises(OnboardError, match="loss is not finite"):
        check_runs(twin)


def test_shrink_records_every_change():
    cfg = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
           "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000, "rope_theta": 1e6,
           "sliding_window": 4096}
    twin, shrinks = shrink_config_dict(cfg)
    assert twin["num_key_value_heads"] < twin["num_attention_heads"]  # GQA stays GQA
    assert twin["num_experts_per_tok"] == 2 and twin["rope_theta"] == 1e6
    changed = {s.path: (s.full, s.twin) for s in shrinks}
    assert changed["hidden_size"] == (4096, 64) and changed["sliding_window"] == (4096, 8)
    assert "rope_theta" not in changed and "num_experts_per_tok" not in changed


def test_unknown_sizes_follow_the_sizes_they_were_made_of():
    """A field of no known meaning follows what it was at full scale: a count of heads follows the head counts, a
    width follows widths and sums of head sizes, shrunk or not. CI's varied LongCat-Flash (seed 70 of 2026-12-08:
    6 heads, qk_head_dim 24 = nope 16 + rope 8) had its qk_head_dim taken for 4 x heads and shrunk to 16, so the
    twin split 16 values into 16 + 8 and did not run."""
    mla = {"hidden_size": 192, "num_attention_heads": 6, "num_key_value_heads": 6, "kv_lora_rank": 64,
           "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 32, "qk_head_dim": 24,
           "swa_num_attention_heads": 6, "swa_hidden_size": 384}
    twin, _ = shrink_config_dict(mla)
    assert twin["qk_head_dim"] == twin["qk_nope_head_dim"] + twin["qk_rope_head_dim"] == 24
    assert twin["swa_num_attention_heads"] == twin["num_attention_heads"] == 4  # a count follows a count
    assert twin["swa_hidden_size"] == 2 * twin["hidden_size"]  # a width follows a width
    twin, _ = shrink_config_dict(dict(mla, qk_nope_head_dim=32, qk_head_dim=40))  # one part shrinks, one does not
    assert twin["qk_head_dim"] == twin["qk_nope_head_dim"] + twin["qk_rope_head_dim"] == 16 + 8


def test_the_twin_records_every_field_it_changed_and_why():
    """One entry point: the twin, and a model a user trains at a size of their own, each with the record of every
    config field changed, from what, to what and why; the model is built at exactly that config."""
    source = resolve("deepseek-v3")
    twin = Twin.build(source)
    why = {s.path: s.why for s in twin.changes}
    assert why["hidden_size"] == "its name" and why["n_routed_experts"] == "its name"
    assert why["num_hidden_layers"] == "the shortest prefix showing every layer kind"
    full = source.config.to_dict()
    for change in twin.changes:  # every change is from the released config's value to the twin's
        assert full[change.path] == change.full != change.twin == getattr(twin.config, change.path)

    wider = Twin.build(source, layers=5, width=2, check=False)
    assert wider.config.num_hidden_layers == 5 == len(wider.layer_signatures)
    assert wider.config.hidden_size == 2 * twin.config.hidden_size
    assert wider.config.num_attention_heads == 2 * twin.config.num_attention_heads
    assert wider.config.qk_rope_head_dim == twin.config.qk_rope_head_dim  # heads grow, head sizes stay
    scaled = {s.path: (s.full, s.twin) for s in wider.changes if s.why.startswith("--")}
    assert scaled["num_hidden_layers"] == (61, 5) and scaled["hidden_size"] == (64, 128)
    assert {s.why for s in wider.changes if s.path == "hidden_size"} == {"its name", "--width 2"}
    assert wider.model.get_input_embeddings().weight.shape[-1] == 128
    with pytest.raises(OnboardError, match="may not exceed"):
        Twin.build(source, layers=62)
    with pytest.raises(OnboardError, match="at least 1"):
        Twin.build(source, width=0)


def test_a_multimodal_configs_twin_cuts_its_language_models_layers():
    """Llama 4's config holds its vision tower's layer count before its text model's: the twin and `--layers` cut
    the language model's (the causal LM is built from `text_config`), with its per-layer lists and MoE indices."""
    from onboard.twin.fields import layers_key, lm_prefix

    source = resolve("llama-4-scout")
    assert lm_prefix(source.config) == "text_config."
    assert layers_key(source.config.to_dict(), "text_config.") == "text_config.num_hidden_layers"
    twin = Twin.build(source)
    assert twin.config.num_hidden_layers == 4 and twin.config.layer_types[3] == "full_attention"
    two = Twin.build(source, layers=2, check=False)
    assert len(two.model.model.layers) == two.config.num_hidden_layers == 2 and two.config.moe_layers == [0, 1]


def test_a_per_layer_head_count_list_shrinks_and_widens_with_the_heads(tmp_path):
    """Laguna overrides its head count layer by layer (`num_attention_heads_per_layer`). The twin scales every
    layer's count as it scales the heads, to a whole multiple of its key/value heads, layers that differed still
    differing, and inspect reads each layer's count back. Left at full scale, a 2-head model's twin (4 query and 4
    key/value heads) does not run (CI's varied config laguna-794), and a 48-head model's twin keeps its 48 heads."""
    from transformers import LagunaConfig

    LagunaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=64, num_hidden_layers=3,
                 num_attention_heads_per_layer=[2, 4, 2], layer_types=["full_attention"] * 3,
                 mlp_layer_types=["dense", "sparse", "sparse"], num_experts=6, num_experts_per_tok=2,
                 vocab_size=2048).save_pretrained(tmp_path / "laguna")
    source = resolve(str(tmp_path / "laguna"))
    twin = Twin.build(source)  # runs forward and backward
    heads, kv = twin.config.num_attention_heads_per_layer, twin.config.num_key_value_heads
    assert kv == 4 and heads[0] == 4 and heads[1] > heads[0] and all(h % kv == 0 for h in heads)
    assert twin.model.model.layers[0].self_attn.q_proj.out_features == heads[0] * twin.config.head_dim
    assert {s.path: (s.full, s.twin) for s in twin.changes}["num_attention_heads_per_layer"][0] == [2, 4, 2]
    from onboard.inspect.inspection import inspect_source

    spec = inspect_source(source)[0]  # each layer's twin count read back as the layer's own full count
    assert [layer.attention.num_heads for layer in spec.layers] == [2, 4, 2]
    assert {layer.attention.num_kv_heads for layer in spec.layers} == {2}
    assert all(layer.attention.output_gate for layer in spec.layers)  # softplus(g_proj(x)) times each head
    wider = Twin.build(source, width=2, check=False)
    assert wider.config.num_attention_heads_per_layer == [2 * h for h in twin.config.num_attention_heads_per_layer]

    default = Twin.build(resolve(str(_saved(LagunaConfig(), tmp_path / "default"))), check=False)
    assert set(default.config.num_attention_heads_per_layer) == {default.config.num_attention_heads}


def _saved(config, folder):
    config.save_pretrained(folder)
    return folder


def _family_twin(family: str) -> Twin:
    from onboard.review.families import default_config
    from onboard.source import from_config

    return Twin.build(from_config(default_config(family), family))


def test_a_dict_keyed_by_layer_is_cut_with_the_layers():
    """Dots3's `per_layer_config` overrides layers by index ({"02": {...}, ...}); cut to the twin's 3 layers it
    keeps only the entries below 3 (transformers refuses keys past the layer count), where the twin once kept all 46
    layers at twin width."""
    twin = _family_twin("dots3_note_text")
    from onboard.twin.fields import truncate_layers

    assert twin.config.get_text_config().num_hidden_layers == 3 < len(twin.full_layer_signatures) == 46
    cfg = {"num_hidden_layers": 46, "per_layer_config": {"02": {"heads": 4}, "03": {"heads": 4}, "45": {}},
           "id2label": {"0": "LABEL_0", "1": "LABEL_1", "7": "LABEL_7"}}
    truncate_layers(cfg, "num_hidden_layers", 46, 1)
    assert cfg == {"num_hidden_layers": 1, "per_layer_config": {},
                   "id2label": {"0": "LABEL_0", "1": "LABEL_1", "7": "LABEL_7"}}
    assert twin.layer_signatures == twin.full_layer_signatures[:3]


def test_a_block_shared_across_layers_keeps_one_entry_per_layer_that_uses_it():
    """Zamba2's shared transformer block holds one adapter per hybrid layer: the twin's layers read it by kind (its
    list entries count with the depth, not the layer's kind), so 13 layers show both kinds twice, where the twin once
    kept all 54."""
    from onboard.twin.layers import shared_modules

    twin = _family_twin("zamba2")
    assert len(twin.layer_signatures) == 13 and len(set(twin.layer_signatures)) == 2
    stack = twin.model.get_submodule(twin.layers_path)
    hybrid = [layer for layer in stack if hasattr(layer, "shared_transformer")]
    assert len(hybrid) == 2 and len(hybrid[0].shared_transformer.feed_forward.gate_up_proj_adapter_list) == 2
    shared = shared_modules(stack)
    assert id(hybrid[0].shared_transformer) in shared and id(stack[0]) not in shared


def test_an_output_head_sized_by_a_field_of_its_own_is_shrunk():
    """Inkling2-Loop sizes its LM head by `unpadded_vocab_size`: by name it is a vocabulary; where names do not
    say so (the name taken out of the table here), the head still 200,058 rows wide sends the twin to be shrunk by
    what each field drives."""
    import re

    from onboard.twin import meanings

    twin = _family_twin("inkling2_loop_text")
    assert twin.model.get_output_embeddings().weight.shape[0] <= 512 and twin.why_probed is None
    table = list(meanings._COMPILED)
    try:
        meanings._COMPILED[:] = [(m, re.compile("vocab_size") if m == "vocab" else r) for m, r in table]
        probed = _family_twin("inkling2_loop_text")
    finally:
        meanings._COMPILED[:] = table
    assert "output head is still 200058" in probed.why_probed
    assert probed.model.get_output_embeddings().weight.shape[0] <= 512
