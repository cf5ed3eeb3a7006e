"""Finding things in a (runtime-adapted) HuggingFace model's module tree: tensors by path, the decoder layer
stack, the runtime MoE blocks."""

from __future__ import annotations

import torch
from torch import nn

from runtime.moe.block import MoEBlock


class Vacated(nn.Module):
    """A module of the model another rank runs (a pipeline stage's cut: `runtime.parallel.pipeline`): it holds no
    parameters, and the layer-stack search and `decoder_layers` look past it."""


def tensor_at(root: nn.Module, path: str) -> torch.Tensor:
    """The parameter or buffer at a dotted path below `root` (the object itself: no copy)."""
    owner, _, name = path.rpartition(".")
    module = root.get_submodule(owner) if owner else root
    value = getattr(module, name)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{path} is not a tensor")
    return value


def find_layer_stack(model: nn.Module, num_layers: int | None = None) -> tuple[str, nn.ModuleList]:
    """(path, ModuleList) of the decoder layers: of the ModuleLists of blocks that all hold parameters, the one
    with exactly `num_layers` blocks if given, then the shallowest, then the longest. Per-expert lists are
    nested inside layers and never win. Raises ValueError when there is none."""
    best = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if any(next(child.parameters(), None) is None for child in module if not isinstance(child, Vacated)):
            continue
        if all(isinstance(child, Vacated) for child in module):
            continue
        if "expert" in name.split(".")[-1]:
            continue
        score = (num_layers is not None and len(module) == num_layers, -name.count("."), len(module))
        if best is None or score > best[0]:
            best = (score, (name, module))
    if best is None:
        raise ValueError(f"{type(model).__name__}: no decoder layer stack (no ModuleList of blocks with parameters)")
    return best[1]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """A HuggingFace model's decoder layers that this rank runs (its config's `num_hidden_layers` breaks ties): all
    of them, or a pipeline stage's."""
    stack = find_layer_stack(model, getattr(getattr(model, "config", None), "num_hidden_layers", None))[1]
    return [layer for layer in stack if not isinstance(layer, Vacated)]


def moe_blocks(model: nn.Module) -> list[tuple[str, MoEBlock]]:
    """(path, block) of the runtime MoE blocks in a model, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoEBlock)]
