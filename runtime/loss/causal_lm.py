"""Make a HuggingFace causal LM compute its training loss without the full logits tensor.

transformers' causal-LM heads all follow one shape: decoder → last hidden state → LM head (on the positions
`logits_to_keep` selects) → `loss_function(logits, labels)` → plus the router auxiliary loss times its
coefficient when router logits are requested. `swap_causal_lm_loss` gives the model a forward of its own
(`runtime.swap.Swap.set_forward`: the class and every other model stay as they are) that keeps that forward,
asks it for no logits at all (an empty `logits_to_keep`), takes the decoder's last hidden state and computes
the loss with `runtime.loss.lm_head_loss` on the head's own parameters. Without labels it is the class's
forward (generation and evaluation get their logits as before). The handle counts runtime loss calls as
`swap.calls["loss"]`.

This is a reading of the model, not a certainty: a model that transforms the hidden state or the logits
in ways not given here (`softcap`, `logit_scale`) computes a different loss, which verification catches.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.sequence_split import active
from runtime.loss.head import lm_head_loss
from runtime.swap import LOSS, Swap


def swap_causal_lm_loss(model: nn.Module, head_path: str = "lm_head", *, decoder_path: str | None = None,
                        softcap: float | None = None, logit_scale: float = 1.0, aux_loss_coef: float | None = None,
                        chunk_tokens: int | None = None, chunk_vocab: int | None = None) -> Swap:
    """Swap the loss of this one model (parameters, names and state dict unchanged). `decoder_path` names the
    module whose output is the last hidden state (default: `model.get_decoder()`); `aux_loss_coef` the weight
    of the router auxiliary loss in the training loss (default: the model's `*aux_loss_coef` attribute or
    config field). Raises ValueError, changing nothing, when the head is not one linear projection or there is
    no decoder module."""
    head = model.get_submodule(head_path)
    if not isinstance(getattr(head, "weight", None), torch.Tensor) or head.weight.dim() != 2:
        raise ValueError(f"{head_path} is not a linear LM head (no 2-D weight)")
    decoder = model.get_submodule(decoder_path) if decoder_path else getattr(model, "get_decoder", lambda: None)()
    if decoder is None or decoder is model:
        raise ValueError(f"{type(model).__name__}: no decoder module to read the last hidden state from")
    options = {"head_path": head_path, "decoder_path": decoder_path, "softcap": softcap, "logit_scale": logit_scale,
               "aux_loss_coef": aux_loss_coef if aux_loss_coef is not None else _aux_coef(model),
               "chunk_tokens": chunk_tokens, "chunk_vocab": chunk_vocab}
    swap = Swap(LOSS)

    def forward(self, *args, labels=None, **kwargs):
        if labels is None:
            return type(self).forward(self, *args, **kwargs)
        swap.count(LOSS)
        return _forward_with_loss(self, options, args, labels, kwargs)

    swap.set_forward(model, forward)
    return swap


def _aux_coef(model: nn.Module) -> float:
    """The router auxiliary-loss weight a model adds to its loss (router_aux_loss_coef, aux_loss_coef, ...)."""
    for owner in (model, getattr(model, "config", None)):
        for name in sorted(vars(owner) if owner is not None else ()):
            value = getattr(owner, name)
            if name.endswith("aux_loss_coef") and isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
    return 0.0


def _routing(model: nn.Module) -> tuple[int, int]:
    """(experts, picks per token) of HuggingFace's load-balancing loss, as the model's forward passes them."""
    experts = getattr(model, "num_experts", None)
    top_k = getattr(model, "num_experts_per_tok", None)
    if not isinstance(experts, int) or not isinstance(top_k, int):
        raise ValueError(f"{type(model).__name__} adds a router loss but names no num_experts / num_experts_per_tok: "
                         f"its load-balancing loss under context parallelism is not built")
    return experts, top_k


def _last_hidden(output):
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple):
        return output[0]
    return output.last_hidden_state


def _forward_with_loss(model, options, args, labels, kwargs):
    captured = {}
    decoder = model.get_submodule(options["decoder_path"]) if options["decoder_path"] else model.get_decoder()
    hook = decoder.register_forward_hook(
        lambda _module, _inputs, output: captured.__setitem__("hidden", _last_hidden(output)))
    try:
        no_logits = torch.empty(0, dtype=torch.long, device=labels.device)
        out = type(model).forward(model, *args, labels=None, **{**kwargs, "logits_to_keep": no_logits})
    finally:
        hook.remove()
    head = model.get_submodule(options["head_path"])
    shifted = kwargs.get("shift_labels")  # already shifted on the whole sequence (context parallelism)
    loss = lm_head_loss(captured["hidden"], head.weight, labels if shifted is None else shifted,
                        bias=getattr(head, "bias", None), softcap=options["softcap"],
                        logit_scale=options["logit_scale"], num_items_in_batch=kwargs.get("num_items_in_batch"),
                        shift_labels=shifted is None, chunk_tokens=options["chunk_tokens"],
                        chunk_vocab=options["chunk_vocab"])
    aux = getattr(out, "aux_loss", None)
    if aux is not None:  # the model adds its router load-balancing loss to the training loss
        if (split := active()) is not None:  # its statistics over the whole sequence, every cp rank's tokens
            aux = split.balance_loss(out.router_logits, *_routing(model))
        loss = loss + options["aux_loss_coef"] * aux.to(loss.device)
    out.loss = loss
    return out
