"""Chunked linear attention whose decay is one constant per head (MiniMax's lightning attention).

    o, final = chunk_constant_decay(q, k, v, log_decay, chunk_size=64, initial_state=None)

The recurrence is `scalar_decay`'s with g_t = lam (< 0) for every token of head h:

    S_t = exp(lam) S_{t-1} + k_t v_t^T;   o_t = S_t^T q_t

Because the decay does not depend on the token, every chunk of C tokens sees the same decays, and they are made
once per call, not once per chunk:

    D[i, j] = exp(lam (i - j))   for j <= i, else 0        (H, C, C): the intra-chunk pair decay
    q_i     = exp(lam (i + 1))                              what the incoming state keeps at token i
    k_j     = exp(lam (C - 1 - j))                          what a key written at j keeps at the chunk's end
    carry   = exp(lam C)

    o_chunk = ((Q K^T) * D) V + (Q * q) S_start;    S_end = carry S_start + (K * k)^T V

Each exponent is one product lam * (distance), never a difference of running sums, so it is exact to fp32's
rounding whatever the decay; decays below e^LOG_DECAY_ZERO are exact zeros (no subnormal product, see
`decay_pairs`). The general core (`chunk_scalar_decay`) builds the decay matrix per chunk and token from a
per-token g and writes g's gradient; here there is neither, which is what makes this core the faster one. A
decay that needs a gradient (a trained slope) takes the general core, as does a registered backend kernel of
the scalar-decay op (it is rendered for lightning too), so both routes give the same numbers.

A tail shorter than C is its own chunk with the same decays cut to its length (D[:r, :r], q[:r], k[C - r:],
exp(lam r)): padding it instead would decay the final state by the padded tokens.
"""

from __future__ import annotations

import torch

from runtime.attention.decay_pairs import LOG_DECAY_ZERO
from runtime.attention.delta_reference import compute_dtype
from runtime.attention.scalar_decay import OP, carry_gradients, carry_states, chunk_core, chunk_scalar_decay
from runtime.kernels import registry
from runtime.subnormals import exp_or_zero


def _decays(log_decay: torch.Tensor, chunk: int):
    """(D (H, C, C), q decay (H, C, 1), k decay (H, C, 1), carry (H,)) for log decays (H,) and chunk length C."""
    pos = torch.arange(chunk, device=log_decay.device, dtype=log_decay.dtype)
    lam = log_decay[:, None, None]
    distance = (pos[:, None] - pos[None, :]).masked_fill(pos[:, None] < pos[None, :], float("inf"))
    pair = exp_or_zero(lam * distance, LOG_DECAY_ZERO)  # lam * inf = -inf above the diagonal: exactly 0
    q_decay = exp_or_zero(lam * (pos + 1)[:, None], LOG_DECAY_ZERO)
    k_decay = exp_or_zero(lam * (chunk - 1 - pos)[:, None], LOG_DECAY_ZERO)
    return pair, q_decay, k_decay, exp_or_zero(log_decay * chunk, LOG_DECAY_ZERO)


def _packed_in_token_order(*parts: torch.Tensor) -> torch.Tensor:
    """parts (B, H, N, C, D) packed along the last dimension into a (B, H, N, C, 3D) view of a (B, N, C, H, 3D)
    tensor: the caller's qkv was (B, T, H, 3D) viewed as chunks and permuted, so a gradient in that order goes
    back through the permute and the reshape as views (a concatenation in chunk order would be copied once more
    to get there)."""
    batch, heads, n, c, dim = parts[0].shape
    packed = parts[0].new_empty(batch, n, c, heads, len(parts) * dim).permute(0, 3, 1, 2, 4)
    for i, part in enumerate(parts):
        packed[..., i * dim:(i + 1) * dim].copy_(part)
    return packed


