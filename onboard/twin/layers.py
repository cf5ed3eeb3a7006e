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


def layer_signature(layer: nn.Module, per_layer_values: tuple = (), shared: frozenset = frozenset()) -> str:
    """Structure of one decoder layer: module classes, parameter ranks, flags; never its widths. Below a module
    of `shared` (`shared_modules`: Zamba2's shared transformer block) the entries of a module
    list are named by what they are, not by how many there are: such a block may hold one entry per layer that
    uses it (Zamba2's adapters), so their count follows the model's depth, not the layer's kind."""
    parts = [f"cfg:{per_layer_values!r}"]
    for name, module in _named(layer, shared):
        parts.append(f"{name}:{type(module).__name__}:{','.join(_attr_fingerprint(module))}")
    for name, param in _named(layer, shared, parameters=True):
        parts.append(f"p:{name}:{param.dim()}")
    return "|".join(dict.fromkeys(parts))  # the entries of a shared block's lists, once each


def _named(layer: nn.Module, shared: frozenset, parameters: bool = False):
    """(name, module) of `layer`'s modules, or (name, parameter) of its parameters, with list indices below a
    shared module written `*`."""
    below = [name for name, m in layer.named_modules() if id(m) in shared]
    items = layer.named_parameters() if parameters else layer.named_modules()
    for name, item in items:
        inside = next((b for b in below if name == b or name.startswith(b + ".") or not b), None)
        if inside is not None:
            head, tail = name[:len(inside)], name[len(inside):]
            name = head + ".".join("*" if part.isdigit() else part for part in tail.split("."))
        yield name, item


def shared_modules(stack: nn.ModuleList) -> frozenset:
    """Ids of the modules of `stack`'s layers that hold a parameter another layer holds too (the same module, or
    copies tied to the same tensors, as transformers ties Zamba2's shared block)."""
    holders = collections.Counter()
    for layer in stack:
        holders.update({id(p) for p in layer.parameters()})
    return frozenset(id(m) for layer in stack for m in layer.modules()
                     if any(holders[id(p)] > 1 for p in m.parameters()))


def signatures(model: nn.Module, cfg: dict, layers_path: str, list_paths: list[str]) -> list[str]:
    """The signature of every decoder layer of `model`, with its entries of the config's per-layer lists."""
    stack = model.get_submodule(layers_path)
    lists = [get(cfg, p) for p in list_paths]
    shared = shared_modules(stack)
    return [layer_signature(layer, tuple(lst[i] for lst in lists), shared) for i, layer in enumerate(stack)]


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
