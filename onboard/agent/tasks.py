"""The leftovers of an adapt, as tasks for the agent: one per module path below a decoder layer.

A module no pattern recognises shows up once per captured twin layer (`model.layers.0.attn_hc`,
`model.layers.3.attn_hc`, ...); the task is the layer's child that holds it (`attn_hc`; `input_layernorm` for
`input_layernorm.mlp.fc1`, the gate inside a norm; `mlps.1` for `mlps.1.up_proj`), with the twin layers it
was seen in and the full model's layers those stand for (`Layer.twin_layer`). An MoE block the runtime takes
only the experts of (its routing is one the runtime does not compute, or verification refused the runtime's
reading of it) leaves its routing module as a task: the block's child that holds parameters and is neither
the experts nor a shared expert (`mlp.router`, `mlp.gate`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from onboard.adapt.decision import EXPERTS, Decision
from onboard.inspect.spec import ModelSpec


@dataclass(frozen=True)
class Task:
    path: str  # below a decoder layer
    module_class: str
    twin_layers: tuple[int, ...]
    layers: tuple[int, ...]  # the full model's layers with this module
    why: str  # why it was left over

    @property
    def name(self) -> str:
        """A file name for its generated code."""
        return re.sub(r"\W", "_", self.path)

    @property
    def target(self) -> str:
        return f"generated:{self.path}"


def _root(path: str, layer) -> str:
    """The module a task replaces: the layer's child holding `path` (its entry, for a list of modules), so the
    projections of one small MLP or the gate inside a norm are one task; `path` itself when that child holds
    the layer's attention or MLP, which the runtime's own swaps own."""
    parts = path.split(".")
    root = ".".join(parts[:2]) if len(parts) > 1 and parts[1].isdigit() else parts[0]
    owned = [p for p in (layer.attention.path, layer.mlp.path) if p] if layer is not None else []
    if any(root == p or p.startswith(root + ".") or root.startswith(p + ".") for p in owned):
        return path
    return root


def _routers(spec: ModelSpec, model, decision: Decision) -> dict[str, dict]:
    """{path: task fields} of the routing modules of blocks whose experts alone the runtime takes."""
    found = {}
    for entry in decision.moe:
        if entry.takes != EXPERTS:
            continue
        twin_layers = sorted({layer.twin_layer for layer in spec.layers if layer.index in entry.layers})
        block = model.get_submodule(f"{spec.layers_path}.{twin_layers[0]}.{entry.block}")
        owned = [entry.experts.path, *entry.shared, (entry.shared_gate_weight or "").rpartition(".")[0]]
        for name, child in block.named_children():
            path = f"{entry.block}.{name}"
            if any(p and (path == p or p.startswith(path + ".")) for p in owned) or next(child.parameters(), None) is None:
                continue
            found[path] = {"twin_layers": twin_layers, "why": f"the runtime takes the experts only: {entry.why}"}
    return found


def leftovers(spec: ModelSpec, model, decision: Decision | None = None) -> list[Task]:
    """The unmatched modules below decoder layers of `model` (the twin), and the routing modules of blocks
    `decision` takes the experts of alone, in path order."""
    prefix = f"{spec.layers_path}."
    seen: dict[str, dict] = {}
    for unmatched in spec.unmatched:
        if not unmatched.path.startswith(prefix):
            continue
        index, _, path = unmatched.path[len(prefix):].partition(".")
        if not path or not index.isdigit():
            continue  # a whole layer no pattern reads: not one module to replace
        path = _root(path, next((layer for layer in spec.layers if layer.twin_layer == int(index)), None))
        entry = seen.setdefault(path, {"twin_layers": [], "why": unmatched.reason})
        entry["twin_layers"].append(int(index))
    if decision is not None:
        seen.update(_routers(spec, model, decision))
    tasks = []
    for path, entry in sorted(seen.items()):
        twin_layers = tuple(sorted(set(entry["twin_layers"])))
        module = model.get_submodule(f"{spec.layers_path}.{twin_layers[0]}.{path}")
        layers = tuple(layer.index for layer in spec.layers if layer.twin_layer in twin_layers)
        tasks.append(Task(path, type(module).__name__, twin_layers, layers, entry["why"]))
    return tasks
