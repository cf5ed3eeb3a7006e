"""FX graphs of the tiny twin: one per distinct decoder-layer structure, plus embedding + head + loss.

Each decoder layer is exported on the exact inputs it received in a real forward pass of the twin
(recorded with forward pre-hooks), so masks, rotary tables and per-layer flags are the real ones.
`torch.export` (non-strict) is tried first; where a block has data-dependent Python control flow that
export refuses, `make_fx` in real mode records the path these inputs take. Both give ATen graphs whose
nodes carry ``nn_module_stack`` metadata, which is all the pattern matchers read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from onboard.errors import OnboardError
from onboard.source import _one_line
from onboard.twin import Twin


@dataclass
class Graph:
    """One captured graph and how to read it."""

    name: str  # "layer 3" or "embedding+head"
    module_path: str  # path of the captured module inside the model ("" for the whole model)
    gm: torch.fx.GraphModule | None
    method: str  # "export" | "make_fx" | "failed"
    params: dict[str, str] = field(default_factory=dict)  # placeholder name -> parameter / buffer path
    inputs: dict = field(default_factory=dict)  # the recorded keyword inputs (masks and friends)
    error: str = ""

    @property
    def nodes(self):
        return list(self.gm.graph.nodes) if self.gm is not None else []


@dataclass
class Capture:
    layers: dict[int, Graph]  # twin layer index of the first layer with each distinct signature -> graph
    head: Graph
    layer_of_signature: dict[str, int]


def _record_layer_inputs(twin: Twin, stack: nn.ModuleList) -> dict[int, tuple[tuple, dict]]:
    recorded: dict[int, tuple[tuple, dict]] = {}
    handles = []
    for i, layer in enumerate(stack):
        def hook(module, args, kwargs, i=i):
            recorded.setdefault(i, (tuple(_detach(a) for a in args), {k: _detach(v) for k, v in kwargs.items()}))
        handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            twin.model(**twin.example_batch(), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return recorded


def _detach(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple):
        return tuple(_detach(v) for v in value)
    if isinstance(value, list):
        return [_detach(v) for v in value]
    if isinstance(value, dict):
        return {k: _detach(v) for k, v in value.items()}
    return value


def _export(module: nn.Module, args: tuple, kwargs: dict) -> tuple[torch.fx.GraphModule, dict[str, str]]:
    ep = torch.export.export(module, args, kwargs, strict=False)
    sig = ep.graph_signature
    params = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
    return ep.graph_module, params


def _make_fx(module: nn.Module, args: tuple, kwargs: dict) -> tuple[torch.fx.GraphModule, dict[str, str]]:
    from torch.fx.experimental.proxy_tensor import make_fx

    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}

    def call(state, args, kwargs):
        return torch.func.functional_call(module, state, args, kwargs)

    gm = make_fx(call, tracing_mode="real", record_module_stack=True)(state, args, kwargs)
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return gm, dict(zip(placeholders, state.keys()))


def capture_module(name: str, path: str, module: nn.Module, args: tuple, kwargs: dict) -> Graph:
    """Export `module` on these inputs; fall back to real-mode make_fx; never raise."""
    errors = []
    for method, fn in (("export", _export), ("make_fx", _make_fx)):
        try:
            with torch.no_grad():
                gm, params = fn(module, args, kwargs)
            return Graph(name, path, gm, method, params, kwargs, "; ".join(errors))
        except Exception as exc:  # model code we do not own; the reason is kept for the spec
            errors.append(f"{method}: {_one_line(exc)}")
    return Graph(name, path, None, "failed", {}, kwargs, "; ".join(errors))


class _Passthrough(nn.Module):
    """Stands in for a decoder layer when capturing embedding + head: returns its input unchanged."""

    def __init__(self, returns_tuple: bool):
        super().__init__()
        self.returns_tuple = returns_tuple

    def forward(self, hidden_states, *args, **kwargs):
        return (hidden_states,) if self.returns_tuple else hidden_states


def _capture_head(twin: Twin, stack: nn.ModuleList, layer_returns_tuple: bool) -> Graph:
    original = list(stack)
    try:
        for i in range(len(stack)):
            stack[i] = _Passthrough(layer_returns_tuple)
        batch = twin.example_batch()
        return capture_module("embedding+head", "", twin.model, (), {**batch, "use_cache": False})
    finally:
        for i, layer in enumerate(original):
            stack[i] = layer


def capture(twin: Twin) -> Capture:
    modules = dict(twin.model.named_modules())
    stack = modules[twin.layers_path]
    recorded = _record_layer_inputs(twin, stack)
    if len(recorded) != len(stack):
        raise OnboardError(f"{twin.source.name}: only {len(recorded)} of {len(stack)} decoder layers ran")
    first_of: dict[str, int] = {}
    for i, sig in enumerate(twin.layer_signatures):
        first_of.setdefault(sig, i)
    layers = {}
    for sig, i in first_of.items():
        args, kwargs = recorded[i]
        layers[i] = capture_module(f"layer {i}", f"{twin.layers_path}.{i}", stack[i], args, kwargs)
    with torch.no_grad():
        args, kwargs = recorded[0]
        returns_tuple = isinstance(stack[0](*args, **kwargs), tuple)
    head = _capture_head(twin, stack, returns_tuple)
    return Capture(layers, head, first_of)
