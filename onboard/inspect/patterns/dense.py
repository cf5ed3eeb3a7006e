"""Dense MLPs and norms, recognised from projections and ops rather than names."""

from __future__ import annotations

from dataclasses import dataclass

from onboard.inspect.graph import GraphView, op_name, parent, within
from onboard.inspect.patterns.moe import find_activation


@dataclass
class DenseMatch:
    path: str
    ffn: int
    activation: str | None
    gated: bool | None


def match_dense_mlp(view: GraphView, exclude: list[str], hidden: int) -> DenseMatch | None:
    """The channel mixer: a module of >= 2 projections that widens from hidden and comes back to it."""
    owners: dict[str, list[str]] = {}
    for p, shape in view.param_shapes.items():
        if shape is None or len(shape) != 2 or any(p.startswith(x + ".") for x in exclude if x):
            continue
        owners.setdefault(parent(parent(p)), []).append(p)
    best = None
    for owner, params in owners.items():
        if not owner:
            continue
        outs = {view.param_shapes[p][0] for p in params}
        ins = {view.param_shapes[p][1] for p in params}
        if hidden not in outs or hidden not in ins:
            continue
        inner = [view.param_shapes[p][1] for p in params if view.param_shapes[p][0] == hidden]
        if not inner or min(inner) == hidden and len(params) < 2:
            continue
        nodes = view.under(owner)
        if any(op_name(n) in ("scaled_dot_product_attention", "softmax", "_softmax", "conv1d") for n in nodes):
            continue
        activation, gated = find_activation(view, nodes)
        if activation is None:
            continue
        match = DenseMatch(owner, max(inner), activation, gated)
        if best is None or len(params) > len(owners[best.path]):
            best = match
    return best


def norm_kinds(view: GraphView, exclude: list[str]) -> dict[str, str]:
    """Norm modules applied to the residual stream: rmsnorm (mean of squares) or layernorm (mean removed)."""
    kinds: dict[str, str] = {}
    for n in view.under(""):
        path = view.path(n)
        if not path or any(within(path, x) for x in exclude if x):
            continue
        name = op_name(n)
        if name in ("native_layer_norm", "layer_norm"):
            kinds[path] = "layernorm"
        elif name == "rsqrt" and path not in kinds:
            kinds[path] = "rmsnorm"
        elif name == "rms_norm":
            kinds[path] = "rmsnorm"
    return kinds
