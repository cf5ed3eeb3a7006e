"""Triton cross-entropy rows for mixtral-8x7b: log-sum-exp, label logit and d loss / d logits of a chunk of LM-head
logits, in two passes over each row (one to read it, one to overwrite it with its gradient).

Rendered by onboard from templates/kernels/loss_triton.py.j2 for vocabulary 32000: regenerate rather than
edit. `register()` puts `cross_entropy_rows` in the runtime's kernel registry under the "triton" backend (CUDA,
or the CPU interpreter with TRITON_INTERPRET=1), where runtime.loss's token-chunked loss finds it; the head's
matmuls stay with torch.
"""

import torch
import triton
import triton.language as tl

from runtime.kernels import registry

VOCAB = 32000
BLOCK = 4096


@triton.jit
def _transform(z, scale, softcap, HAS_CAP: tl.constexpr):
    y = z * scale
    if HAS_CAP:
        # tanh(x) = 2 sigmoid(2x) - 1 (the interpreter and CUDA both have sigmoid)
        y = softcap * (2.0 * tl.sigmoid(2.0 * y / softcap) - 1.0)
    return y


@triton.jit
def _rows_kernel(z_ptr, stride, labels_ptr, lse_ptr, picked_ptr, V, scale, softcap, z_weight, inv_divisor,
                 HAS_CAP: tl.constexpr, WANT_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    # one program per row; fp32 throughout
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride
    label = tl.load(labels_ptr + row)
    peak = float("-inf")
    total = 0.0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        y = _transform(tl.load(base + cols, mask=mask, other=0.0), scale, softcap, HAS_CAP)
        y = tl.where(mask, y, float("-inf"))
        new_peak = tl.maximum(peak, tl.max(y, axis=0))
        total = total * tl.exp(peak - new_peak) + tl.sum(tl.exp(y - new_peak), axis=0)
        peak = new_peak
    lse = peak + tl.log(total)
    picked = _transform(tl.load(base + label), scale, softcap, HAS_CAP)
    tl.store(lse_ptr + row, lse)
    tl.store(picked_ptr + row, picked)
    if WANT_GRAD:
        # d/dy of inv_divisor * (lse - y[label] + z_weight * lse^2), then through the cap and the scale
        coef = inv_divisor * (1.0 + 2.0 * z_weight * lse)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < V
            y = _transform(tl.load(base + cols, mask=mask, other=0.0), scale, softcap, HAS_CAP)
            g = tl.exp(y - lse) * coef - tl.where(cols == label, inv_divisor, 0.0)
            if HAS_CAP:
                g = g * scale * (1.0 - (y / softcap) * (y / softcap))
            else:
                g = g * scale
            tl.store(base + cols, g, mask=mask)


def cross_entropy_rows(z: torch.Tensor, labels: torch.Tensor, transform, z_weight: float, inv_divisor: float,
                       want_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as runtime.loss.blocks.cross_entropy_rows_ (raw fp32 logits [rows, V], overwritten by
    their gradient with `want_grad`)."""
    if z.dtype != torch.float32 or z.stride(1) != 1:
        raise ValueError("cross_entropy_rows takes fp32 logits with contiguous rows")
    rows, vocab = z.shape
    lse = torch.empty(rows, dtype=torch.float32, device=z.device)
    picked = torch.empty_like(lse)
    if rows:
        has_cap = transform.softcap is not None
        _rows_kernel[(rows,)](z, z.stride(0), labels.contiguous(), lse, picked, vocab, float(transform.scale),
                              float(transform.softcap) if has_cap else 1.0, float(z_weight), float(inv_divisor),
                              HAS_CAP=has_cap, WANT_GRAD=bool(want_grad), BLOCK=BLOCK)
    return lse, picked


def register() -> None:
    registry.register("loss.cross_entropy_rows", "triton", cross_entropy_rows)
