"""Language-model losses that never hold the full logits tensor.

    loss = lm_head_loss(hidden, weight, labels, *, bias=None, ignore_index=-100, softcap=None,
                        logit_scale=1.0, z_loss_weight=0.0, num_items_in_batch=None, shift_labels=True,
                        chunk_tokens=None, chunk_vocab=None, return_z_loss=False)
    head_loss = LMHeadLoss.from_linear(model.lm_head, softcap=30.0)   # same Parameter objects, no copies
    loss = head_loss(hidden, labels, num_items_in_batch=None)

`hidden` [..., H] is the final hidden state (after the last norm), `weight` [V, H] and `bias` [V] the LM
head's (an nn.Linear's layout; a tied embedding works as is), `labels` [...] token ids with `ignore_index`
where nothing is predicted. The result equals HuggingFace's `ForCausalLMLoss` on
`softcap * tanh(logit_scale * (hidden @ weight.T + bias) / softcap)` computed in fp32:

- `shift_labels=True`: labels are the input ids (token t predicts label t+1, as ForCausalLMLoss shifts
  them); False: labels are already aligned with `hidden` (HF's `shift_labels=` tensor, packed sequences).
- `num_items_in_batch=None`: mean over the tokens not ignored; else their sum divided by it (an int or a
  tensor; HF's gradient-accumulation normalisation). A batch with nothing to predict gives 0, not nan.
- `logit_scale` multiplies the head's output (Cohere; Granite's `1 / logits_scaling`), `softcap` caps it
  after the scale (Gemma-2, Grok); `z_loss_weight` adds `z_loss_weight * logsumexp(logits)^2` per token
  (PaLM / ST-MoE z-loss), normalised like the cross-entropy; `return_z_loss=True` also returns that term
  (already in the loss, detached) for logging.
- `chunk_vocab=None`: Chunk Loss, [chunk_tokens, V] logits at a time, gradients taken during the forward
  (three matmuls, as with full logits; its backward runs once per forward). An int: cut cross-entropy,
  at most [chunk_tokens, chunk_vocab] logits, online log-sum-exp, gradients recomputed in the backward
  (four matmuls). `chunk_tokens=None` sizes blocks to about 128 MiB of fp32 logits (`LOGITS_BUDGET`).

Backend dispatch: the token-chunked loss asks `runtime.kernels.registry` for op "loss.cross_entropy_rows"
(reference: `runtime.loss.blocks.cross_entropy_rows_`); templates/kernels/loss_triton.py.j2 renders a Triton
kernel for it (render with name, vocab, block: a power of two, e.g. min(next_pow2(vocab), 4096)) whose
`register()` the bundle loader calls. The head's matmuls stay with torch on every backend.

Everything is accumulated in fp32 and gradients reach `hidden`, `weight` and `bias` in their own dtypes.
Ignored tokens never go through the head. Bad shapes, dtypes, label ids or options raise ValueError.
"""

from runtime.loss.head import LOGITS_BUDGET, LMHeadLoss, lm_head_loss
from runtime.loss.logits import LogitTransform

__all__ = ["LOGITS_BUDGET", "LMHeadLoss", "LogitTransform", "lm_head_loss"]
