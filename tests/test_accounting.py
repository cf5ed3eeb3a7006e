"""Full-scale cost formulas."""

import pytest

from onboard.accounting import _avg_context, costs, memory_bytes, mixer_flops
from onboard.spec import Attention


def test_average_context():
    assert _avg_context(4, None) == pytest.approx(2.5)  # 1+2+3+4 over 4
    assert _avg_context(6, 2) == pytest.approx((1 + 2 + 2 + 2 + 2 + 2) / 6)
    assert _avg_context(8, 100) == _avg_context(8, None)


def test_windowed_and_sparse_attention_cost_less_than_full():
    full = Attention(kind="softmax", num_heads=8, head_dim=64)
    window = Attention(kind="sliding", num_heads=8, head_dim=64, window=512)
    dsa = Attention(kind="sparse:dsa", num_heads=8, head_dim=64, index_topk=512, index_heads=4, index_head_dim=32)
    seq = 32768
    assert mixer_flops(window, seq) < mixer_flops(dsa, seq) < mixer_flops(full, seq)
    assert mixer_flops(full, seq) == pytest.approx(2 * 8 * 128 * (seq + 1) / 2)
    linear = Attention(kind="linear:kda", num_heads=8, head_dim=64)
    assert mixer_flops(linear, 1024) == mixer_flops(linear, 1_000_000)  # constant per token


def test_training_flops_are_about_six_per_active_parameter(inspected):
    spec, _ = inspected("qwen3-8b")
    c = costs(spec, seq_len=1)
    assert c.flops_per_token_training == pytest.approx(6 * spec.params_active, rel=1e-3)
    assert costs(spec, 8192).attention_share > costs(spec, 1024).attention_share


def test_memory_by_dtype():
    m = memory_bytes(1000)
    assert (m["weights"], m["gradients"], m["master_weights"], m["optimizer"]) == (2000, 4000, 4000, 8000)
    assert m["total"] == 18000
    assert memory_bytes(1000, weights="fp32", master=None)["total"] == 4000 + 4000 + 8000
