"""Grouped GEMM: one matmul per expert over its contiguous slice of tokens, forward and backward.

`torch._grouped_mm` does this in one call where the build has it (CPU fp32 included in torch 2.13);
elsewhere a loop over experts gives the same numbers. The autograd function is ours because the
built-in backward refuses non-contiguous incoming gradients, which ordinary graphs produce.
"""

from __future__ import annotations

import torch

_HAS_GROUPED = hasattr(torch, "_grouped_mm")


def _offsets(counts: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(counts, 0).to(torch.int32)


def _mm_forward(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x: (N, in) sorted by expert; w: (E, in, out); counts: (E,) tokens per expert."""
    if _HAS_GROUPED and x.dtype in (torch.float32, torch.bfloat16):
        try:
            return torch._grouped_mm(x, w, offs=_offsets(counts))
        except RuntimeError:  # this device / dtype / layout is not supported: fall through
            pass
    out = x.new_empty(x.shape[0], w.shape[-1])
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            torch.mm(x[start:start + n], w[e], out=out[start:start + n])
        start += n
    return out


def _mm_weight_grad(x: torch.Tensor, dy: torch.Tensor, counts: torch.Tensor, num_experts: int) -> torch.Tensor:
    if _HAS_GROUPED and x.dtype in (torch.float32, torch.bfloat16):
        try:
            return torch._grouped_mm(x.t(), dy, offs=_offsets(counts))
        except RuntimeError:
            pass
    dw = x.new_zeros(num_experts, x.shape[1], dy.shape[1])
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            torch.mm(x[start:start + n].t(), dy[start:start + n], out=dw[e])
        start += n
    return dw


class GroupedMM(torch.autograd.Function):
    """y = x @ w[e] per expert slice, with w stored (E, in, out); or x @ w[e]^T with w stored (E, out, in)
    (`out_in`), the layout of nn.Linear and most checkpoints. The weight gradient is produced directly in
    the stored layout, so no transposed copy is made when it is accumulated."""

    @staticmethod
    def forward(ctx, x, w, counts, out_in: bool):
        ctx.save_for_backward(x, w, counts)
        ctx.out_in = out_in
        return _mm_forward(x, w.transpose(-2, -1) if out_in else w, counts)

    @staticmethod
    def backward(ctx, dy):
        x, w, counts = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _mm_forward(dy, w if ctx.out_in else w.transpose(-2, -1), counts)
        if ctx.needs_input_grad[1]:
            dw = (_mm_weight_grad(dy, x, counts, w.shape[0]) if ctx.out_in
                  else _mm_weight_grad(x, dy, counts, w.shape[0]))
        return dx, dw, None, None


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, *, out_in: bool = False) -> torch.Tensor:
    """(N, in) tokens sorted by expert times per-expert weights: (E, in, out), or (E, out, in) with `out_in`."""
    return GroupedMM.apply(x, w, counts, out_in)
