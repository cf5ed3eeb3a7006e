"""Mamba2's SSD chunk scan on the runtime's scalar-decay linear-attention core.

A drop-in for transformers' PyTorch fallback `mamba2_chunk_scan` (one identical copy each in mamba2, bamba,
falcon_h1, granitemoehybrid, nemotron_h and zamba2): same arguments, shapes, dtypes and return convention.
The scan is linear attention with one decay per head and token,

    S_t = exp(A dt_t) S_{t-1} + B_t (x_t dt_t)^T;   y_t = S_t^T C_t + D x_t

so it runs `chunk_scalar_decay` with q = C, k = B (the G groups shared by H / G heads, never repeated),
v = x dt, g = A dt. transformers' fallback repeats B and C to every head and forms a (C x C) decay matrix
by cumulative sums of masked copies; the core computes the query-key scores once per group.

Packed sequences: `seq_idx` (B, T) int (mamba_ssm's convention, a sequence id per token) or `cu_seqlens`
(S + 1,) offsets with batch 1 reset the state where a new sequence starts; transformers' fallback ignores
both. The final state is then the last sequence's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.attention.delta_reference import compute_dtype
from runtime.attention.scalar_decay import chunk_scalar_decay
from runtime.sequence_split import active

# The core's chunk length, whatever the caller's (the result does not depend on it): the fastest on CPU
# for Mamba2's shapes (state 128, head dim 64) in bench/ssm.py.
CORE_CHUNK = 64


def sequence_starts(batch: int, length: int, seq_idx: torch.Tensor | None = None,
                    cu_seqlens: torch.Tensor | None = None, device=None) -> torch.Tensor | None:
    """(B, T) bool, True where a packed sequence starts after the first token; None without packing."""
    if seq_idx is not None:
        if seq_idx.shape != (batch, length):
            raise ValueError(f"seq_idx {tuple(seq_idx.shape)} must be (batch, seq_len) = {(batch, length)}")
        return F.pad(seq_idx[:, 1:] != seq_idx[:, :-1], (1, 0))
    if cu_seqlens is None:
        return None
    offsets = cu_seqlens.flatten().long()
    if batch != 1 or offsets[0] != 0 or offsets[-1] != length or (offsets.diff() < 0).any():
        raise ValueError(f"cu_seqlens must run from 0 to seq_len ({length}) with batch 1 (got batch {batch}, "
                         f"offsets {offsets.tolist()})")
    starts = torch.zeros(1, length, dtype=torch.bool, device=device)
    starts[0, offsets[1:-1][offsets[1:-1] < length]] = True
    return starts


def ssd_chunk_scan(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, chunk_size: int, D: torch.Tensor | None = None,
                   dt_bias: torch.Tensor | None = None, initial_states: torch.Tensor | None = None,
                   dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, float("inf")),
                   return_final_states: bool = False, **kwargs):
    """hidden_states (B, T, H, P), dt (B, T, H), A (H,), B and C (B, T, G, N), D (H,), dt_bias (H,),
    initial_states (B, H, P, N). Returns y (B, T, H, P), and with return_final_states (y, final state
    (B, H, P, N)); fp32 (fp64 stays fp64 where transformers would round it to fp32; D's dtype promotes y as
    in transformers). The core runs chunks of min(chunk_size, CORE_CHUNK) tokens (the result does not depend on it).
    kwargs: `seq_idx` / `cu_seqlens` for packed sequences; a non-None `z` raises (the fallback has no
    gating); anything else is ignored, as in transformers."""
    if kwargs.get("z") is not None:
        raise ValueError("ssd_chunk_scan has no z gating (transformers' fallback scan ignores z); gate outside")
    batch, length, heads, _ = hidden_states.shape
    if heads % B.shape[2]:
        raise ValueError(f"heads ({heads}) must be a multiple of B/C groups ({B.shape[2]})")
    reset = sequence_starts(batch, length, kwargs.get("seq_idx"), kwargs.get("cu_seqlens"), hidden_states.device)
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
    dtype = compute_dtype(hidden_states)
    x, dt = hidden_states.to(dtype), dt.to(dtype)
    state = None if initial_states is None else initial_states.to(dtype).transpose(-1, -2)
    if (split := active()) is not None:  # context parallelism: the state carried across the cp ranks' segments
        if state is not None or return_final_states:
            raise ValueError("context parallelism trains from a zero state and keeps no final state")
        y = split.scalar_decay(C.to(dtype), B.to(dtype), x * dt[..., None], A.to(dtype) * dt,
                               chunk_size=min(chunk_size, CORE_CHUNK))
        return y + D[..., None] * x if D is not None else y
    y, final = chunk_scalar_decay(C.to(dtype), B.to(dtype), x * dt[..., None], A.to(dtype) * dt,
                                  chunk_size=min(chunk_size, CORE_CHUNK), initial_state=state,
                                  output_final_state=return_final_states, reset=reset)
    if D is not None:
        y = y + D[..., None] * x
    if return_final_states:
        return y, final.transpose(-1, -2).contiguous()
    return y
