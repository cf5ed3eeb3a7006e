"""Recompute: chosen modules keep only their inputs in forward and run again during backward.

Non-reentrant `torch.utils.checkpoint` (it nests with saved-tensor hooks such as activation offload, takes
keyword arguments, and restores the RNG state so dropout draws the same masks). The module's `forward` is
wrapped in place, so parameter names, state dicts and checkpoints do not change.

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


def _checkpointed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def recompute_module(module: nn.Module) -> None:
    if getattr(module, "_onboard_recompute", False):
        return
    module.forward = functools.partial(_checkpointed, module.forward)
    module._onboard_recompute = True


def apply_recompute(model: nn.Module, policy: str) -> int:
    """Wrap the modules `policy` names; returns how many were wrapped."""
    if policy == "none":
        return 0
    if policy == "full":
        targets = list(decoder_layers(model))
    elif policy == "selective":
        from runtime.moe.block import MoEBlock

        targets = [m for m in model.modules() if isinstance(m, MoEBlock)]
        if not targets:
            raise ValueError("selective recompute wraps runtime MoE blocks, and this model has none")
    else:
        raise ValueError(f"recompute policy must be none, selective or full, got {policy!r}")
    for module in targets:
        recompute_module(module)
    return len(targets)
