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

from runtime.attention.decay_pairs import LOG_DECAY_ZERO, decay_zero
from runtime.subnormals import exp_or_zero_

CHUNK = 16


def _grouped(t: torch.Tensor, groups: int) -> torch.Tensor:
    """(batch, D, T) -> (batch, G, D / G, T)."""
    return t.reshape(t.shape[0], groups, t.shape[1] // groups, t.shape[2])


def _scan(a, u, a2, u2, reverse: bool = False):
    """Along dim -2: u_t <- u_t + a_t u_{t-1} (u_t + a_t u_{t+1} if reverse) from zero, in log2(L) doubling
    steps, each combining every position with the one `step` earlier (later). Two fused ops a step (one in the
    last: the full decay products are never needed, an incoming state is folded into the first token instead),
    ping-ponging between the buffer pairs (a, u) and (a2, u2), all overwritten. Returns (u, free, free, free)."""
    length = a.shape[-2]
    step = 1
    while step < length:
        if reverse:
            new, old, keep = slice(None, -step), slice(step, None), slice(length - step, None)
        else:
            new, old, keep = slice(step, None), slice(None, -step), slice(None, step)
        torch.addcmul(u[..., new, :], a[..., new, :], u[..., old, :], out=u2[..., new, :])
        u2[..., keep, :] = u[..., keep, :]
        if step * 2 < length:
            # products of decays: those below the smallest kept decay are dropped, or products of them end subnormal
            product = torch.mul(a[..., new, :], a[..., old, :], out=a2[..., new, :])
            product.masked_fill_(product < decay_zero(product.dtype), 0.0)
            a2[..., keep, :] = a[..., keep, :]
        a, a2, u, u2 = a2, a, u2, u
        step *= 2
    return u, a, a2, u2


def _workspace(like, shape, count):
    """Chunk-sized (b, G, Dg, L, N) buffers allocated once per call and reused by every chunk: on CPU a fresh
    multi-megabyte tensor per op costs page faults comparable to the op itself."""
    buffers = [like.new_empty(shape) for _ in range(count)]
    return lambda length: [b[..., :length, :] for b in buffers]


def _chunk_states(x, dt, A, B, h0, decay, p, u, p2, u2):
    """States of one chunk: x, dt (b, G, Dg, L); A (G, Dg, N); B (b, G, L, N); h0 (b, G, Dg, N). Writes the
    single-step decays into `decay` (which may be `p`) and returns (h, free, free, free), h (b, G, Dg, L, N)
    the states, all in the given buffers."""
    exp_or_zero_(torch.mul(A[:, :, None, :], dt[..., None], out=decay), LOG_DECAY_ZERO)
    if p is not decay:
        p.copy_(decay)
    torch.mul((dt * x)[..., None], B[:, :, None], out=u)
    u[..., 0, :].addcmul_(decay[..., 0, :], h0)  # h_0 = a_0 h0 + u_0: the scan from zero then carries h0
    return _scan(p, u, p2, u2)


class SelectiveScan(torch.autograd.Function):
    """Core scan, compute dtype throughout. x, dt (b, G, Dg, T); A (G, Dg, N); B, C (b, G, T, N) contiguous.
    Returns y (b, G, Dg, T) and the last state (b, G, Dg, N)."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, chunk: int):
        batch, groups, dg, length = x.shape
        n = A.shape[-1]
        chunk = max(1, min(chunk, length))
        take = _workspace(x, (batch, groups, dg, chunk, n), 4)
        h = x.new_zeros(batch, groups, dg, n)
        y = x.new_empty(batch, groups, dg, length)
        starts = []
        for t0 in range(0, length, chunk):
            t1 = min(t0 + chunk, length)
            starts.append(h)
            p, u, p2, u2 = take(t1 - t0)
            hs = _chunk_states(x[..., t0:t1], dt[..., t0:t1], A, B[:, :, t0:t1], h, p, p, u, p2, u2)[0]
            y[..., t0:t1] = torch.linalg.vecdot(hs, C[:, :, None, t0:t1])
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
        take = _workspace(x, (*x.shape[:3], chunk, A.shape[-1]), 6)
        for index in reversed(range(len(starts)) if length else []):
            t0 = index * chunk
            t1 = min(t0 + chunk, length)
            xs, dts, Bs, Cs, h0, dys = (x[..., t0:t1], dt[..., t0:t1], B[:, :, t0:t1], C[:, :, t0:t1],
                                        starts[index], dy[..., t0:t1])
            a, p, u, p2, u2, g = take(t1 - t0)
            hs, decay, free_p, free_u = _chunk_states(xs, dts, A, Bs, h0, a, p, u, p2, u2)
            dC[:, :, t0:t1] = torch.mul(hs, dys[..., None], out=free_u).sum(2)
            # reverse scan g_t = C_t dy_t + a_{t+1} g_{t+1}, decay[t] = a[t + 1]; the carry enters at the last token
            decay[..., :-1, :] = a[..., 1:, :]
            decay[..., -1, :] = 1  # multiplies only terms past the chunk's end
            torch.mul(dys[..., None], Cs[:, :, None], out=g)
            g[..., -1, :] += carry
            g, free_p, free_u, _ = _scan(decay, g, free_p, free_u, reverse=True)
            carry = a[..., 0, :] * g[..., 0, :]
            gb = torch.linalg.vecdot(g, Bs[:, :, None])  # sum_n g_t B_t[n]
            dx[..., t0:t1] = gb * dts
            dB[:, :, t0:t1] = torch.mul(g, (dts * xs)[..., None], out=free_p).sum(2)
            w = torch.mul(g, a, out=free_u)  # dL/da_t a_t = g_t h_{t-1} a_t
            w[..., 1:, :] *= hs[..., :-1, :]
            w[..., 0, :] *= h0
            ddt[..., t0:t1] = gb * xs + torch.linalg.vecdot(w, A[:, :, None])
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
        B.to(compute).transpose(-1, -2).contiguous(), C.to(compute).transpose(-1, -2).contiguous(), chunk_size)
    scan_output = y.reshape(batch, channels, length).to(input_dtype)
    last = last.reshape(batch, channels, A.shape[-1])
    if D is not None:
        scan_output = scan_output + hidden_states * D[None, :, None]
    if z is not None:
        scan_output = scan_output * F.silu(z)
    if return_last_state:
        return scan_output, last
    return scan_output