class _Chunks(torch.autograd.Function):
    """N whole chunks of one call: qkv (B, H, N, C, 3D), the state entering the first chunk (B, H, K, V) and the
    decays of `_decays` -> (o (B, H, N, C, V), the final state). One node with its own backward: it keeps qkv,
    the decayed scores A = (Q K^T) * D and the state entering each chunk, scales products in place, and returns
    the gradients of q, k and v as one packed tensor laid out in the caller's token order (autograd through the
    same ops would store more, copy each operand it transposes, and zero-fill and concatenate the three
    gradients); the decays, being constants, get no gradient."""

    @staticmethod
    def forward(ctx, qkv, state, pair, q_decay, k_decay, carry):
        qkv = qkv.contiguous()
        q, k, v = qkv.chunk(3, -1)  # row stride 3D: views matmul takes as they are
        scores = (q @ k.transpose(-1, -2)).mul_(pair[:, None])
        written = (k * k_decay[:, None]).transpose(-1, -2) @ v  # (B, H, N, K, V)
        carry = carry.view(1, -1, 1, 1, 1).expand(1, -1, written.shape[2], 1, 1)  # the same for every chunk
        starts, final = carry_states(written, state, carry)
        # q_decay scales rows, so it can scale the product instead of a copy of q
        o = (q @ starts).mul_(q_decay[:, None])
        o.flatten(0, 2).baddbmm_(scores.flatten(0, 2), v.flatten(0, 2))
        ctx.save_for_backward(qkv, scores, starts, pair, q_decay, k_decay, carry)
        return o, final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_o, d_final):
        qkv, scores, starts, pair, q_decay, k_decay, carry = ctx.saved_tensors
        q, k, v = qkv.chunk(3, -1)
        d_o = d_o.contiguous()
        d_starts = (q * q_decay[:, None]).transpose(-1, -2) @ d_o
        d_written, d_state = carry_gradients(d_starts, d_final, carry)
        # inside the chunks: each gradient is its inter-chunk term, scaled in place, plus the intra-chunk product
        # added in place (bmm into a strided slice of one packed tensor takes a slow path: packed at the end)
        d_scores = (d_o @ v.transpose(-1, -2)).mul_(pair[:, None])
        d_q = (d_o @ starts.transpose(-1, -2)).mul_(q_decay[:, None])
        d_q.flatten(0, 2).baddbmm_(d_scores.flatten(0, 2), k.flatten(0, 2))
        d_k = (v @ d_written.transpose(-1, -2)).mul_(k_decay[:, None])
        d_k.flatten(0, 2).baddbmm_(d_scores.transpose(-1, -2).flatten(0, 2), q.flatten(0, 2))
        d_v = (k * k_decay[:, None]) @ d_written
        d_v.flatten(0, 2).baddbmm_(scores.transpose(-1, -2).flatten(0, 2), d_o.flatten(0, 2))
        return _packed_in_token_order(d_q, d_k, d_v), d_state, None, None, None, None


def chunk_constant_decay(qkv: torch.Tensor, log_decay: torch.Tensor, *, chunk_size: int = 64,
                         initial_state: torch.Tensor | None = None,
                         output_final_state: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """qkv (B, T, H, 3D): q, k and v packed per head along the last dimension, as a lightning block's one
    projection writes them (`torch.cat((q, k, v), -1)` packs separate ones); log_decay (H,) (< 0, the same
    for every token); initial_state (B, H, D, D) or None. Computes in fp32 at least. Returns (o (B, T, H, D)
    in the compute dtype, final state (B, H, D, D) or None), equal to `chunk_scalar_decay` with
    g = log_decay for every token."""
    batch, length, heads, packed = qkv.shape
    if packed % 3 or log_decay.shape != (heads,):
        raise ValueError(f"qkv {tuple(qkv.shape)} must be (B, T, H, 3D) with log_decay {tuple(log_decay.shape)} "
                         f"one value per head")
    if log_decay.requires_grad or registry.lookup(OP, chunk_core) is not chunk_core:
        g = log_decay.view(1, 1, heads).expand(batch, length, heads)
        return chunk_scalar_decay(*qkv.chunk(3, -1), g, chunk_size=chunk_size, initial_state=initial_state,
                                  output_final_state=output_final_state)
    dtype = compute_dtype(qkv)
    qkv, log_decay = qkv.to(dtype), log_decay.to(dtype)
    dim = packed // 3
    state = qkv.new_zeros(batch, heads, dim, dim) if initial_state is None else initial_state.to(dtype)
    whole = length - length % chunk_size
    outs = []
    for start, stop in ((0, whole), (whole, length)):  # the whole chunks, then the tail as one shorter chunk
        if stop == start:
            continue
        c = min(chunk_size, stop - start)
        part = qkv if stop - start == length else qkv[:, start:stop]  # a slice would cost its gradient a copy
        o, state = _Chunks.apply(part.unflatten(1, (-1, c)).permute(0, 3, 1, 2, 4), state, *_decays(log_decay, c))
        outs.append(o.permute(0, 2, 3, 1, 4).flatten(1, 2))
    return torch.cat(outs, 1) if len(outs) > 1 else outs[0], state if output_final_state else None
