"""One block of the LM head: its logits (fp32) and the gradients a block of d loss / d logits gives.

Shared by the token-chunked and the vocabulary-chunked losses; a block is [tokens, vocabulary slice].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.loss.logits import LogitTransform
from runtime.subnormals import LOG_PROB_ZERO, exp_or_zero_


def raw_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 head output of `hidden` rows against `weight` rows (a slice of the vocabulary), a fresh tensor."""
    z = F.linear(hidden, weight, bias)
    return z.float() if z.dtype != torch.float32 else z


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                transform: LogitTransform) -> torch.Tensor:
    """Transformed fp32 logits of `hidden` rows against `weight` rows."""
    return transform.apply_(raw_logits(hidden, weight, bias))


def cross_entropy_rows_(z: torch.Tensor, labels: torch.Tensor, transform: LogitTransform, z_weight: float,
                        inv_divisor: float, want_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-sum-exp and label logit of each row of raw fp32 logits `z` [rows, V] (whole rows, labels all in
    [0, V)). `z` is scratch: with `want_grad` it ends as d/dz of inv_divisor * sum(lse - y[label] + z_weight *
    lse^2), else its contents are undefined.

    The reference of op "loss.cross_entropy_rows" (a kernel fuses these passes over the block into two)."""
    y = transform.apply_(z)
    target = labels.unsqueeze(1)
    picked = y.gather(1, target).squeeze(1)
    slope = transform.slope(y) if want_grad else 1.0
    # one exp over the block: exp(y - max) in place, its row sums give the log-sum-exp
    peak = y.amax(1, keepdim=True)
    e = exp_or_zero_(y.sub_(peak), LOG_PROB_ZERO)
    total = e.sum(1)
    lse = peak.squeeze(1) + total.log()
    if want_grad:
        # d/dy of (lse - y[label] + zw * lse^2) = softmax * (1 + 2 zw lse) - onehot(label)
        g = e.mul_((inv_divisor * (1.0 + 2.0 * z_weight * lse) / total).unsqueeze(1))
        g.scatter_add_(1, target, g.new_full(target.shape, -inv_divisor))
        if not (isinstance(slope, float) and slope == 1.0):
            g.mul_(slope)
    return lse, picked


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
