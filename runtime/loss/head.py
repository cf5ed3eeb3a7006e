"""`lm_head_loss`: the LM head and the causal-LM loss in one call that never holds the full logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.loss.logits import LogitTransform
from runtime.loss.token_chunks import TokenChunkedLoss
from runtime.loss.vocab_chunks import VocabChunkedLoss

# fp32 logits one block may hold when the chunk is not given: 32 Mi elements, 128 MiB
LOGITS_BUDGET = 1 << 25


def _check(hidden, weight, bias, labels, z_loss_weight, chunk_tokens, chunk_vocab) -> None:
    if weight.dim() != 2 or hidden.dim() < 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} does not fit an LM head weight {tuple(weight.shape)} "
                         "(expected hidden [..., H] and weight [V, H])")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden is {hidden.dtype} but the LM head weight is {weight.dtype}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"LM head bias {tuple(bias.shape)} does not match vocabulary {weight.shape[0]}")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"labels {tuple(labels.shape)} must have hidden's leading shape {tuple(hidden.shape[:-1])}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"labels must be integer token ids, got {labels.dtype}")
    if not z_loss_weight >= 0:
        raise ValueError(f"z_loss_weight must be >= 0, got {z_loss_weight}")
    for name, value in (("chunk_tokens", chunk_tokens), ("chunk_vocab", chunk_vocab)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")


def _divisor(valid: int, num_items_in_batch) -> float:
    """HF's normalisation: the sum over the tokens divided by num_items_in_batch, else their mean. A batch
    with no token to predict gives 0 (HF's mean gives nan, which would poison a training step)."""
    if num_items_in_batch is None:
        return float(max(valid, 1))
    n = float(num_items_in_batch)
    if not n > 0:
        raise ValueError(f"num_items_in_batch must be positive, got {n}")
    return n


def lm_head_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                 bias: torch.Tensor | None = None, ignore_index: int = -100, softcap: float | None = None,
                 logit_scale: float = 1.0, z_loss_weight: float = 0.0, num_items_in_batch=None,
                 shift_labels: bool = True, chunk_tokens: int | None = None, chunk_vocab: int | None = None,
                 return_z_loss: bool = False):
    """Causal-LM cross-entropy of `hidden` [..., H] through the head `weight` [V, H] (+ `bias`), without
    the [tokens, V] logits. See the package docstring for the options; returns the loss, or
    (loss, z-loss part) with `return_z_loss` (that part is already inside the loss; it is for logging)."""
    _check(hidden, weight, bias, labels, z_loss_weight, chunk_tokens, chunk_vocab)
    transform = LogitTransform(float(logit_scale), None if softcap is None else float(softcap))
    if shift_labels:  # token t predicts label t + 1; the last position predicts nothing
        labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    labels = labels.reshape(-1).to(device=hidden.device, dtype=torch.int64)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    vocab = weight.shape[0]
    valid = labels != ignore_index
    if bool(((labels < 0) | (labels >= vocab))[valid].any()):
        raise ValueError(f"labels hold ids outside the vocabulary [0, {vocab}) other than ignore_index "
                         f"{ignore_index}")
    # ignored tokens add nothing to the loss: only the others go through the head
    rows = valid.nonzero().squeeze(1)
    if rows.numel() < labels.numel():
        hidden, labels = hidden.index_select(0, rows), labels.index_select(0, rows)
    inv_divisor = 1.0 / _divisor(rows.numel(), num_items_in_batch)
    z_weight = float(z_loss_weight)
    if chunk_vocab is None:
        chunk = chunk_tokens or max(1, LOGITS_BUDGET // vocab)
        grads = tuple(torch.is_grad_enabled() and t is not None and t.requires_grad for t in (hidden, weight, bias))
        loss, z_part = TokenChunkedLoss.apply(hidden, weight, bias, labels, transform, z_weight, inv_divisor,
                                              chunk, grads)
    else:
        chunk = chunk_tokens or max(1, LOGITS_BUDGET // chunk_vocab)
        loss, z_part = VocabChunkedLoss.apply(hidden, weight, bias, labels, transform, z_weight, inv_divisor,
                                              chunk, chunk_vocab)
    return (loss, z_part) if return_z_loss else loss


class LMHeadLoss(nn.Module):
    """An LM head and its loss as one module, around the head's own parameters (the same objects: tied
    embeddings stay tied, optimizer state and checkpoints are unaffected)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None = None, *, ignore_index: int = -100,
                 softcap: float | None = None, logit_scale: float = 1.0, z_loss_weight: float = 0.0,
                 shift_labels: bool = True, chunk_tokens: int | None = None, chunk_vocab: int | None = None):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.options = {"ignore_index": ignore_index, "softcap": softcap, "logit_scale": logit_scale,
                        "z_loss_weight": z_loss_weight, "shift_labels": shift_labels,
                        "chunk_tokens": chunk_tokens, "chunk_vocab": chunk_vocab}

    @classmethod
    def from_linear(cls, head: nn.Linear, **options) -> LMHeadLoss:
        return cls(head.weight, head.bias, **options)

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None,
                return_z_loss: bool = False):
        return lm_head_loss(hidden, self.weight, labels, bias=self.bias, num_items_in_batch=num_items_in_batch,
                            return_z_loss=return_z_loss, **self.options)

    def extra_repr(self) -> str:
        vocab, hidden = self.weight.shape
        set_options = ", ".join(f"{k}={v}" for k, v in self.options.items() if v is not None)
        return f"vocab={vocab}, hidden={hidden}, bias={self.bias is not None}, {set_options}"
