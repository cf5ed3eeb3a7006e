"""Read-only queries over a captured ATen graph: ops, module paths, parameters, shapes, data flow."""

from __future__ import annotations

from collections import deque
from functools import cached_property

import torch

from onboard.inspect.capture import Graph

# Ops that move or relabel data without computing: data flow is followed through them.
TRANSPARENT = {
    "to", "view", "reshape", "_reshape_alias", "transpose", "t", "contiguous", "unsqueeze", "squeeze", "expand",
    "clone", "permute", "type_as", "_to_copy", "alias", "detach", "flatten", "unflatten", "getitem",
    "_assert_tensor_metadata", "lift_fresh_copy", "repeat_interleave", "select", "_unsafe_view",
    "float", "double", "half", "bfloat16", "type", "view_as", "reshape_as", "expand_as", "T", "mT",
}


# Python operator spellings (from eager recordings) -> ATen names
_ALIASES = {"truediv": "div", "rtruediv": "div", "radd": "add", "rmul": "mul", "rsub": "sub", "iadd": "add",
            "imul": "mul", "isub": "sub", "itruediv": "div", "neg": "neg", "invert": "bitwise_not",
            "and": "bitwise_and", "or": "bitwise_or", "rpow": "pow", "floordiv": "floor_divide"}


def op_name(node) -> str:
    if node.op != "call_function":
        return node.op
    target = node.target
    name = getattr(target, "_opname", None) or getattr(target, "__name__", str(target))
    name = name.split(".")[0]
    if name in ("getitem", "__getitem__"):
        return "getitem"
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
    name = name.rstrip("_") if not name.startswith("_") else "_" + name.strip("_")
    return _ALIASES.get(name, name)


class GraphView:
    """A captured graph with the lookups pattern matchers need."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.nodes = graph.nodes
        self.param_of = {name: path for name, path in graph.params.items()}
        self.index = {n: i for i, n in enumerate(self.nodes)}

    # -- per node ---------------------------------------------------------------------------------
    @staticmethod
    def path(node) -> str:
        stack = node.meta.get("nn_module_stack") or {}
        if not stack:
            return ""
        value = list(stack.values())[-1]
        path = value[0] if isinstance(value, tuple) else str(value)
        return _clean_path(path)

    @staticmethod
    def shape(node) -> tuple | None:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            # data-dependent sizes (unbacked symbols) have no value; -1 stands for "unknown"
            return tuple(s if isinstance(s, int) else _concrete(s) for s in val.shape)
        return None

    def param(self, node) -> str | None:
        """The parameter or buffer a node reads, following transparent ops back to a placeholder."""
        seen = 0
        while node is not None and seen < 16:
            if node.op == "placeholder":
                return self.param_of.get(node.name)
            if node.op == "get_attr":
                return str(node.target)
            if op_name(node) not in TRANSPARENT:
                return None
            node = next((a for a in node.args if hasattr(a, "op")), None)
            seen += 1
        return None

    def source(self, node):
        """Follow data-movement ops back to the op (or input) that computed this tensor."""
        while node is not None and op_name(node) in TRANSPARENT:
            node = next(iter(self.inputs(node)), None)
        return node

    @staticmethod
    def inputs(node) -> list:
        out = []
        for arg in node.args:
            if hasattr(arg, "op"):
                out.append(arg)
            elif isinstance(arg, (list, tuple)):
                out.extend(a for a in arg if hasattr(a, "op"))
        for arg in node.kwargs.values():
            if hasattr(arg, "op"):
                out.append(arg)
        return out

    @staticmethod
    def arg(node, index: int, name: str, default=None):
        """A call's argument by position or keyword (eager recordings keep the caller's spelling)."""
        if len(node.args) > index:
            return node.args[index]
        return node.kwargs.get(name, default)

    @staticmethod
    def topk_k(node) -> int:
        return int(GraphView.arg(node, 1, "k"))

    @staticmethod
    def scalars(node) -> list:
        return [a for a in node.args if isinstance(a, (int, float)) and not isinstance(a, bool)]

    @cached_property
    def hidden_size(self) -> int | None:
        """Width of the hidden state entering the captured module (its first non-parameter input)."""
        for n in self.nodes:
            if n.op == "placeholder" and n.name not in self.param_of and self.shape(n):
                return self.shape(n)[-1]
        return None

    # -- sets -------------------------------------------------------------------------------------
    def under(self, prefix: str) -> list:
        """Nodes computed inside the module at `prefix` (the whole layer for "")."""
        if not prefix:
            return [n for n in self.nodes if n.op == "call_function"]
        return [n for n in self.nodes if n.op == "call_function" and within(self.path(n), prefix)]

    def ops(self, nodes, *names) -> list:
        return [n for n in nodes if op_name(n) in names]

    @cached_property
    def param_shapes(self) -> dict[str, tuple]:
        out = {}
        for n in self.nodes:
            if n.op == "placeholder" and n.name in self.param_of:
                out[self.param_of[n.name]] = self.shape(n)
        return out

    def params_under(self, prefix: str) -> dict[str, tuple]:
        return {p: s for p, s in self.param_shapes.items() if within(p.rsplit(".", 1)[0] if "." in p else "", prefix)
                or (prefix and p.startswith(prefix + "."))}

    def descendants(self, start, limit: int = 100000) -> set:
        seen, queue = set(), deque([start] if not isinstance(start, (list, set, tuple)) else list(start))
        while queue and len(seen) < limit:
            node = queue.popleft()
            for user in node.users:
                if user not in seen:
                    seen.add(user)
                    queue.append(user)
        return seen

    def ancestors(self, start) -> set:
        seen, queue = set(), deque([start] if not isinstance(start, (list, set, tuple)) else list(start))
        while queue:
            node = queue.popleft()
            for arg in self.inputs(node):
                if arg not in seen:
                    seen.add(arg)
                    queue.append(arg)
        return seen

    def between(self, source, sink) -> set:
        return self.descendants(source) & self.ancestors(sink)

    def linear_weight(self, node) -> str | None:
        """For a matmul-like node, the 2-D parameter it multiplies by (the projection's weight)."""
        if op_name(node) not in ("linear", "mm", "addmm", "matmul", "bmm"):
            return None
        for arg in self.inputs(node):
            p = self.param(arg)
            if p is not None and len(self.param_shapes.get(p) or ()) == 2:
                return p
        return None


def _concrete(size) -> int:
    try:
        return int(size)
    except Exception:
        return -1


def within(path: str, prefix: str) -> bool:
    """Is the module at `path` the one at `prefix` or below it (``mlp.experts`` is within ``mlp``,
    ``mlp_norm`` is not)?"""
    return path == prefix or path.startswith(prefix + ".")


def _clean_path(path: str) -> str:
    # export writes "L['self'].mlp.gate" style paths in some versions; keep the attribute path only
    for junk in ("L['self'].", "L__self__.", "self."):
        if path.startswith(junk):
            path = path[len(junk):]
    return path.replace("_modules['", "").replace("']", "")


def parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def common_prefix(paths) -> str:
    split = [p.split(".") if p else [] for p in paths]
    if not split:
        return ""
    out = []
    for parts in zip(*split):
        if all(x == parts[0] for x in parts):
            out.append(parts[0])
        else:
            break
    return ".".join(out)
