"""Depthwise short causal convolution with an activation: the `causal_conv1d_fn` of transformers' linear
attention and Mamba blocks (and of the causal-conv1d package), for whole sequences.

    out[b, c, t] = act(bias[c] + sum_w weight[c, w] * x[b, c, t - (W - 1) + w])   (x = 0 before the start)

Written as W shifted multiply-adds rather than a grouped F.conv1d, whose depthwise CPU path is slow for
thousands of channels. Packed sequences (`seq_idx` (B, T), or `cu_seqlens` / transformers'
`cu_seq_lens_q` with B == 1) never see taps from the previous sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ACTIVATIONS = {None: lambda x: x, "identity": lambda x: x, "silu": F.silu, "swish": F.silu, "gelu": F.gelu,
                "relu": F.relu}


def _positions(seq_idx, cu_seqlens, batch: int, length: int, device) -> torch.Tensor | None:
    """Each token's position inside its own sequence (B, T), or None when there is one sequence per row."""
    if seq_idx is None and cu_seqlens is None:
        return None
    t = torch.arange(length, device=device)
    if seq_idx is None:
        if batch != 1:
            raise ValueError(f"cu_seqlens needs the packed sequences in one batch row, got batch {batch}")
        seq_idx = (torch.searchsorted(cu_seqlens.to(device), t, right=True) - 1).unsqueeze(0)
    starts = torch.cat((torch.ones_like(seq_idx[:, :1], dtype=torch.bool), seq_idx[:, 1:] != seq_idx[:, :-1]), 1)
    first = torch.cummax(torch.where(starts, t, 0), dim=1).values
    return t - first


def causal_conv1d(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  activation: str | None = None, seq_idx: torch.Tensor | None = None,
                  cu_seqlens: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """hidden_states (B, C, T), weight (C, W) (or nn.Conv1d's (C, 1, W)), bias (C,). Returns (B, C, T) in the
    input dtype, computed in the weight dtype like transformers' fallback."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {activation!r} for causal_conv1d; expected one of "
                         f"{sorted(a for a in _ACTIVATIONS if a)}")
    if weight.dim() == 3:
        weight = weight.squeeze(1)
    batch, channels, length = hidden_states.shape
    if weight.shape[0] != channels:
        raise ValueError(f"conv weight has {weight.shape[0]} channels, the input {channels}")
    cu_seqlens = cu_seqlens if cu_seqlens is not None else kwargs.get("cu_seq_lens_q")
    pos = _positions(seq_idx, cu_seqlens, batch, length, hidden_states.device)
    x = hidden_states.to(weight.dtype)
    width = weight.shape[-1]
    padded = F.pad(x, (width - 1, 0))
    out = x * weight[:, -1:]
    for w in range(width - 1):
        shift = width - 1 - w
        tap = padded[..., w:w + length] * weight[:, w:w + 1]
        if pos is not None:
            tap = tap * (pos >= shift).unsqueeze(1).to(tap.dtype)
        out = out + tap
    if bias is not None:
        out = out + bias.unsqueeze(-1)
    return _ACTIVATIONS[activation](out).to(hidden_states.dtype)
