"""Recompute: chosen modules keep only their inputs in forward and run again during backward.

Non-reentrant `torch.utils.checkpoint` (it nests with saved-tensor hooks such as activation offload, takes
keyword arguments, and restores the RNG state so dropout draws the same masks). The module's `forward` is
wrapped in place through one swap (`runtime.swap`, kind RECOMPUTE), so parameter names, state dicts and
checkpoints do not change, and the handle's `undo()` gives back the forward each module ran before.

Policies (`runtime.plan.RECOMPUTE`):
- "full": every decoder layer (`runtime.model_tree.decoder_layers`).
- "selective": the runtime MoE blocks only; routing, permuted tokens and grouped-matmul intermediates
  are the bulk of an MoE layer's activations, while attention and norms keep theirs.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from runtime.model_tree import decoder_layers
from runtime.swap import RECOMPUTE, Swap

_WRAPPED = "_onboard_recompute"  # set on a wrapped module: a second policy does not wrap it twice


def _checkpointed(swap: Swap, forward, *args, **kwargs):
    swap.count(RECOMPUTE)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def recompute_module(module: nn.Module, swap: Swap) -> bool:
    """Wrap `module`'s forward (through `swap`); False when it is wrapped already."""
    if getattr(module, _WRAPPED, False):
        return False
    # a partial, not a closure: a deep copy of the model then checkpoints the copy's own forward
    swap.wrap_forward(module, lambda forward: functools.partial(_checkpointed, swap, forward))
    swap.set(module, _WRAPPED, True)
    return True


def apply_recompute(model: nn.Module, policy: str) -> Swap:
    """Wrap the modules `policy` names; returns the handle (kind RECOMPUTE), whose `parts` name the modules
    wrapped and whose `calls` count their checkpointed forwards."""
    swap = Swap(RECOMPUTE)
    if policy == "none":
        return swap
    if policy == "full":
        targets = list(decoder_layers(model))
    elif policy == "selective":
        from runtime.moe.block import MoEBlock

        targets = [m for m in model.modules() if isinstance(m, MoEBlock)]
        if not targets:
            raise ValueError("selective recompute wraps runtime MoE blocks, and this model has none")
    else:
        raise ValueError(f"recompute policy must be none, selective or full, got {policy!r}")
    names = {id(m): name for name, m in model.named_modules()}
    for module in targets:
        if recompute_module(module, swap):
            swap.parts[names[id(module)]] = type(module).__name__
    return swap
