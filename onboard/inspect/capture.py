"""FX graphs of the tiny twin: one per distinct decoder-layer structure, plus embedding + head + loss.

Each decoder layer is exported on the exact inputs it received in a real forward pass of the twin
(recorded with forward pre-hooks), so masks, rotary tables and per-layer flags are the real ones.
`torch.export` (non-strict) is tried first; where a block has data-dependent Python control flow that
export refuses, an eager run under a dispatch-mode recorder writes down the ATen ops these inputs take.
Both give ATen graphs whose nodes carry ``nn_module_stack`` metadata, which is all the matchers read.
"""

from __future__ import annotations

import contextlib
import io
import operator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from onboard.errors import OnboardError, one_line
from onboard.twin import Twin


@dataclass
class Graph:
    """One captured graph and how to read it."""

    name: str  # "layer 3" or "embedding+head"
    module_path: str  # path of the captured module inside the model ("" for the whole model)
    gm: torch.fx.GraphModule | None
    method: str  # "export" | "recorded" | "failed"
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
    twin.forward_once(handles)
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


@contextlib.contextmanager
def _without_stack_traces():
    """Export keeps the Python stack of every node it traces (`node.meta["stack_trace"]`), which no matcher reads:
    walking and symbolising those stacks is about a sixth of a Gated DeltaNet layer's capture. torch.fx's own switch
    turns it off (torch 2.9 and later; older releases keep recording)."""
    config = torch.fx.config
    before = getattr(config, "do_not_emit_stack_traces", None)
    if before is None:
        yield
        return
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


def _export(module: nn.Module, args: tuple, kwargs: dict) -> tuple[torch.fx.GraphModule, dict[str, str]]:
    with _without_stack_traces():
        ep = torch.export.export(module, args, kwargs, strict=False)
    sig = ep.graph_signature
    params = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
    return ep.graph_module, params


class _OpRecorder(TorchFunctionMode):
    """Records every torch call of an eager run into an FX graph, with the module stack at each call.

    Used where `torch.export` refuses a block because of data-dependent Python control flow (an expert
    loop over the experts that received tokens): the eager run simply takes the path these inputs take.
    Calls are caught at the torch-function level, so `linear`, `scaled_dot_product_attention`, `topk`
    and friends appear as themselves, as in export's graphs; nested calls inside them are not repeated.
    """

    def __init__(self, graph: torch.fx.Graph, env: dict, keep: list, stack: list):
        super().__init__()
        self.graph, self.env, self.keep, self.stack = graph, env, keep, stack

    def _node_for(self, value):
        if isinstance(value, torch.Tensor):
            return self.env.get(id(value))
        if isinstance(value, (list, tuple)):
            return type(value)(self._node_for(v) if isinstance(v, (torch.Tensor, list, tuple)) else v for v in value)
        return value

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if not any(isinstance(o, torch.Tensor) for o in outs):
            return out  # shape queries and the like
        node = self.graph.call_function(_recordable(func), tuple(self._node_for(a) for a in args),
                                        {k: self._node_for(v) for k, v in kwargs.items()})
        node.meta["nn_module_stack"] = {path: (path, cls) for path, cls in self.stack}
        self.keep.append(out)  # ids stay unique while the tensors are alive
        if isinstance(out, torch.Tensor):
            node.meta["val"] = out
            self.env[id(out)] = node
        else:
            for i, item in enumerate(outs):
                if isinstance(item, torch.Tensor):
                    item_node = self.graph.call_function(operator.getitem, (node, i))
                    item_node.meta["val"] = item
                    item_node.meta["nn_module_stack"] = node.meta["nn_module_stack"]
                    self.env[id(item)] = item_node
        return out


_PROPERTY_READS: dict[str, object] = {}


def _recordable(func):
    """`func` as a graph target. A tensor property read (`w.T`, DBRX's experts) reaches the mode as the bound
    `__get__` of the property's descriptor, which has no module for a graph to name: it is recorded as a function
    named after the property."""
    if hasattr(func, "__module__"):
        return func
    name = getattr(getattr(func, "__self__", None), "__name__", None)
    if name is None:
        return func
    if name not in _PROPERTY_READS:
        def read(tensor, _name=name):
            return getattr(tensor, _name)
        read.__name__ = read.__qualname__ = name
        _PROPERTY_READS[name] = read
    return _PROPERTY_READS[name]


