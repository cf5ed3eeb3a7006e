"""Regression tests for the families issue 13 found described wrong on configs other than their defaults, each
built from the issue's description: small configs of the family, saved with `save_pretrained` and read back as a
user's checkpoint folder. What each layer should be is read from the model's own structure
(`tests.variety.structure`), which shares no reading with the matchers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from onboard.bundle.make import adapt
from onboard.inspect.inspection import inspect_source
from onboard.review.families import UNSUPPORTED, default_config, discover
from onboard.source import resolve
from onboard.twin import instantiate
from tests.variety.structure import disagreements, expected

pytestmark = pytest.mark.slow  # adapts and inspects whole twins: about two minutes


def _checkpoint(tmp_path, config) -> str:
    config.save_pretrained(tmp_path)
    return str(tmp_path)


def _inspect_against_structure(folder: str):
    source = resolve(folder)
    spec = inspect_source(source)[0]
    return spec, disagreements(spec, expected(source.config, instantiate(source, device="meta")))


def test_recurrent_gemma_block_diagonal_gates_are_no_experts(tmp_path):
    """RecurrentGemma's RG-LRU keeps its gates as (heads, width, width) stacks applied to every token, one slice
    of the channels each: nothing routes, so no layer is MoE, and the recurrent block is its token mixer."""
    config = AutoConfig.for_model("recurrent_gemma", hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
                                  head_dim=32, intermediate_size=256, vocab_size=128, num_hidden_layers=3,
                                  lru_width=64, block_types=["recurrent", "recurrent", "attention"])
    spec, problems = _inspect_against_structure(_checkpoint(tmp_path, config))
    assert [p for p in problems if "mlp" in p or "mixer" in p] == []
    assert [layer.mlp.kind for layer in spec.layers] == ["dense"] * 3
    assert spec.layers[0].attention.kind not in ("none", "softmax") and spec.layers[2].attention.kind in ("softmax", "sliding")


def test_minimax_lightning_layers_in_another_mix_and_block_size_are_linear(tmp_path):
    """MiniMax with its lightning layer first and blocks shorter than the twin's sequence: the scores are
    computed block by block, so no (sequence x sequence) product exists, and the layer is still linear."""
    config = AutoConfig.for_model("minimax", hidden_size=128, num_attention_heads=4, num_key_value_heads=1,
                                  head_dim=32, intermediate_size=96, vocab_size=128, num_local_experts=4,
                                  num_experts_per_tok=2, num_hidden_layers=4, block_size=8,
                                  layer_types=["linear_attention", "full_attention", "full_attention",
                                               "linear_attention"])
    spec, problems = _inspect_against_structure(_checkpoint(tmp_path, config))
    assert problems == []
    assert [layer.attention.kind for layer in spec.layers] == ["linear:lightning", "softmax", "softmax",
                                                                "linear:lightning"]


def test_inkling2_with_a_small_vocabulary_adapts(tmp_path):
    """A small vocabulary whose head scores fewer tokens than the embedding table holds (the unpadded vocabulary,
    as released inkling2 configs have): the twin's labels must stay below the head's width ("Target 125 is out
    of bounds" otherwise)."""
    config = default_config("inkling2_text")
    config.vocab_size, config.unpadded_vocab_size = 128, 120
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(getattr(config, name, None), int) and getattr(config, name) >= 128:
            setattr(config, name, 1)
    _, verification = adapt(resolve(_checkpoint(tmp_path / "model", config)), tmp_path / "bundle")
    assert verification.passed, verification.note


def test_dbrx_is_discovered_and_builds():
    """DBRX keeps its expert count in ffn_config (a nested part) and its default config lacks the rope_theta and
    the q, k, v clip its attention needs (completed from the released config): it is discovered, builds, and is
    supported (its flat experts: tests/onboard/test_flat_experts.py)."""
    assert "dbrx" in discover() and "dbrx" not in UNSUPPORTED
    config = default_config("dbrx")
    assert config.attn_config.clip_qkv == 8 and config.attn_config.rope_theta == 500000.0
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.parametrize("family", ["bamba", "nemotron_h"])
def test_configs_written_by_save_pretrained_with_infinities_inspect(tmp_path, family):
    """transformers writes an infinite time_step_limit as {"__float__": "Infinity"}; it reads back."""
    config = default_config(family)
    folder = _checkpoint(tmp_path, config)
    assert '"__float__"' in (tmp_path / "config.json").read_text()
    spec, _ = _inspect_against_structure(folder)
    assert spec.num_layers > 0
