"""The twin's depth, read from its layers: the decoder stack, a structural signature of each layer (module classes,
parameter ranks, flags; never widths), and the shortest prefix of layers that shows every distinct signature."""

from __future__ import annotations

import collections

from torch import nn

from onboard.errors import OnboardError
from onboard.twin.fields import get
from runtime import model_tree

MAX_TWIN_LAYERS = 80  # a full-depth twin at twin width (Zamba's 76 layers) still runs in seconds


def decoder_stack(model: nn.Module, num_layers: int | None) -> tuple[str, nn.ModuleList]:
    """(path, stack) of the decoder layers (`runtime.model_tree.find_layer_stack`); one line when there is none."""
    try:
        return model_tree.find_layer_stack(model, num_layers)
    except ValueError as exc:
        raise OnboardError(str(exc)) from None


def _attr_fingerprint(module: nn.Module) -> list[str]:
    out = []
    for key, value in sorted(vars(module).items()):
        if key.startswith("_") or key == "training":
            continue
        if isinstance(value, (bool, str)) or value is None:
            out.append(f"{key}={value!r}")
    return out


def layer_signature(layer: nn.Module, per_layer_values: tuple = ()) -> str:
    """Structure of one decoder layer: module classes, parameter ranks, flags; never its widths."""
    parts = [f"cfg:{per_layer_values!r}"]
    for name, module in layer.named_modules():
        parts.append(f"{name}:{type(module).__name__}:{','.join(_attr_fingerprint(module))}")
    for name, param in layer.named_parameters():
        parts.append(f"p:{name}:{param.dim()}")
    return "|".join(parts)


def signatures(model: nn.Module, cfg: dict, layers_path: str, list_paths: list[str]) -> list[str]:
    """The signature of every decoder layer of `model`, with its entries of the config's per-layer lists."""
    stack = model.get_submodule(layers_path)
    lists = [get(cfg, p) for p in list_paths]
    return [layer_signature(layer, tuple(lst[i] for lst in lists)) for i, layer in enumerate(stack)]


def prefix(signatures: list[str], uses: int) -> int:
    """The length of the shortest prefix in which every distinct signature occurs `uses` times (or as often as
    it occurs at all)."""
    wanted = collections.Counter(signatures)
    seen: collections.Counter = collections.Counter()
    for i, sig in enumerate(signatures):
        seen[sig] += 1
        if all(seen[s] >= min(uses, n) for s, n in wanted.items()):
            return i + 1
    return len(signatures)
