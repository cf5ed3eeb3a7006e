"""No subnormal floats in the runtime's cores (issue 14): every tensor the forward and the backward compute,
counted by `runtime.subnormals.SubnormalCensus`, on inputs that push toward them (log decays down to -100 a
token, sharp logits). Controls put back an unmasked decay or softmax and show the census sees the result."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import runtime.attention.decay_pairs as decay_pairs
import runtime.loss.blocks as loss_blocks
from runtime.attention import chunk_gated_delta_rule, chunk_scalar_decay, sparse_attention, ssd_chunk_scan
from runtime.attention.constant_decay import chunk_constant_decay
from runtime.attention.selective_scan import selective_scan
from runtime.loss.head import lm_head_loss
from runtime.moe.block import GroupedExperts, MoEBlock
from runtime.moe.router import RouterSpec
from runtime.subnormals import SubnormalCensus, count_subnormals, exp_or_zero, exp_or_zero_


def _census(fn, *tensors) -> SubnormalCensus:
    """Forward and backward of fn(*tensors) (floating tensors become leaves) under a census."""
    gen = torch.Generator().manual_seed(7)
    leaves = [t.detach().clone().requires_grad_() if t.is_floating_point() else t for t in tensors]
    with SubnormalCensus() as census:
        out = fn(*leaves)
        out = out[0] if isinstance(out, tuple) else out
        (out * torch.randn(out.shape, generator=gen)).sum().backward()
    return census


def _gated_delta_inputs(per_channel: bool, strength: float = 100.0):
    gen = torch.Generator().manual_seed(0)
    b, t, h, d = 1, 256, 2, 16
    q, k, v = (torch.randn(b, t, h, d, generator=gen) for _ in range(3))
    g = -torch.rand((b, t, h, d) if per_channel else (b, t, h), generator=gen) * strength
    return q, k, v, g, torch.rand(b, t, h, generator=gen)


def _gated_delta(q, k, v, g, beta):
    return chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, chunk_size=64)


def _scalar_decay_inputs(strength: float = 100.0):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 256, 2, 16, generator=gen) for _ in range(3))
    return q, k, v, -torch.rand(1, 256, 2, generator=gen) * strength


def _ssd_inputs():
    gen = torch.Generator().manual_seed(2)
    b, t, h, p, n = 1, 256, 2, 8, 8
    x = torch.randn(b, t, h, p, generator=gen)
    dt = torch.rand(b, t, h, generator=gen) * 6  # softplus(dt) * A down to about -100 a token
    a = -torch.rand(h, generator=gen) * 16
    return x, dt, a, torch.randn(b, t, 1, n, generator=gen), torch.randn(b, t, 1, n, generator=gen)


def _selective_scan_inputs():
    gen = torch.Generator().manual_seed(3)
    b, d, n, t = 1, 8, 4, 128
    x, z = (torch.randn(b, d, t, generator=gen) for _ in range(2))
    dt = torch.rand(b, d, t, generator=gen) * 6
    a = -torch.rand(d, n, generator=gen) * 16 - 1
    return x, dt, a, torch.randn(b, n, t, generator=gen), torch.randn(b, n, t, generator=gen), torch.ones(d), z


CASES = {
    "gated delta rule, a decay per head": (_gated_delta, lambda: _gated_delta_inputs(False)),
    "KDA, a decay per key channel": (_gated_delta, lambda: _gated_delta_inputs(True)),
    "scalar decay (lightning, Mamba2)": (lambda q, k, v, g: chunk_scalar_decay(q, k, v, g, chunk_size=64),
                                         _scalar_decay_inputs),
    "constant decay (lightning)": (lambda qkv: chunk_constant_decay(qkv, torch.tensor([-100.0, -0.4]), chunk_size=64),
                                   lambda: (torch.cat(_scalar_decay_inputs()[:3], -1),)),
    "Mamba2 SSD": (lambda x, dt, a, b, c: ssd_chunk_scan(x, dt, a, b, c, 64, dt_bias=torch.zeros(a.shape[0]),
                                                         dt_softplus=True), _ssd_inputs),
    "Mamba1 selective scan": (lambda x, dt, a, b, c, d, z: selective_scan(x, dt, a, b, c, d, z, delta_softplus=True),
                              _selective_scan_inputs),
}


@pytest.mark.parametrize("case", list(CASES))
def test_decay_cores_make_no_subnormals_under_strong_decay(case):
    fn, make = CASES[case]
    census = _census(fn, *make())
    assert census.ops > 50  # the census saw the core run, forward and backward
    assert census.total == 0, census.worst()


def test_an_unmasked_decay_makes_subnormals_the_census_sees(monkeypatch):
    """Control: with no floor (every decay kept, down to exp(-6400)), the same gated-delta core fills its
    pair decays and triangular inverse with subnormals."""
    monkeypatch.setattr(decay_pairs, "LOG_DECAY_ZERO", float("-inf"))
    census = _census(_gated_delta, *_gated_delta_inputs(False))
    assert census.total > 1000, census.worst()


def _sharp_loss_inputs():
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 64, 48, generator=gen) * 10  # logits spread over hundreds: most probabilities < e^-87
    return hidden, torch.randn(1000, 48, generator=gen), torch.randint(0, 1000, (2, 64), generator=gen)


@pytest.mark.parametrize("chunks", [dict(chunk_tokens=32), dict(chunk_tokens=32, chunk_vocab=256)])
def test_chunked_losses_make_no_subnormals_on_sharp_logits(chunks):
    hidden, weight, labels = _sharp_loss_inputs()
    census = _census(lambda h, w: lm_head_loss(h, w, labels, **chunks).reshape(1), hidden, weight)
    assert census.total == 0, census.worst()


def test_an_unmasked_softmax_makes_subnormals_the_census_sees(monkeypatch):
    monkeypatch.setattr(loss_blocks, "LOG_PROB_ZERO", float("-inf"))
    hidden, weight, labels = _sharp_loss_inputs()
    census = _census(lambda h, w: lm_head_loss(h, w, labels, chunk_tokens=32).reshape(1), hidden, weight)
    assert census.total > 1000, census.worst()


def test_sparse_attention_makes_no_subnormals_on_sharp_scores():
    gen = torch.Generator().manual_seed(5)
    b, h, s, d, k = 1, 4, 96, 32, 24
    q = torch.randn(b, h, s, d, generator=gen) * 10
    keys, values = torch.randn(b, 1, s, d, generator=gen), torch.randn(b, 1, s, d, generator=gen)
    picks = torch.stack([torch.randperm(s, generator=gen)[:k] for _ in range(s)]).unsqueeze(0)
    picks = torch.where(picks <= torch.arange(s)[None, :, None], picks, -1)
    census = _census(lambda q, kk, vv: sparse_attention(q, kk, vv, picks, d ** -0.5), q, keys, values)
    assert census.total == 0, census.worst()


def test_moe_block_makes_no_subnormals():
    gen = torch.Generator().manual_seed(6)
    e, hid, ffn = 6, 16, 12
    block = MoEBlock(torch.nn.Parameter(torch.randn(e, hid, generator=gen)), RouterSpec(num_experts=e, top_k=2),
                     GroupedExperts(torch.nn.Parameter(torch.randn(e, 2 * ffn, hid, generator=gen) * 0.3),
                                    torch.nn.Parameter(torch.randn(e, hid, ffn, generator=gen) * 0.3),
                                    activation=F.silu))
    census = _census(block, torch.randn(2, 32, hid, generator=gen) * 4)
    assert census.total == 0, census.worst()


def test_the_census_and_the_floors():
    tiny = torch.finfo(torch.float32).tiny
    x = torch.tensor([0.0, tiny, tiny / 4, -tiny / 8, 1.0])
    assert count_subnormals(x) == 2 and count_subnormals(x.long()) == 0
    logs = torch.tensor([0.0, -10.0, -24.0, -24.5, -200.0, float("-inf")], requires_grad=True)
    out = exp_or_zero(logs, -24.0)
    assert out.tolist()[:3] == pytest.approx([1.0, torch.e ** -10, torch.e ** -24]) and out.tolist()[3:] == [0, 0, 0]
    out.sum().backward()
    assert torch.isfinite(logs.grad).all() and logs.grad[3:].tolist() == [0, 0, 0]
    assert exp_or_zero_(logs.detach().clone(), -24.0).tolist() == out.tolist()
    with SubnormalCensus() as census:
        torch.full((3,), 1e-30) * torch.full((3,), 1e-10)  # 1e-40: subnormal
        torch.empty(1000)  # an allocation's garbage is not a result
    assert census.total == 3 and census.worst() == "mul 3"
