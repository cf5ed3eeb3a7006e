"""Selective scan (Mamba1): the runtime's chunked doubling scan against transformers' own `mamba_selective_scan`
(jamba's module; mamba, falcon_mamba and zamba carry the same function) and against a plain token loop in fp64:
outputs, last state, and the gradient of every input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.jamba.modeling_jamba import mamba_selective_scan

from runtime.attention import selective_scan as scan_module
from runtime.attention.selective_scan import selective_scan
from tests.helpers import rel

NAMES = ["x", "dt", "A", "B", "C", "D", "z", "delta_bias"]


def token_loop(x, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False,
               late_decay=False):
    """The recurrence one token at a time, every op in the inputs' dtype; B, C (batch, N, T) or (batch, G, N, T).
    `late_decay` plants a bug: each token's decay is applied one token late."""
    if delta_bias is not None:
        dt = dt + delta_bias[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    batch, channels, length = x.shape
    if B.dim() == 3:
        B, C = B[:, None], C[:, None]
    per_group = channels // B.shape[1]
    B, C = B.repeat_interleave(per_group, 1), C.repeat_interleave(per_group, 1)  # (batch, D, N, T)
    h = x.new_zeros(batch, channels, A.shape[-1])
    ys = []
    for t in range(length):
        step = t - 1 if late_decay and t > 0 else t
        h = torch.exp(A * dt[..., step, None]) * h + (dt[..., t] * x[..., t])[..., None] * B[..., t]
        ys.append((h * C[..., t]).sum(-1))
    y = torch.stack(ys, -1)
    if D is not None:
        y = y + x * D[:, None]
    if z is not None:
        y = y * F.silu(z)
    return (y, h) if return_last_state else y


def problem(batch=2, channels=6, length=37, n=4, groups=0, dtype=torch.float64, seed=0):
    """Inputs as Mamba draws them (A = -exp(A_log), dt around softplus' knee), rounded through fp32 so that
    transformers' `.float()` casts of x and B lose nothing in fp64."""
    gen = torch.Generator().manual_seed(seed)
    bc = (batch, groups, n, length) if groups else (batch, n, length)
    tensors = [torch.randn(batch, channels, length, generator=gen), torch.randn(batch, channels, length, generator=gen) - 1,
               -torch.exp(torch.rand(channels, n, generator=gen) * 2), torch.randn(*bc, generator=gen),
               torch.randn(*bc, generator=gen), torch.randn(channels, generator=gen),
               torch.randn(batch, channels, length, generator=gen), torch.randn(channels, generator=gen) * 0.5]
    return [t.to(dtype) for t in tensors]


def outputs_and_grads(fn, tensors, use, delta_softplus=True, seed=1, **kwargs):
    """fn on fresh leaves, `use` naming which of D / z / delta_bias are passed; a random weighting of the
    output and of the last state is backpropagated."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    optional = {name: leaves[i] for i, name in ((5, "D"), (6, "z"), (7, "delta_bias")) if name in use}
    y, last = fn(*leaves[:5], **optional, delta_softplus=delta_softplus, return_last_state=True, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    ((y * torch.randn(y.shape, generator=gen, dtype=y.dtype)).sum()
     + (last * torch.randn(last.shape, generator=gen, dtype=last.dtype)).sum()).backward()
    grads = {name: leaf.grad for name, leaf in zip(NAMES, leaves) if leaf.grad is not None}
    return {"y": y.detach(), "last": last.detach(), **{f"d{k}": v for k, v in grads.items()}}


def max_rel(ours, theirs):
    assert ours.keys() == theirs.keys()
    return {k: rel(ours[k], theirs[k]) for k in theirs}


CASES = [("D", "z", "delta_bias"), (), ("z",), ("D", "delta_bias")]


@pytest.mark.parametrize("use", CASES)
@pytest.mark.parametrize("delta_softplus", [True, False])
def test_matches_transformers_fp64(use, delta_softplus):
    tensors = problem()
    if not delta_softplus:  # callers then pass dt > 0 themselves (growing "decays" would overflow both)
        tensors[1], tensors[7] = F.softplus(tensors[1]), tensors[7].abs()
    ours = outputs_and_grads(selective_scan, tensors, use, delta_softplus, chunk_size=8)  # 37 = 4 x 8 + 5
    theirs = outputs_and_grads(mamba_selective_scan, tensors, use, delta_softplus)
    errors = max_rel(ours, theirs)
    # transformers casts x and B to fp32 on the way in, so their gradients come back rounded to fp32
    assert all(e < (1e-6 if k in ("dx", "dB") else 1e-12) for k, e in errors.items()), errors
    assert ours["y"].dtype == theirs["y"].dtype == ours["last"].dtype == theirs["last"].dtype == torch.float64


@pytest.mark.parametrize("length,chunk", [(37, 8), (64, 64), (5, 16), (100, 32), (1, 4)])
def test_matches_transformers_fp32(length, chunk):
    tensors = problem(length=length, dtype=torch.float32, channels=16, n=8)
    use = ("D", "z", "delta_bias")
    ours = outputs_and_grads(selective_scan, tensors, use, chunk_size=chunk)
    theirs = outputs_and_grads(mamba_selective_scan, tensors, use)
    errors = max_rel(ours, theirs)
    assert all(e < 1e-5 for e in errors.values()), errors
    assert ours["y"].dtype == theirs["y"].dtype == torch.float32


def test_matches_token_loop_fp64():
    """Against the plain loop (no fp32 casts anywhere), default chunk, a length longer than one chunk."""
    tensors = problem(length=150, channels=4)
    use = ("D", "z", "delta_bias")
    errors = max_rel(outputs_and_grads(selective_scan, tensors, use), outputs_and_grads(token_loop, tensors, use))
    assert all(e < 1e-12 for e in errors.values()), errors


def test_grouped_b_c_matches_token_loop():
    """B, C with a group dim (batch, G, N, T), as mamba_ssm's kernel takes them: channel d reads group d // (D/G)."""
    tensors = problem(channels=6, groups=3, length=21)
    use = ("D", "z", "delta_bias")
    errors = max_rel(outputs_and_grads(selective_scan, tensors, use, chunk_size=4),
                     outputs_and_grads(token_loop, tensors, use))
    assert all(e < 1e-12 for e in errors.values()), errors


def test_return_convention_and_no_last_state():
    x, dt, A, B, C, D, z, bias = problem(dtype=torch.float32, length=9)
    y = selective_scan(x, dt, A, B, C, D, z, bias, True)
    assert isinstance(y, torch.Tensor) and y.shape == x.shape
    reference = mamba_selective_scan(x, dt, A, B, C, D, z, bias, True)
    assert torch.allclose(y, reference, rtol=1e-5, atol=1e-5)
    y, last = selective_scan(x, dt, A, B, C, return_last_state=True, use_mambapy=False, use_associative_scan=False)
    assert last.shape == (x.shape[0], x.shape[1], A.shape[1])


def test_gradcheck():
    x, dt, A, B, C, D, z, bias = (t.requires_grad_() for t in problem(batch=1, channels=2, length=7, n=2, seed=3))

    def fn(*args):
        return selective_scan(*args[:5], D=args[5], z=args[6], delta_bias=args[7], delta_softplus=True,
                              return_last_state=True, chunk_size=4)

    assert torch.autograd.gradcheck(fn, (x, dt, A, B, C, D, z, bias))


def test_planted_late_decay_is_caught():
    """The same comparison flags a scan whose decay lands one token late."""
    tensors = problem()
    use = ("D", "z", "delta_bias")
    theirs = outputs_and_grads(mamba_selective_scan, tensors, use)
    planted = outputs_and_grads(lambda *a, **k: token_loop(*a, **k, late_decay=True), tensors, use)
    errors = max_rel(planted, theirs)
    assert errors["y"] > 1e-3 and errors["last"] > 1e-3 and errors["ddt"] > 1e-3, errors


def test_planted_late_decay_in_the_runtime_is_caught(monkeypatch):
    """The runtime's own chunked path with each decay shifted one token late fails the comparison."""
    original = scan_module._scan

    def late(a, u, a2, u2, reverse=False):
        if not reverse:
            a2.copy_(a)
            a[..., 1:, :] = a2[..., :-1, :]
            a[..., 0, :] = 1
        return original(a, u, a2, u2, reverse)

    tensors = problem()
    use = ("D", "z", "delta_bias")
    theirs = outputs_and_grads(mamba_selective_scan, tensors, use)
    assert all(e < 1e-6 for e in max_rel(outputs_and_grads(selective_scan, tensors, use, chunk_size=8), theirs).values())
    monkeypatch.setattr(scan_module, "_scan", late)
    errors = max_rel(outputs_and_grads(selective_scan, tensors, use, chunk_size=8), theirs)
    assert errors["y"] > 1e-3 and errors["last"] > 1e-3 and errors["ddt"] > 1e-3, errors


def test_bfloat16_follows_transformers_dtypes():
    """bf16 activations with fp32 A and D, as Jamba's mixer passes them: the scan runs in fp32; output and
    last-state dtypes are transformers' (fp32 once D promotes; the state fp32)."""
    x, dt, A, B, C, D, z, bias = problem(dtype=torch.float32, length=20)
    x, dt, B, C, z, bias = (t.bfloat16() for t in (x, dt, B, C, z, bias))
    ours = selective_scan(x, dt, A, B, C, D, z, bias, True, True, chunk_size=8)
    theirs = mamba_selective_scan(x, dt, A, B, C, D, z, bias, True, True)
    assert [t.dtype for t in ours] == [t.dtype for t in theirs]
    for a, b in zip(ours, theirs):  # transformers rounds each state to bf16 before contracting with C
        assert rel(a, b) < 2e-2


def test_chunk_state_memory_is_chunk_sized():
    """Backward saves the inputs and one (batch, D, N) state per chunk, nothing of size (batch, D, T, N)."""
    x, dt, A, B, C = (t.requires_grad_() for t in problem(dtype=torch.float32, length=64, n=8)[:5])
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        selective_scan(x, dt, A, B, C, delta_softplus=True, chunk_size=16)
    full = x.numel() * A.shape[1]
    assert max(saved) < full and sum(saved) < full, (saved, full)
