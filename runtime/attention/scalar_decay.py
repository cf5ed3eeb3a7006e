"""Chunked linear attention with one scalar decay per head and token (no delta rule).

For each head, with state S (K x V) and log decay g_t <= 0:

    S_t = exp(g_t) S_{t-1} + k_t v_t^T;   o_t = S_t^T q_t     (no scaling of q)

This is Mamba2's SSD (q = C, k = B, v = x dt, g = A dt) and MiniMax's lightning attention (g = -slope, a
constant per head). Cut into chunks of C tokens, with G the cumulative log decay from the chunk start:

    o_i = sum_{j <= i in chunk} (q_i . k_j) exp(G_i - G_j) v_j  +  exp(G_i) q_i^T S_start
    S_end = exp(G_C) S_start + sum_j k_j (exp(G_C - G_j) v_j)^T

Every exponent is a difference G_i - G_j with j <= i, so <= 0: positions above the diagonal are masked before
exp, never exp(G_i) * exp(-G_j), which overflows once a chunk decays by ~88 in log space. Everything except
the state hand-off is batched over all chunks; the hand-off is a loop over chunks (one multiply-add each).
Two pieces have their own backward, to keep what autograd would store twice once: the intra-chunk product
(it keeps the (C x C) decay matrix per head and the per-key-head scores) and the hand-off (one state per
chunk). Memory is O(T x C) per head, never a (T x T) matrix.

Grouped heads (H value heads sharing Hk query/key heads, head h uses key head h // (H / Hk)) never repeat q or
k: the (C x C) query-key scores are computed once per key head, and the heads of a group are folded into the
value dimension of the state matmuls.

`reset` (B, T) bool marks tokens that start a new sequence (packed sequences): the state before them is
dropped: inside a chunk, pairs of tokens from different sequences are masked with the causal mask (exact
zeros); across chunks, the incoming state reaches only tokens before the chunk's first reset, and only tokens
after its last reset write the outgoing state.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from runtime.attention.decay_pairs import (LOG_DECAY_ZERO, LOG_GRADIENT_ZERO, decay_exp, previous_rows,
                                          straddling_rescaled)
from runtime.attention.delta_reference import compute_dtype
from runtime.kernels import registry
from runtime.subnormals import exp_or_zero, exp_or_zero_

OP = "linear_attention.chunk_scalar_decay"


def _check(q, k, v, g):
    batch, length, key_heads, _ = k.shape
    if q.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the same shape")
    heads = v.shape[2]
    if v.shape[:2] != (batch, length) or heads % key_heads:
        raise ValueError(f"v {tuple(v.shape)} must be (B, T, H, V) with H a multiple of k's {key_heads} heads")
    if g.shape != v.shape[:3]:
        raise ValueError(f"g {tuple(g.shape)} must be (B, T, H) = {tuple(v.shape[:3])}")
    return heads // key_heads


def _pair_decay(g: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """exp(G_i - G_j) where `allowed` (j <= i, same sequence) and the exponent is at least LOG_DECAY_ZERO,
    else exactly 0: per-token log decays g (..., C) -> (..., C, C). The exponent is summed over the tokens
    j < t <= i alone, never formed as the difference of two running sums (whose rounding error grows with the
    whole chunk's decay, and exp turns it into a relative error); masked before exp, so no exponent is ever
    positive and no result subnormal. Autograd does not see it (`_IntraChunk` writes the gradient)."""
    c = g.shape[-1]
    after = torch.ones(c, c, dtype=torch.bool, device=g.device).tril(-1)  # [t, j]: t > j
    span = g.unsqueeze(-1).expand(*g.shape, c).masked_fill(~after, 0.0).cumsum(-2)  # [i, j]: sum_{j < t <= i} g_t
    return exp_or_zero_(span.masked_fill_(~allowed, -math.inf), LOG_DECAY_ZERO)


class _IntraChunk(torch.autograd.Function):
    """o = (scores * D) @ v inside each chunk, D = `_pair_decay(G, allowed)` with G = cumsum(g) along the chunk:
    scores (B, Hk, 1, N, C, C) shared by the `group` heads of a key head, g (B, Hk, group, N, C) per-token log
    decays, v (B, Hk, group, N, C, V). Keeps D only (not D and the product, as autograd would) and writes the
    gradient of g directly: with W = dM * scores on the pairs that may interact, dg_t = exp(g_t) R_t, R_t the sum
    over the pairs j < t <= i that straddle t of W_ij exp(G_i - G_t) exp(G_{t-1} - G_j)
    (`decay_pairs.straddling_rescaled`). Formed from the decayed terms W_ij D_ij instead, every term of a token
    decayed by more than e^-24 would be an exact zero, and with them its whole gradient (Mamba2's A_log and dt
    would learn nothing from such tokens)."""

    @staticmethod
    def forward(ctx, scores, g, v, allowed):
        decay = _pair_decay(g, allowed)
        ctx.save_for_backward(scores, decay, v, g, allowed)
        return (scores * decay) @ v

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_o):
        scores, decay, v, g, allowed = ctx.saved_tensors
        d_o = d_o.contiguous()  # an expanded gradient (loss = o.sum()) sends bmm down a very slow path
        masked = scores * decay
        d_v = masked.transpose(-1, -2) @ d_o
        d_masked = d_o @ v.transpose(-1, -2)
        d_scores = (d_masked * decay).sum(2, keepdim=True)
        if not ctx.needs_input_grad[1]:  # a constant decay (lightning attention's slopes)
            return d_scores, None, d_v, None
        weights = d_masked.mul_(scores).masked_fill_(~allowed, 0.0)
        return d_scores, exp_or_zero(g, LOG_GRADIENT_ZERO) * straddling_rescaled(weights, decay), d_v, None


class _ChunkDecays(torch.autograd.Function):
    """From per-token log decays g (B, Hk, group, N, C): exp(G_C - G_j) (what a key written at j keeps by the
    chunk's end), exp(G_i) (what the incoming state keeps at i) and exp(G_C) (at the end), G = cumsum(g). Each
    term of dL/dg_t holds exp(g_t): the backward takes it out and sums the rest, whose factors are decays of other
    tokens (at most one), over exactly the tokens the term depends on (as `_IntraChunk` does):

        dg_t = exp(g_t) [ exp(G_C - G_t) sum_{j < t} d_end_j E[t-1, j]
                          + E_{t-1} sum_{i >= t} d_start_i E[i, t] + E_{t-1} exp(G_C - G_t) d_carry ]

    with E[i, j] = exp(G_i - G_j) and E_{t-1} = exp(G_{t-1}) (1 at the chunk's first token)."""

    @staticmethod
    def forward(ctx, g):
        G = g.cumsum(-1)
        to_end = F.pad(g.flip(-1).cumsum(-1).flip(-1)[..., 1:], (0, 1))  # sum_{t > j} g_t, summed as such
        into_end, from_start, carry = decay_exp(to_end), decay_exp(G), decay_exp(G[..., -1])
        ctx.save_for_backward(g, into_end, from_start)
        return into_end, from_start, carry

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_into_end, d_from_start, d_carry):
        g, into_end, from_start = ctx.saved_tensors
        c = g.shape[-1]
        decay = _pair_decay(g, torch.ones(c, c, dtype=torch.bool, device=g.device).tril())
        previous = F.pad(from_start[..., :-1], (1, 0), value=1.0)  # E_{t-1}
        rest = torch.zeros_like(g)
        if d_into_end is not None:
            rest += into_end * (previous_rows(decay) @ d_into_end.unsqueeze(-1)).squeeze(-1)
        if d_from_start is not None:
            rest += previous * (decay.transpose(-1, -2) @ d_from_start.unsqueeze(-1)).squeeze(-1)
        if d_carry is not None:
            rest += previous * into_end * d_carry.unsqueeze(-1)
        return exp_or_zero(g, LOG_GRADIENT_ZERO) * rest


def _segments(reset: torch.Tensor, chunk: int) -> torch.Tensor:
    """Per token, how many sequence starts lie at or before it inside its chunk: (B, N, C) int."""
    batch, length = reset.shape
    return reset.view(batch, length // chunk, chunk).long().cumsum(-1)


_CARRY_BLOCK = 8  # chunks per step of the decay-gradient reduction in _HandOff.backward


def carry_states(written: torch.Tensor, s0: torch.Tensor, carry: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """S_{c+1} = carry[:, :, c] S_c + written[:, :, c] over the chunks (dim 2) from S_0 = s0: (the state entering
    each chunk, written like `written`, and the final state). carry[:, :, c] broadcasts against one state.
    Each state is written where it is kept: no copies."""
    starts = torch.empty_like(written)
    starts[:, :, 0] = s0
    for c in range(written.shape[2] - 1):
        torch.addcmul(written[:, :, c], starts[:, :, c], carry[:, :, c], out=starts[:, :, c + 1])
    return starts, torch.addcmul(written[:, :, -1], starts[:, :, -1], carry[:, :, -1])


def carry_gradients(d_starts: torch.Tensor, d_final: torch.Tensor | None, carry: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward of `carry_states` for the states and what was written: (d_written, d_s0), d_written[c] being
    the gradient of the state after chunk c, S_{c+1}."""
    d_written = torch.empty_like(d_starts)
    d_written[:, :, -1] = 0 if d_final is None else d_final
    for c in range(d_starts.shape[2] - 1, 0, -1):
        torch.addcmul(d_starts[:, :, c], d_written[:, :, c], carry[:, :, c], out=d_written[:, :, c - 1])
    return d_written, torch.addcmul(d_starts[:, :, 0], d_written[:, :, 0], carry[:, :, 0])


class _HandOff(torch.autograd.Function):
    """The state recurrence across chunks, S_{c+1} = carry_c S_c + written_c, as one autograd node: a loop over
    chunks each way, written into one (.., N, ..) tensor (autograd through the loop would keep every state
    twice, in a list and stacked, and add a node per chunk; `carry_states`, `carry_gradients`). carry
    (B, Hk, N, 1, G, 1), written
    (B, Hk, N, K, G, V), s0 (B, Hk, K, G, V). Returns (the state entering each chunk, the final state)."""

    @staticmethod
    def forward(ctx, carry, written, s0):
        starts, final = carry_states(written, s0, carry)
        ctx.save_for_backward(carry, starts)
        return starts, final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_starts, d_final):
        carry, starts = ctx.saved_tensors
        n = starts.shape[2]
        d_written, d_s0 = carry_gradients(torch.zeros_like(starts) if d_starts is None else d_starts, d_final, carry)
        if not ctx.needs_input_grad[0]:  # a decay that needs no gradient: nothing to reduce
            return None, d_written, d_s0
        d_carry = torch.empty_like(carry)
        for c in range(0, n, _CARRY_BLOCK):  # a few chunks at a time: few ops, a bounded temporary
            blk = slice(c, c + _CARRY_BLOCK)
            torch.sum(d_written[:, :, blk] * starts[:, :, blk], (-3, -1), keepdim=True, out=d_carry[:, :, blk])
        return d_carry, d_written, d_s0


def chunk_scalar_decay(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *, chunk_size: int = 64,
                       initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                       reset: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k (B, T, Hk, K); v (B, T, H, V), H a multiple of Hk; g (B, T, H) log decay (<= 0); initial_state
    (B, H, K, V) or None (zeros); reset (B, T) bool or None (True: drop the state before this token).
    Computes in fp32 at least (fp64 stays fp64). Returns (o (B, T, H, V) in the compute dtype, final state
    (B, H, K, V) or None). The result does not depend on chunk_size.

    Runs the backend's implementation of OP where one is registered (a rendered Triton kernel: it falls back
    here for shapes it was not rendered for); packed sequences (`reset`) always take the PyTorch path."""
    _check(q, k, v, g)
    if reset is None:
        o, final = registry.lookup(OP, chunk_core)(q, k, v, g, initial_state, chunk_size)
    else:
        o, final = chunk_core(q, k, v, g, initial_state, chunk_size, reset)
    return o, final if output_final_state else None


def chunk_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, initial_state: torch.Tensor | None,
                chunk: int, reset: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The op that backend dispatch replaces (OP): `chunk_scalar_decay`'s inputs as given (shapes checked), the
    chunk length; returns (o, final state) in the compute dtype, the final state always."""
    group = v.shape[2] // k.shape[2]
    dtype = compute_dtype(v)
    q, k, v, g = (x.to(dtype) for x in (q, k, v, g))
    batch, length, key_heads, kd = k.shape
    heads, vd = v.shape[2:]
    pad = -length % chunk
    if pad:  # zero keys and values with zero log decay leave the state as it is
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g = F.pad(g, (0, 0, 0, pad))
        if reset is not None:
            reset = F.pad(reset, (0, pad))
    n = (length + pad) // chunk
    # layouts: q, k (B, Hk, N, C, K); v (B, Hk, N, C, G, V); G (B, Hk, G, N, C)
    qc, kc = (x.view(batch, n, chunk, key_heads, kd).permute(0, 3, 1, 2, 4) for x in (q, k))
    vc = v.view(batch, n, chunk, key_heads, group, vd).permute(0, 3, 1, 2, 4, 5)
    gc = g.view(batch, n, chunk, key_heads, group).permute(0, 3, 4, 1, 2)  # (B, Hk, G, N, C)

    # intra-chunk: scores once per key head, decay per head
    allowed = torch.ones(chunk, chunk, dtype=torch.bool, device=gc.device).tril()
    # exp(G_C - G_j), exp(G_i) (B, Hk, G, N, C); exp(G_C) (B, Hk, G, N)
    into_end, from_start, carry = _ChunkDecays.apply(gc)
    if reset is not None:
        seg = _segments(reset, chunk)[:, None, None]  # (B, 1, 1, N, C)
        allowed = allowed & (seg[..., :, None] == seg[..., None, :])
        into_end = into_end * (seg == seg[..., -1:])
        from_start = from_start * (seg == 0)
        carry = carry * (seg[..., -1] == 0)
    scores = qc @ kc.transpose(-1, -2)  # (B, Hk, N, C, C)
    o = _IntraChunk.apply(scores.unsqueeze(2), gc, vc.permute(0, 1, 4, 2, 3, 5), allowed)  # (B, Hk, G, N, C, V)
    o = o.permute(0, 1, 3, 4, 2, 5)  # (B, Hk, N, C, G, V)

    # each chunk's own contribution to the state at its end, heads of a group folded into V
    vw = vc * into_end.permute(0, 1, 3, 4, 2).unsqueeze(-1)
    written = (kc.transpose(-1, -2) @ vw.reshape(batch, key_heads, n, chunk, group * vd))
    written = written.view(batch, key_heads, n, kd, group, vd)
    carry = carry.permute(0, 1, 3, 2)[:, :, :, None, :, None]  # (B, Hk, N, 1, G, 1)

    if initial_state is None:
        state = vc.new_zeros(batch, key_heads, kd, group, vd)
    else:
        state = initial_state.to(dtype).view(batch, key_heads, group, kd, vd).transpose(2, 3)
    start, state = _HandOff.apply(carry, written, state)
    start = start.view(batch, key_heads, n, kd, group * vd)
    o_start = (qc @ start).view(batch, key_heads, n, chunk, group, vd)
    o = o + o_start * from_start.permute(0, 1, 3, 4, 2).unsqueeze(-1)

    o = o.permute(0, 2, 3, 1, 4, 5).reshape(batch, n * chunk, heads, vd)[:, :length]
    return o, state.transpose(2, 3).reshape(batch, heads, kd, vd)


def recurrent_scalar_decay(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *,
                           initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                           reset: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same recurrence token by token (the definition the chunked form is tested against; slow on
    purpose). Same arguments and results as `chunk_scalar_decay`."""
    group = _check(q, k, v, g)
    dtype = compute_dtype(v)
    q, k = (x.to(dtype).repeat_interleave(group, dim=2) for x in (q, k))
    v, g = v.to(dtype), g.to(dtype)
    batch, length, heads, vd = v.shape
    state = (v.new_zeros(batch, heads, k.shape[-1], vd) if initial_state is None else initial_state.to(dtype))
    outs = []
    for t in range(length):
        keep = g[:, t].exp()
        if reset is not None:
            keep = keep * ~reset[:, t, None]
        state = keep[..., None, None] * state + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(outs, 1), state if output_final_state else None
