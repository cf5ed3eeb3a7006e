"""Recompute: chosen modules keep only their inputs in forward and run again during backward.

Non-reentrant `torch.utils.checkpoint` (it nests with saved-tensor hooks such as activation swap, takes
keyword arguments, and restores the RNG state so dropout draws the same masks). The module's `forward` is
wrapped in place, so parameter names, state dicts and checkpoints do not change.

Policies (`runtime.plan.RECOMPUTE`):
- "full": every decoder layer (the ModuleList that holds most of the model's parameters).
- "selective": the runtime MoE blocks only; routing, permuted tokens and grouped-matmul intermediates
  are the bulk of an MoE layer's activations, while attention and norms keep theirs.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The layer stack: the ModuleList holding the most parameters (per-layer expert lists hold fewer)."""
    best, best_count = None, 0
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module):
            count = sum(p.numel() for p in module.parameters())
            if count > best_count:
                best, best_count = module, count
    if best is None:
        raise ValueError(f"{type(model).__name__} has no ModuleList of layers to recompute")
    return best


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
