"""A family onboard has never seen, with names that match nothing, is still read correctly."""

from pathlib import Path

import pytest

from onboard.inspect.inspection import inspect_model

NOVEL = str(Path(__file__).resolve().parents[1] / "fixtures" / "novel_moe")


@pytest.fixture(scope="module")
def spec():
    spec, _ = inspect_model(NOVEL, trust_remote_code=True)
    return spec


def test_moe_read_from_behaviour(spec):
    assert [layer.mlp.kind for layer in spec.layers] == ["dense"] + ["moe"] * 11
    moe = spec.layers[1].mlp
    assert (moe.num_experts, moe.top_k, moe.expert_ffn, moe.expert_layout) == (32, 3, 1024, "modules")
    assert moe.router.score == "sigmoid" and not moe.router.renormalize and not moe.router.group_limited
    assert moe.activation == "gelu" and moe.gated
    assert moe.num_shared_experts == 1 and moe.shared_expert_ffn == 1024  # the always-on helper
    assert spec.layers[0].mlp.ffn == 5632


def test_windows_read_from_the_mask(spec):
    kinds = [layer.attention.kind for layer in spec.layers]
    assert kinds == ["softmax", "sliding"] * 6
    assert spec.layers[1].attention.window == 1024
    assert spec.layers[0].attention.num_heads == 16 and spec.layers[0].attention.head_dim == 128


def test_totals_at_full_scale(spec):
    hidden, vocab = 2048, 32000
    attention = 4 * hidden * hidden
    expert = 3 * hidden * 1024
    dense = 3 * hidden * 5632
    norms = 2 * hidden
    layers = (attention + dense + norms) + 11 * (attention + norms + hidden * 32 + 33 * expert)
    total = 2 * vocab * hidden + layers + hidden
    assert spec.params_total == total
    routed_idle = 11 * (32 - 3) * expert
    assert spec.params_active == total - routed_idle - vocab * hidden