def _record_ops(module: nn.Module, args: tuple, kwargs: dict) -> tuple[torch.fx.GraphModule, dict[str, str]]:
    graph = torch.fx.Graph()
    env: dict = {}
    keep: list = []
    params: dict[str, str] = {}
    for i, (name, tensor) in enumerate([*module.named_parameters(), *module.named_buffers()]):
        node = graph.placeholder(f"p_{i}")
        node.meta["val"] = tensor.detach()
        env[id(tensor)] = node
        params[node.name] = name
    flat, _ = torch.utils._pytree.tree_flatten((args, kwargs))
    for i, value in enumerate(flat):
        if isinstance(value, torch.Tensor) and id(value) not in env:
            node = graph.placeholder(f"input_{i}")
            node.meta["val"] = value
            env[id(value)] = node
    stack: list = []
    handles = []

    def enter(path):
        def hook(module, args):
            stack.append((path, type(module)))
        return hook

    def leave(module, args, output):
        stack.pop()  # returning None keeps the module's output as it is

    for path, sub in module.named_modules():
        if path:
            handles.append(sub.register_forward_pre_hook(enter(path)))
            handles.append(sub.register_forward_hook(leave))
    try:
        with torch.no_grad(), _OpRecorder(graph, env, keep, stack):
            module(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    graph.output(None)
    return torch.fx.GraphModule(module, graph), params


def capture_module(name: str, path: str, module: nn.Module, args: tuple, kwargs: dict) -> Graph:
    """Export `module` on these inputs; fall back to recording an eager run; never raise."""
    errors = []
    for method, fn in (("export", _export), ("recorded", _record_ops)):
        try:
            # export prints the whole graph when it gives up; the reason is kept, the print is not
            with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
                gm, params = fn(module, args, kwargs)
            return Graph(name, path, gm, method, params, {"args": args, **kwargs}, "; ".join(errors))
        except Exception as exc:  # model code we do not own; the reason is kept for the spec
            errors.append(f"{method}: {one_line(exc)}")
    return Graph(name, path, None, "failed", {}, {"args": args, **kwargs}, "; ".join(errors))


class _Passthrough(nn.Module):
    """Stands in for a decoder layer when capturing embedding + head: returns its input unchanged."""

    def __init__(self, returns: int, original: nn.Module):
        super().__init__()
        self.returns = returns  # 0: a plain tensor; n: a tuple of n (extras, such as DSA picks, are None)
        # models read plain attributes of their layers (layer_type, attention_type, ...), set on the instance or
        # on its class: keep them
        classes = [c for c in type(original).__mro__ if c not in nn.Module.__mro__]
        for namespace in [vars(c) for c in reversed(classes)] + [vars(original)]:  # the instance's win
            for key, value in namespace.items():
                if (not key.startswith("_") and key != "training"
                        and isinstance(value, (bool, int, float, str, type(None)))):
                    setattr(self, key, value)

    def forward(self, hidden_states, *args, **kwargs):
        return (hidden_states,) + (None,) * (self.returns - 1) if self.returns else hidden_states


def _capture_head(twin: Twin, stack: nn.ModuleList, layer_returns: int) -> Graph:
    original = list(stack)
    try:
        for i in range(len(stack)):
            stack[i] = _Passthrough(layer_returns, original[i])
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
    for i in first_of.values():
        args, kwargs = recorded[i]
        layers[i] = capture_module(f"layer {i}", f"{twin.layers_path}.{i}", stack[i], args, kwargs)
    with torch.no_grad():
        args, kwargs = recorded[0]
        out = stack[0](*args, **kwargs)
        returns = len(out) if isinstance(out, tuple) else 0
    head = _capture_head(twin, stack, returns)
    return Capture(layers, head, first_of)
