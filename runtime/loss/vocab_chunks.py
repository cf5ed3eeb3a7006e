"""Cut cross-entropy: the loss through blocks of [tokens, vocabulary slice], never a whole row of logits.

The forward sweeps each chunk of tokens over the vocabulary in slices, keeping a running maximum and sum of
exponentials (an online log-sum-exp), and reads each token's own logit from its weight row directly. The
backward recomputes every block from the saved log-sum-exp, turns it into d loss / d logits and adds its
share to the hidden, weight and bias gradients. One matmul more than full logits (four instead of three)
buys memory that no longer grows with the vocabulary.
"""

from __future__ import annotations

import torch

from runtime.loss.blocks import backprop_block, head_logits
from runtime.loss.logits import LogitTransform
from runtime.subnormals import LOG_PROB_ZERO, exp_or_zero, exp_or_zero_


def _target_logits(hidden, weight, bias, labels, transform: LogitTransform) -> torch.Tensor:
    """y[t, label_t] from the label's weight row, without the rest of the row."""
    w = weight.index_select(0, labels)
    z = (hidden.float() * w.float()).sum(1)
    if bias is not None:
        z = z + bias.index_select(0, labels).float()
    return transform.apply_(z)


def _online_lse(hidden, weight, bias, transform: LogitTransform, chunk_vocab: int) -> torch.Tensor:
    peak = torch.full((hidden.shape[0],), float("-inf"), device=hidden.device)
    total = torch.zeros_like(peak)
    for v0 in range(0, weight.shape[0], chunk_vocab):
        v = slice(v0, v0 + chunk_vocab)
        y = head_logits(hidden, weight[v], bias[v] if bias is not None else None, transform)
        new_peak = torch.maximum(peak, y.amax(1))
        total = (total * exp_or_zero(peak - new_peak, LOG_PROB_ZERO)
                 + exp_or_zero_(y.sub_(new_peak.unsqueeze(1)), LOG_PROB_ZERO).sum(1))
        peak = new_peak
    return peak + total.log()


class VocabChunkedLoss(torch.autograd.Function):
    """Same contract as TokenChunkedLoss (hidden [N, H], weight [V, H], bias, labels [N], all valid),
    holding at most [chunk_tokens, chunk_vocab] logits at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, transform: LogitTransform, z_weight: float,
                inv_divisor: float, chunk_tokens: int, chunk_vocab: int):
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        target = torch.empty_like(lse)
        for t0 in range(0, hidden.shape[0], chunk_tokens):
            t = slice(t0, t0 + chunk_tokens)
            lse[t] = _online_lse(hidden[t], weight, bias, transform, chunk_vocab)
            target[t] = _target_logits(hidden[t], weight, bias, labels[t], transform)
        ctx.save_for_backward(hidden, weight, bias, labels, lse, target)
        ctx.options = (transform, z_weight, inv_divisor, chunk_tokens, chunk_vocab)
        z_part = lse.square().sum() * (z_weight * inv_divisor)
        ctx.mark_non_differentiable(z_part)
        return (lse - target).sum() * inv_divisor + z_part, z_part

    @staticmethod
    def backward(ctx, grad_loss, _grad_z):
        hidden, weight, bias, labels, lse, target = ctx.saved_tensors
        transform, z_weight, inv_divisor, chunk_tokens, chunk_vocab = ctx.options
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if want_h else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_b else None
        scale = grad_loss.float() * inv_divisor
        for t0 in range(0, hidden.shape[0], chunk_tokens):
            t = slice(t0, t0 + chunk_tokens)
            h, lse_t, labels_t = hidden[t], lse[t].unsqueeze(1), labels[t]
            gh = grad_hidden[t] if want_h else None
            # softmax part of d/dy (lse - y[label] + zw * lse^2): softmax * (1 + 2 zw lse)
            coef = scale * (1.0 + 2.0 * z_weight * lse_t)
            for v0 in range(0, weight.shape[0], chunk_vocab):
                v = slice(v0, v0 + chunk_vocab)
                w, b = weight[v], bias[v] if bias is not None else None
                y = head_logits(h, w, b, transform)
                slope = transform.slope(y)
                g = exp_or_zero_(y.sub_(lse_t), LOG_PROB_ZERO).mul_(coef)
                if not (isinstance(slope, float) and slope == 1.0):
                    g.mul_(slope)
                backprop_block(g, h, w, gh, grad_weight[v] if want_w else None, grad_bias[v] if want_b else None)
            # the -onehot(label) part touches one weight row per token
            g_target = (-scale * transform.slope(target[t])).expand(h.shape[0])
            if want_h:
                gh.add_(g_target.unsqueeze(1) * weight.index_select(0, labels_t).float())
            if want_w:
                grad_weight.index_add_(0, labels_t, g_target.unsqueeze(1) * h.float())
            if want_b:
                grad_bias.index_add_(0, labels_t, g_target)
        return (_cast(grad_hidden, hidden), _cast(grad_weight, weight), _cast(grad_bias, bias),
                None, None, None, None, None, None)


def _cast(grad: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    return grad if grad is None or grad.dtype == like.dtype else grad.to(like.dtype)
