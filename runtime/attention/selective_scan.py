"""Selective scan (Mamba1, as in Jamba, Mamba, FalconMamba, Zamba), chunked, forward and our own backward.

Per channel d and state n the recurrence is

    h_t = a_t h_{t-1} + u_t,   a_t = exp(A[d, n] dt_t[d]),   u_t = dt_t[d] B_t[n] x_t[d]
    y_t[d] = sum_n C_t[n] h_t[d, n]

transformers' fallback (`mamba_selective_scan`) runs it as a Python loop over tokens on (batch, D, T, N)
tensors it materialises whole (discrete A, deltaB_u), and autograd keeps every state. Here the tokens are cut
into chunks of `chunk_size`; inside a chunk the scan is a doubling (Hillis-Steele) scan: log2(chunk) steps,
each combining every position with the one 2^k earlier, (a, u) <- (a a', u + a u'). Only decay products
(each factor <= 1 when A dt <= 0) are ever formed, never exp of a positive cumulative sum, so no step can
overflow. A loop over chunks carries the state; only the (batch, D, N) state at each chunk start is kept.

The backward is written out: the gradient of the state obeys the reverse recurrence

    g_t = C_t dy_t + a_{t+1} g_{t+1}

run with the same doubling scan backwards through each chunk (last chunk first), carrying
a_{t+1} g_{t+1} across chunk boundaries. Each chunk's states are recomputed from the saved chunk-start
state rather than stored, so memory stays at a few chunk-sized (batch, D, chunk, N) buffers.

B and C may carry a group dim (batch, G, N, T) as in mamba_ssm's kernel: channel d reads group d // (D / G).
The bias, softplus, D skip and z gate are cheap (batch, D, T) ops left to autograd around the core.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def _grouped(t: torch.Tensor, groups: int) -> torch.Tensor:
    """(batch, D, T) -> (batch, G, D / G, T)."""
    return t.reshape(t.shape[0], groups, t.shape[1] // groups, t.shape[2])


def _scan(a: torch.Tensor, u: torch.Tensor, reverse: bool = False):
    """Along dim -2: u_t <- u_t + a_t u_{t-1} (u_t + a_t u_{t+1} if reverse) from zero, in log2(L) doubling
    steps, each combining every position with the one `step` earlier (later). Returns (a, u): u the scan, a the
    prefix (suffix) products of the decays. Two fused ops a step, ping-ponging between two buffer pairs (the
    inputs are overwritten)."""
    length = a.shape[-2]
    a2, u2 = torch.empty_like(a), torch.empty_like(u)
    step = 1
    while step < length:
        if reverse:
            new, old, keep = slice(None, -step), slice(step, None), slice(length - step, None)
        else:
            new, old, keep = slice(step, None), slice(None, -step), slice(None, step)
        torch.addcmul(u[..., new, :], a[..., new, :], u[..., old, :], out=u2[..., new, :])
        torch.mul(a[..., new, :], a[..., old, :], out=a2[..., new, :])
        u2[..., keep, :] = u[..., keep, :]
        a2[..., keep, :] = a[..., keep, :]
        a, a2, u, u2 = a2, a, u2, u
        step *= 2
    return a, u


def _chunk_states(x, dt, A, B, h0, keep_decays: bool):
    """States of one chunk. x, dt (b, G, Dg, L); A (G, Dg, N); B (b, G, L, N); h0 (b, G, Dg, N).
    Returns h (b, G, Dg, L, N) and, with `keep_decays`, the single-step decays a (b, G, Dg, L, N)."""
    a = torch.exp(A[:, :, None, :] * dt[..., None])
    u = (dt * x)[..., None] * B[:, :, None]
    prefix, h = _scan(a.clone() if keep_decays else a, u)
    h.addcmul_(prefix, h0[..., None, :])
    return h, (a if keep_decays else None)


class SelectiveScan(torch.autograd.Function):
    """Core scan, compute dtype throughout. x, dt (b, G, Dg, T); A (G, Dg, N); B, C (b, G, T, N).
    Returns y (b, G, Dg, T) and the last state (b, G, Dg, N)."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, chunk: int):
        batch, groups, dg, length = x.shape
        n = A.shape[-1]
        h = x.new_zeros(batch, groups, dg, n)
        y = x.new_empty(batch, groups, dg, length)
        starts = []
        for t0 in range(0, length, chunk):
            t1 = min(t0 + chunk, length)
            starts.append(h)
            hs, _ = _chunk_states(x[..., t0:t1], dt[..., t0:t1], A, B[:, :, t0:t1], h, False)
            y[..., t0:t1] = torch.einsum("bgdln,bgln->bgdl", hs, C[:, :, t0:t1])
            h = hs[..., -1, :].clone()
        ctx.save_for_backward(x, dt, A, B, C, torch.stack(starts) if starts else h[None])
        ctx.chunk = chunk
        return y, h

    @staticmethod
    def backward(ctx, dy, dlast):
        x, dt, A, B, C, starts = ctx.saved_tensors
        chunk, length = ctx.chunk, x.shape[-1]
        dx, ddt, dB, dC = (torch.zeros_like(t) for t in (x, dt, B, C))
        dA = torch.zeros_like(A)
        dy = torch.zeros_like(x) if dy is None else dy
        carry = torch.zeros_like(starts[0]) if dlast is None else dlast.clone()  # gradient into h_{t1 - 1}
        for index in reversed(range(len(starts))):
            t0 = index * chunk
            t1 = min(t0 + chunk, length)
            xs, dts, Bs, Cs, h0 = x[..., t0:t1], dt[..., t0:t1], B[:, :, t0:t1], C[:, :, t0:t1], starts[index]
            hs, a = _chunk_states(xs, dts, A, Bs, h0, True)
            dys = dy[..., t0:t1]
            dC[:, :, t0:t1] = torch.einsum("bgdln,bgdl->bgln", hs, dys)
            g = dys[..., None] * Cs[:, :, None]
            decay = torch.empty_like(a)  # decay[t] = a[t + 1]; the last one multiplies nothing in the chunk
            decay[..., :-1, :] = a[..., 1:, :]
            decay[..., -1, :] = 1
            decay, g = _scan(decay, g, reverse=True)
            g.addcmul_(decay, carry[..., None, :])
            # h_{t-1}, reusing hs: shift it one token later with the chunk-start state in front
            hs = torch.cat((h0[..., None, :], hs[..., :-1, :]), -2)
            carry = a[..., 0, :] * g[..., 0, :]
            w = g * B[:, :, None, t0:t1]
            gb = w.sum(-1)  # sum_n g_t B_t[n]
            dx[..., t0:t1] = gb * dts
            dB[:, :, t0:t1] = torch.einsum("bgdln,bgdl->bgln", g, dts * xs)
            w = hs.mul_(g).mul_(a)  # dL/da_t * a_t
            ddt[..., t0:t1] = gb * xs + torch.einsum("bgdln,gdn->bgdl", w, A)
            dA += torch.einsum("bgdln,bgdl->gdn", w, dts)
        return dx, ddt, dA, dB, dC, None


def selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   return_last_state=False, *, chunk_size: int = CHUNK, **kwargs):
    """Drop-in for transformers' `mamba_selective_scan` (jamba / mamba / falcon_mamba / zamba; their default
    path): hidden_states, dt, z (batch, D, T); A (D, N); B, C (batch, N, T) or (batch, G, N, T); D and
    delta_bias (D,). Returns y (batch, D, T), and the last state (batch, D, N) with `return_last_state`.
    Other keyword arguments (use_mambapy, use_associative_scan) are accepted and ignored."""
    input_dtype = hidden_states.dtype
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    compute = torch.promote_types(torch.promote_types(A.dtype, dt.dtype), torch.float32)
    batch, channels, length = hidden_states.shape
    if B.dim() == 3:
        B, C = B[:, None], C[:, None]
    groups = B.shape[1]
    y, last = SelectiveScan.apply(
        _grouped(hidden_states.to(compute), groups), _grouped(dt.to(compute), groups),
        A.to(compute).reshape(groups, channels // groups, A.shape[-1]),
        B.to(compute).transpose(-1, -2), C.to(compute).transpose(-1, -2), chunk_size)
    scan_output = y.reshape(batch, channels, length).to(input_dtype)
    last = last.reshape(batch, channels, A.shape[-1])
    if D is not None:
        scan_output = scan_output + hidden_states * D[None, :, None]
    if z is not None:
        scan_output = scan_output * F.silu(z)
    if return_last_state:
        return scan_output, last
    return scan_output
