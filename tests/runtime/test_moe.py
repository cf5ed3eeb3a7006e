"""Runtime MoE pieces against plain PyTorch written here, forward and backward."""

import pytest
import torch
import torch.nn.functional as F

from runtime.moe.block import GroupedExperts, MoEBlock
from runtime.moe.dispatch import permute, sort_by_expert, unpermute
from runtime.moe.grouped import grouped_mm
from runtime.moe.losses import (
    load_balancing_loss,
    router_z_loss,
    sequence_balancing_loss,
)
from runtime.moe.router import RouterSpec, route, update_expert_bias


def test_grouped_mm_matches_loop_including_empty_experts():
    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 7, 0, 4])
    x = torch.randn(int(counts.sum()), 6, requires_grad=True)
    w = torch.randn(5, 6, 3, requires_grad=True)
    y = grouped_mm(x, w, counts)
    (y * torch.arange(3.0)).sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    parts, start = [], 0
    for e, n in enumerate(counts.tolist()):
        parts.append(x2[start:start + n] @ w2[e])
        start += n
    (torch.cat(parts) * torch.arange(3.0)).sum().backward()
    assert torch.allclose(y, torch.cat(parts), atol=1e-6)
    assert torch.allclose(x.grad, x2.grad, atol=1e-6) and torch.allclose(w.grad, w2.grad, atol=1e-6)
    assert w.grad[1].abs().sum() == 0  # an expert with no tokens gets a zero gradient
    # the (E, out, in) layout gives the same numbers, gradient in its own layout
    wt = w.detach().transpose(-2, -1).contiguous().requires_grad_()
    x3 = x.detach().clone().requires_grad_()
    y3 = grouped_mm(x3, wt, counts, out_in=True)
    (y3 * torch.arange(3.0)).sum().backward()
    assert torch.allclose(y3, y, atol=1e-6) and torch.allclose(wt.grad, w.grad.transpose(-2, -1), atol=1e-6)
    assert torch.allclose(x3.grad, x.grad, atol=1e-6)


def test_router_group_limited_with_bias():
    torch.manual_seed(0)
    logits = torch.randn(16, 8)
    bias = torch.randn(8)
    spec = RouterSpec(num_experts=8, top_k=2, score="sigmoid", renormalize=True, n_group=4, topk_group=2,
                      scaling=2.0)
    r = route(logits, spec, bias)
    scores = torch.sigmoid(logits)
    choice = (scores + bias).view(16, 4, 2)
    groups = choice.topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices
    for t in range(16):
        allowed = {int(g) * 2 + j for g in groups[t] for j in range(2)}
        assert set(r.indices[t].tolist()) <= allowed
        w = scores[t, r.indices[t]]
        assert torch.allclose(r.weights[t], 2.0 * w / w.sum())
    assert r.tokens_per_expert(8).sum() == 32


def test_topk_then_softmax_is_renormalised():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    r = route(logits, RouterSpec(num_experts=4, top_k=2, order="topk_then_score"))
    assert r.indices.tolist() == [[1, 2]]
    assert torch.allclose(r.weights, torch.softmax(torch.tensor([[3.0, 2.0]]), -1))


def test_dispatch_round_trip_and_capacity():
    torch.manual_seed(0)
    indices = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])
    x = torch.randn(4, 5)
    d = sort_by_expert(indices, 4)
    assert d.counts.tolist() == [4, 2, 1, 1]
    back = unpermute(permute(x, d), d, 4)
    assert torch.allclose(back, 2 * x)
    capped = sort_by_expert(indices, 4, capacity_factor=0.5)  # capacity ceil(0.5 * 8 / 4) = 1 per expert
    assert capped.counts.tolist() == [1, 1, 1, 1] and int(capped.keep.sum()) == 4


def test_moe_block_matches_a_plain_loop():
    torch.manual_seed(0)
    E, H, F_, k = 6, 8, 5, 2
    gate_up = torch.nn.Parameter(torch.randn(E, 2 * F_, H) * 0.3)
    down = torch.nn.Parameter(torch.randn(E, H, F_) * 0.3)
    router = torch.nn.Parameter(torch.randn(E, H) * 0.3)
    shared = torch.nn.Linear(H, H, bias=False)
    block = MoEBlock(router, RouterSpec(num_experts=E, top_k=k, renormalize=True),
                     GroupedExperts(gate_up, down, activation=F.silu), shared=[shared])
    x = torch.randn(3, 7, H)
    out = block(x)
    flat = x.reshape(-1, H)
    probs = torch.softmax(flat @ router.T, -1)
    w, idx = probs.topk(k, -1)
    w = w / w.sum(-1, keepdim=True)
    expected = shared(flat)
    for t in range(flat.shape[0]):
        for j in range(k):
            e = int(idx[t, j])
            g, u = (gate_up[e] @ flat[t]).chunk(2)
            expected[t] += w[t, j] * (down[e] @ (F.silu(g) * u))
    assert torch.allclose(out.reshape(-1, H), expected, atol=1e-5)
    out.sum().backward()
    assert gate_up.grad is not None and router.grad is not None and shared.weight.grad is not None
    assert block.tokens_per_expert.sum() == flat.shape[0] * k


def test_losses_and_bias_update():
    torch.manual_seed(0)
    r = route(torch.randn(32, 4), RouterSpec(num_experts=4, top_k=2))
    assert load_balancing_loss(r, 4) >= 1.0 - 1e-4  # minimum 1 at perfect balance
    assert sequence_balancing_loss(r, 4, batch=2) > 0 and router_z_loss(r) > 0
    bias = torch.zeros(4)
    update_expert_bias(bias, torch.tensor([10, 0, 5, 5]), rate=0.1)
    assert bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.0])


def test_fused_swiglu_matches_autograd():
    from runtime.moe.gating import is_silu, swiglu

    torch.manual_seed(0)
    h = torch.randn(9, 8, dtype=torch.float64, requires_grad=True)
    scale = torch.rand(9, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu, (h, scale))
    g, u = h.chunk(2, -1)
    assert torch.allclose(swiglu(h, scale), F.silu(g) * u * scale[:, None])
    assert is_silu(torch.nn.SiLU()) and is_silu(F.silu) and not is_silu(F.gelu)
