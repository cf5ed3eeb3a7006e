"""The base of every module the onboarding agent writes (a bundle's `generated/*.py`).

    replacement = load_generated(path)(original)     # the class a generated file defines, built on `original`

A generated module takes the place of one HuggingFace module. It is built from that module's state and
never from the module itself (`ModuleState`: what the onboarding agent's sandbox receives, where the module's
class cannot be imported): `Generated.__init__` registers the original's parameters and buffers (the same
tensors, no copies) under the same dotted names, and copies its plain settings (numbers, strings, flags,
tuples of them) onto the same places, so generated code reads `self.fn`, `self.input_norm.eps` as the
original's code would, the model's state_dict keys do not change, and no reference to the original module,
its class or its forward is left for the generated code to call. Generated files define a subclass with a
`forward` (and helpers) only; `onboard.agent.guard` refuses one that defines `__init__`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

PLAIN = (int, float, bool, str, type(None))


def _plain(value) -> bool:
    if isinstance(value, tuple | list):
        return all(_plain(v) for v in value)
    return isinstance(value, PLAIN)


def settings(module: nn.Module) -> dict[str, object]:
    """{dotted name: value} of the plain instance settings of `module` and its submodules (what its code reads
    beside tensors: a head count, an epsilon, an iteration count), in a stable order."""
    out = {}
    for prefix, sub in module.named_modules():
        for name, value in sorted(vars(sub).items()):
            if not name.startswith("_") and name != "training" and _plain(value):
                out[f"{prefix}.{name}" if prefix else name] = value
    return out


@dataclass
class ModuleState:
    """What a generated module is built from: a module's plain settings, parameters and buffers by dotted name,
    which buffers its state_dict holds, its mode, and its class's name (for repr only)."""

    settings: dict[str, object]
    parameters: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    persistent: set[str] = field(default_factory=set)
    training: bool = False
    replaces: str = ""

    @classmethod
    def of(cls, module: nn.Module) -> ModuleState:
        return cls(settings(module), dict(module.named_parameters()), dict(module.named_buffers()),
                   set(module.state_dict(keep_vars=True)), module.training, type(module).__name__)

    def names(self) -> set[str]:
        """The dotted names generated code reads as self.<name>."""
        return set(self.settings) | set(self.parameters) | set(self.buffers)


def _frozen(value):
    return tuple(_frozen(v) for v in value) if isinstance(value, tuple | list) else value


class Generated(nn.Module):
    """Holds the original module's parameters, buffers and settings at their own names (module docstring)."""

    def __init__(self, original: nn.Module | ModuleState):
        super().__init__()
        state = original if isinstance(original, ModuleState) else ModuleState.of(original)
        for path, value in state.settings.items():  # lists as tuples: settings are read, never kept in
            self._owner(path).__dict__[path.rpartition(".")[2]] = _frozen(value)
        for path, param in state.parameters.items():
            self._owner(path).register_parameter(path.rpartition(".")[2], param)
        for path, buffer in state.buffers.items():
            self._owner(path).register_buffer(path.rpartition(".")[2], buffer, persistent=path in state.persistent)
        self.replaces = state.replaces  # for repr and REVIEW.md only
        self.train(state.training)  # a module swapped into an evaluated model evaluates too

    def _owner(self, path: str) -> nn.Module:
        """The container for a dotted name's last part, made on the way (plain modules, named as the original's)."""
        owner: nn.Module = self
        for part in path.split(".")[:-1]:
            if part not in owner._modules:
                owner.add_module(part, nn.Module())
            owner = owner._modules[part]
        return owner

    def extra_repr(self) -> str:
        return f"generated, replaces {self.replaces}"


def load_generated(path: Path | str, name: str = "Replacement") -> type[Generated]:
    """The class `name` a generated file defines (loaded by path: a bundle is no package)."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(f"onboard_generated_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cls = getattr(module, name, None)
    if not (isinstance(cls, type) and issubclass(cls, Generated)):
        raise ValueError(f"{path} defines no {name}(runtime.generated.Generated)")
    return cls
