"""Chunk Loss: the LM head and cross-entropy a chunk of tokens at a time, gradients taken in the forward.

Each chunk holds its [chunk, V] logits once: the loss terms are read from it and it is turned in place into
d loss / d logits, which goes straight into the hidden, weight and bias gradients. Taking the gradients in
the forward costs no extra matmul (three in all, as with full logits); what it costs is holding the fp32
weight gradient from the forward to the backward, which the LM head (the last layer) needs at that point
anyway. The backward only rescales them by the incoming gradient, so it runs once per forward.
"""

from __future__ import annotations

import torch

from runtime.kernels import registry
from runtime.loss.blocks import backprop_block, cross_entropy_rows_, raw_logits
from runtime.loss.logits import LogitTransform


def _fp32_zeros(like: torch.Tensor | None, wanted: bool) -> torch.Tensor | None:
    return torch.zeros(like.shape, dtype=torch.float32, device=like.device) if wanted and like is not None else None


class TokenChunkedLoss(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], bias [V] | None, labels [N], all valid) -> (loss, z-loss part).

    loss = inv_divisor * sum_t (lse_t - y_t[label_t] + z_weight * lse_t^2); the z-loss part is the same
    sum of the last term alone (not differentiable: for logging). `grads` says which of hidden / weight /
    bias want a gradient; nothing is kept for the backward when none does.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, transform: LogitTransform, z_weight: float,
                inv_divisor: float, chunk: int, grads: tuple[bool, bool, bool]):
        grad_hidden = _fp32_zeros(hidden, grads[0])
        grad_weight = _fp32_zeros(weight, grads[1])
        grad_bias = _fp32_zeros(bias, grads[2])
        want = any(g is not None for g in (grad_hidden, grad_weight, grad_bias))
        rows_op = registry.lookup("loss.cross_entropy_rows", cross_entropy_rows_)
        ce = hidden.new_zeros((), dtype=torch.float32)
        z_sum = ce.clone()
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            h = hidden[rows]
            z = raw_logits(h, weight, bias)
            lse, picked = rows_op(z, labels[rows], transform, z_weight, inv_divisor, want)
            ce += (lse - picked).sum()
            z_sum += lse.square().sum()
            if not want:
                continue
            backprop_block(z, h, weight, grad_hidden[rows] if grad_hidden is not None else None,
                           grad_weight, grad_bias)
        ctx.grads = (grad_hidden, grad_weight, grad_bias) if want else None
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        z_part = z_sum * (z_weight * inv_divisor)
        ctx.mark_non_differentiable(z_part)
        return ce * inv_divisor + z_part, z_part

    @staticmethod
    def backward(ctx, grad_loss, _grad_z):
        if ctx.grads is None:
            raise RuntimeError("the chunked LM-head loss keeps its gradients for one backward: "
                               "compute the loss again (with grad enabled) to backpropagate again")
        grads, ctx.grads = ctx.grads, None
        # a loss used as is gets grad 1: the gradients are handed over without a copy
        scale = float(grad_loss)
        out = []
        for g, dtype in zip(grads, ctx.dtypes):
            if g is not None:
                g = g if scale == 1.0 else g.mul(scale)
                g = g if g.dtype == dtype else g.to(dtype)
            out.append(g)
        return (*out, None, None, None, None, None, None)
