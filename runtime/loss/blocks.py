"""One block of the LM head: its logits (fp32) and the gradients a block of d loss / d logits gives.

Shared by the token-chunked and the vocabulary-chunked losses; a block is [tokens, vocabulary slice].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.loss.logits import LogitTransform


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                transform: LogitTransform) -> torch.Tensor:
    """Transformed fp32 logits of `hidden` rows against `weight` rows (a slice of the vocabulary)."""
    z = F.linear(hidden, weight, bias)
    z = z.float() if z.dtype != torch.float32 else z
    return transform.apply_(z)


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b with out in fp32; low-precision operands are multiplied in their dtype."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        out.addmm_(a, b)
    else:
        out.add_(a.to(b.dtype) @ b)


def backprop_block(grad_z: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                   grad_hidden: torch.Tensor | None, grad_weight: torch.Tensor | None,
                   grad_bias: torch.Tensor | None) -> None:
    """Add what one block of d loss / d z (fp32, [tokens, vocab slice]) gives to the fp32 accumulators of
    the hidden rows, the weight rows and the bias slice (None: not wanted)."""
    if grad_hidden is not None:
        _mm_into(grad_hidden, grad_z, weight)
    if grad_weight is not None:
        _mm_into(grad_weight, grad_z.t(), hidden)
    if grad_bias is not None:
        grad_bias.add_(grad_z.sum(0))
