"""Helpers that generated adapters use to find a model's modules and tensors and swap blocks in place."""

from __future__ import annotations

import torch
from torch import nn


def tensor_at(root: nn.Module, path: str) -> torch.Tensor:
    """The parameter or buffer at a dotted path below `root` (the object itself: no copy)."""
    owner, _, name = path.rpartition(".")
    module = root.get_submodule(owner) if owner else root
    value = getattr(module, name)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{path} is not a tensor")
    return value


def replace_module(root: nn.Module, path: str, new: nn.Module) -> nn.Module:
    """Put `new` where the module at `path` was; returns the module it replaced."""
    owner, _, name = path.rpartition(".")
    parent = root.get_submodule(owner) if owner else root
    old = getattr(parent, name)
    setattr(parent, name, new)
    return old
