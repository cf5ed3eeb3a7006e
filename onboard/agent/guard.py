"""What candidate code may contain, checked on its syntax tree before anything imports or runs it: a guard by
capability, not by name.

    problems = check(source, state)     # [] or one line each: "line 12: reach-through: torch.os is not ..."

`state` is the dotted names of the parameters, buffers and settings of the module the candidate replaces (what
`runtime.generated.Generated` gives it as `self.<name>`). A candidate is a file of imports, constants and one
`class Replacement(Generated)` whose methods compute with tensors. Every name it uses must be one of its own
(parameters, locals, constants, methods), an entry of the allow-list (`onboard.agent.capabilities`: curated
torch and torch.nn.functional functions, math, the runtime API, a few builtins), or an attribute on a value it
holds that the list allows (tensor methods, dtype / device / finfo fields). What the allow-list does not
name cannot be reached, whatever path leads there: `torch.os`, `torch.sys.modules[...]`, `runtime.generated.
importlib`, a generator's frame, a class's `forward`, `type(x)`, `super()`, a dunder. Each refusal names the
class of attack it stops:

- reach-through: a name, attribute or import off the list; a module, class or part of the module used as a
  value; `self.<name>` that is not the module's state or the class's own method;
- fallback: `try` / `except`, and any context manager but `torch.enable_grad` / `torch.autocast` (one that
  swallows an error is a fallback no `try` shows; `no_grad` turns the gradients it must carry off);
- judge tampering: assigning to an attribute or into the module's state, rebinding `self` or an import,
  `global` / `nonlocal`, a default argument or constant that is not immutable: a candidate changes its own
  locals only, and keeps nothing from one call to the next (a call counter would let it be right while it is
  judged and wrong later);
- import-time code: any module-level statement but imports, constants and the class; decorators, metaclasses,
  `__init__` or other dunder methods, and methods that override `nn.Module`'s own.
"""

from __future__ import annotations

import ast
import functools
import inspect
import math
from collections.abc import Iterable

from torch import nn

from onboard.agent import capabilities as cap

CLASS_NAME = "Replacement"
BASE = "runtime.generated.Generated"
REACH, FALLBACK, TAMPER, IMPORT_TIME = "reach-through", "fallback", "judge tampering", "import-time code"
FIRST_ARGUMENT = ("self", "input", "tensor")  # the names torch gives the tensor an in-place function writes
MAX_SOURCE = 200_000  # characters: a candidate is one small module
RESERVED = frozenset(n for n in dir(nn.Module) if not n.startswith("_")) - {"forward"}  # nn.Module's own methods
MODULE_NAMES = frozenset(dir(nn.Module)) | {"training", "forward", "state", "settings"}  # what a constant may not shadow
# tensor methods whose result may share the receiver's storage (a view, or the tensor itself when nothing changes)
SAME_STORAGE = frozenset("""
view view_as reshape reshape_as t transpose permute flatten unflatten squeeze unsqueeze expand expand_as narrow
select diagonal unfold chunk split tensor_split unbind movedim moveaxis swapaxes swapdims detach real contiguous
to type type_as float double half bfloat16 int long bool byte char short values indices
""".split())
SAME_STORAGE |= {"ravel", "broadcast_to", "as_strided", "view_as_real", "view_as_complex", "alias", "hsplit",
                 "vsplit", "dsplit", "split_with_sizes", "imag", "expand_copy"}
# builtins that hand back (some of) what they are given: a container or an iterator of the module's state is state
PASS_THROUGH = frozenset("zip enumerate iter next list tuple sorted reversed max min dict filter map sum".split())
# functions that may hand back any tensor argument itself or a view of it (dropout in evaluation mode)
ANY_ARGUMENT = frozenset("einsum broadcast_tensors dropout dropout1d dropout2d dropout3d alpha_dropout "
                         "feature_alpha_dropout atleast_1d atleast_2d atleast_3d".split())
# keywords that make a function write into its tensor argument though its name does not end in _
WRITING_KEYWORDS = {"inplace": "inplace=True", "max_norm": "max_norm= (F.embedding renormalises its weight in place)"}
FUTURE = "__future__.annotations"
# names that run code or reach past the tensor API, refused wherever they appear
FORBIDDEN = frozenset("""
exec eval compile getattr setattr delattr hasattr globals locals vars open __import__ breakpoint input
memoryview __builtins__ __loader__ __spec__ builtins importlib
""".split())


def _math_entry(path: str) -> bool:
    name = path.removeprefix("math.")
    return path.startswith("math.") and "." not in name and not name.startswith("_") and hasattr(math, name)


def is_entry(path: str) -> bool:
    """Whether the dotted `path` names something a candidate may call or read (`capabilities`)."""
    return path in cap.ENTRIES or _math_entry(path)


def _chain(node: ast.AST) -> tuple[ast.AST, list[str]]:
    """(root, [attr, ...]) of an attribute chain a.b.c."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return node, attrs[::-1]


def _prefixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


class _Checker:
    def __init__(self, state: Iterable[str]):
        self.leaves = set(state)
        self.containers = {p for name in self.leaves for p in _prefixes(name)}
        self.problems: list[str] = []
        self.modules: dict[str, str] = {}  # bound name -> module path
        self.entries: dict[str, str] = {}  # bound name -> entry path
        self.constants: set[str] = set()
        self.methods: set[str] = set()
        self.method_nodes: dict[str, ast.FunctionDef] = {}
        self.open_functions: set = set()  # the candidate's functions being read for what they return (recursion)
        self.class_constants: set[str] = set()

    def refuse(self, node: ast.AST, kind: str, what: str) -> None:
        self.problems.append(f"line {getattr(node, 'lineno', 0)}: {kind}: {what}")

    # --- module level -------------------------------------------------------------------------------------

    def module(self, tree: ast.Module) -> None:
        classes = 0
        for index, node in enumerate(tree.body):
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and index == 0:
                continue  # the docstring
            if isinstance(node, ast.Import | ast.ImportFrom):
                self.import_(node)
            elif isinstance(node, ast.AnnAssign):
                self.refuse(node, IMPORT_TIME, "an annotated assignment: its annotation runs at import (write NAME = "
                                               "constant)")
            elif isinstance(node, ast.Assign):
                self.constant(node, self.constants)
            elif isinstance(node, ast.ClassDef) and node.name == CLASS_NAME and not classes:
                classes += 1
                self.class_(node)
            else:
                what = {ast.ClassDef: f"class {getattr(node, 'name', '')}: only one class, {CLASS_NAME}",
                        ast.FunctionDef: "a module-level function: write helpers as methods of the class"}.get(
                    type(node), f"{type(node).__name__} at module level runs when the file is imported")
                self.refuse(node, IMPORT_TIME, what + " (only imports, constants and the class)")
        if not classes:
            self.refuse(tree, IMPORT_TIME, f"no class {CLASS_NAME}(Generated) at module level")

    def import_(self, node: ast.Import | ast.ImportFrom) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name not in cap.MODULES:
                    self.refuse(node, REACH, f"import of {alias.name}: only torch, math and runtime modules "
                                             f"({', '.join(sorted(cap.MODULES))})")
                elif alias.asname:
                    self.bind(node, alias.asname, module=alias.name)
                else:
                    root = alias.name.split(".")[0]
                    self.bind(node, root, module=root)
            return
        module = node.module or ""
        if node.level or module == "__future__":
            if node.level or any(f"__future__.{a.name}" != FUTURE for a in node.names):
                self.refuse(node, REACH, f"import from {'.' * node.level}{module}: only torch, math and runtime")
            return
        for alias in node.names:
            full = f"{module}.{alias.name}"
            name = alias.asname or alias.name
            if alias.name == "*":
                self.refuse(node, REACH, f"from {module} import *: name what you use")
            elif module in cap.MODULES and full in cap.MODULES:
                self.bind(node, name, module=full)
            elif module in cap.MODULES and is_entry(full):
                self.bind(node, name, entry=full)
            else:
                self.refuse(node, REACH, f"import of {full}: not on the allow-list (show_runtime_api lists it)")

    def bind(self, node: ast.AST, name: str, *, module: str = "", entry: str = "") -> None:
        if name.startswith("__"):
            self.refuse(node, REACH, f"the name {name}")
        elif module:
            self.modules[name] = module
        else:
            self.entries[name] = entry

    def constant(self, node: ast.Assign | ast.AnnAssign, into: set[str]) -> None:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if not all(isinstance(t, ast.Name) and not t.id.startswith("_") for t in targets):
            self.refuse(node, IMPORT_TIME, "an assignment at module or class level that is not NAME = constant")
            return
        if node.value is None or not self.constant_expression(node.value):
            self.refuse(node, IMPORT_TIME, "a constant that is not an immutable literal (a call runs at import; a list "
                                           "or dict is state that outlives a call)")
            return
        into.update(t.id for t in targets)

    def constant_expression(self, node: ast.AST) -> bool:
        """Immutable and computed without a call: a literal, a tuple of them, arithmetic on them, an earlier
        constant or an entry (math.pi). A list or a dict would be state that outlives a call."""
        if isinstance(node, ast.Constant):
            return True
        if isinstance(node, ast.Tuple):
            return all(self.constant_expression(e) for e in node.elts)
        if isinstance(node, ast.UnaryOp):
            return self.constant_expression(node.operand)
        if isinstance(node, ast.BinOp):
            return self.constant_expression(node.left) and self.constant_expression(node.right)
        if isinstance(node, ast.Name):
            return node.id in self.constants
        if isinstance(node, ast.Attribute):  # math.pi, torch.float32
            root, attrs = _chain(node)
            return (isinstance(root, ast.Name) and root.id in self.modules
                    and is_entry(".".join([self.modules[root.id], *attrs])))
        return False

    def class_(self, node: ast.ClassDef) -> None:
        if node.decorator_list or node.keywords:
            self.refuse(node, IMPORT_TIME, "a class decorator or keyword (metaclass): runs at import")
        if len(node.bases) != 1 or self.resolve_entry(node.bases[0]) != BASE:
            self.refuse(node, REACH, f"{CLASS_NAME} must derive from runtime.generated.Generated alone")
        methods = []
        for index, item in enumerate(node.body):
            if isinstance(item, ast.Expr) and isinstance(item.value, ast.Constant) and index == 0:
                continue
            if isinstance(item, ast.AnnAssign):
                self.refuse(item, IMPORT_TIME, "an annotated assignment in the class body: its annotation runs when "
                                               "the class is made (write NAME = constant)")
            elif isinstance(item, ast.Assign):
                shadowed = [t.id for t in item.targets if isinstance(t, ast.Name) and t.id in MODULE_NAMES]
                if shadowed:
                    self.refuse(item, REACH, f"class constant {shadowed[0]} shadows nn.Module's or Generated's own")
                self.constant(item, self.class_constants)
            elif isinstance(item, ast.FunctionDef):
                if item.name.startswith("_"):
                    self.refuse(item, IMPORT_TIME, f"method {item.name}: dunder and private methods (__init__, "
                                                   "__getattr__, ...) change how the module is built or called")
                elif item.name in RESERVED:
                    self.refuse(item, REACH, f"method {item.name} overrides nn.Module's own")
                elif item.decorator_list:
                    self.refuse(item, IMPORT_TIME, f"a decorator on {item.name}: runs at import")
                else:
                    methods.append(item)
                    self.methods.add(item.name)
                    self.method_nodes[item.name] = item
            else:
                self.refuse(item, IMPORT_TIME, f"{type(item).__name__} in the class body: only methods and constants")
        if "forward" not in self.methods:
            self.refuse(node, IMPORT_TIME, f"{CLASS_NAME} has no forward method")
        for method in methods:
            _Method(self, method).check()

    def resolve_path(self, node: ast.AST) -> str:
        """The dotted path a Name or attribute chain of imported names stands for ("" when none)."""
        root, attrs = _chain(node)
        if not isinstance(root, ast.Name):
            return ""
        if root.id in self.entries and not attrs:
            return self.entries[root.id]
        if root.id in self.modules:
            return ".".join([self.modules[root.id], *attrs])
        return ""

    def resolve_entry(self, node: ast.AST) -> str:
        """The entry a Name or attribute chain of imported names resolves to ("" when none)."""
        path = self.resolve_path(node)
        return path if is_entry(path) else ""


@functools.lru_cache(maxsize=None)
def _writing_positions(path: str) -> dict[str, int]:
    """Where a torch or torch.nn.functional function written in Python takes a parameter that makes it write into
    a tensor it is given (`inplace`, `out`, `max_norm`): {name: position}."""
    module, _, name = path.rpartition(".")
    if module not in ("torch", "torch.nn.functional"):
        return {}
    import torch
    import torch.nn.functional as F

    try:
        params = list(inspect.signature(getattr(F if module.endswith("functional") else torch, name)).parameters)
    except (AttributeError, TypeError, ValueError):
        return {}
    return {p: params.index(p) for p in ("inplace", "out", "max_norm") if p in params}


def _parameters(function: ast.FunctionDef | ast.Lambda) -> set[str]:
    """The names a function's parameters bind, self aside."""
    a = function.args
    return {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x} - {"self"}


def _off(value: ast.AST) -> bool:
    """A writing parameter given as False or None: it writes nothing."""
    return isinstance(value, ast.Constant) and value.value in (False, None)


class _Method:
    """One method of the class (nested functions and lambdas with it): its names, and each expression."""

    def __init__(self, checker: _Checker, node: ast.FunctionDef):
        self.c, self.node = checker, node
        self.parents = {child: parent for parent in ast.walk(node) for child in ast.iter_child_nodes(parent)}
        self.bound: set[str] = set()
        self.aliases: dict[str, str] = {}  # local name -> the part of the module it names (mlp = self.router_mlp)
        self.functions: dict = {}  # a local name -> the lambdas and nested functions bound to it
        for child in ast.walk(node):
            if isinstance(child, ast.FunctionDef) and child is not node:
                self.functions.setdefault(child.name, []).append(child)
            elif (isinstance(child, ast.Assign) and len(child.targets) == 1 and isinstance(child.targets[0], ast.Name)
                  and isinstance(child.value, ast.Lambda)):
                self.functions.setdefault(child.targets[0].id, []).append(child.value)

    def check(self) -> None:
        c, node = self.c, self.node
        for child in ast.walk(node):  # defaults live as long as the class: a mutable one would count calls
            if isinstance(child, ast.FunctionDef | ast.Lambda):
                for default in [*child.args.defaults, *(d for d in child.args.kw_defaults if d is not None)]:
                    if not c.constant_expression(default):
                        c.refuse(default, TAMPER, "a default that is not a constant (a list, a tensor, a call): "
                                                  "state that outlives a call")
        args = node.args
        positional = args.posonlyargs + args.args
        if not positional or positional[0].arg != "self":
            c.refuse(node, REACH, f"method {node.name} must take self first")
        self.names()
        self.state_writes()
        for child in ast.walk(node):
            self.statement(child)
            if isinstance(child, ast.Attribute) and not isinstance(self.parents.get(child), ast.Attribute):
                self.attribute_chain(child)
            elif isinstance(child, ast.Name):
                self.name(child)
            elif isinstance(child, ast.Call):
                self.call(child)

    def names(self) -> None:
        """The method's own names, and which of them name a part of the module."""
        c, counts = self.c, {}
        for child in ast.walk(self.node):
            if isinstance(child, ast.arg):
                if child.arg == "self" and child is not (self.node.args.posonlyargs + self.node.args.args)[0]:
                    c.refuse(child, TAMPER, "a parameter called self other than the method's own")
                counts[child.arg] = counts.get(child.arg, 0) + 1
            elif isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store | ast.Del):
                if child.id == "self":
                    c.refuse(child, TAMPER, "rebinding self")
                counts[child.id] = counts.get(child.id, 0) + 1
            elif isinstance(child, ast.FunctionDef):
                counts[child.name] = counts.get(child.name, 0) + 1
        for name in counts:
            if name in c.modules or name in c.entries or name in c.constants:
                c.refuse(self.node, TAMPER, f"rebinding the imported or constant name {name}")
            if name.startswith("__"):
                c.refuse(self.node, REACH, f"the name {name}")
        self.bound = set(counts)
        for child in ast.walk(self.node):
            if (isinstance(child, ast.Assign) and len(child.targets) == 1 and isinstance(child.targets[0], ast.Name)
                    and isinstance(child.value, ast.Attribute)):
                part = self.self_path(child.value)
                if part is not None and part in c.containers:
                    name = child.targets[0].id
                    if counts[name] != 1:
                        c.refuse(child, REACH, f"{name} names a part of the module and is bound again")
                    self.aliases[name] = part

    def aliases_state(self, node: ast.AST, tainted: set[str], *, state: bool = True) -> bool:
        """Whether `node` may be (a view of) the module's state (`state`) or of a name in `tainted`: a chain from
        self, from a part of the module or from such a name, through attributes, subscripts, views in method,
        function or unbound form (`w.view(...)`, `torch.flatten(w)`, `torch.Tensor.view(w, ...)`), containers and
        what picks from them (a tuple, `x if c else y`, `a or b`, `zip`, `max`, a dict's `.get`), and calls of the
        candidate's own helpers (a lambda or method may return the state it reads)."""
        if isinstance(node, ast.Attribute | ast.Subscript | ast.Starred):
            return self.aliases_state(node.value, tainted, state=state)
        if isinstance(node, ast.Name):
            return node.id in tainted or (state and (node.id == "self" or node.id in self.aliases))
        if isinstance(node, ast.NamedExpr):
            return self.aliases_state(node.value, tainted, state=state)
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return any(self.aliases_state(e, tainted, state=state) for e in node.elts)
        if isinstance(node, ast.Dict):
            return any(self.aliases_state(v, tainted, state=state) for v in node.values)
        if isinstance(node, ast.IfExp):
            return any(self.aliases_state(e, tainted, state=state) for e in (node.body, node.orelse))
        if isinstance(node, ast.BoolOp):
            return any(self.aliases_state(e, tainted, state=state) for e in node.values)
        if isinstance(node, ast.Lambda):  # a function that returns the state it closes over is as good as it
            return self._returns_state(node, [], tainted, state)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mult) and any(
                isinstance(side, ast.List | ast.Tuple | ast.ListComp) for side in (node.left, node.right)):
            return any(self.aliases_state(side, tainted, state=state) for side in (node.left, node.right))
        if isinstance(node, ast.DictComp):
            return self.aliases_state(node.value, tainted | self._comprehension_targets(node, tainted, state),
                                      state=state)
        if isinstance(node, ast.ListComp | ast.GeneratorExp | ast.SetComp):
            return self.aliases_state(node.elt, tainted | self._comprehension_targets(node, tainted, state),
                                      state=state)
        if not isinstance(node, ast.Call):
            return False
        func, passed = node.func, [*node.args, *(k.value for k in node.keywords)]
        if isinstance(func, ast.Attribute):
            if func.attr in ANY_ARGUMENT or func.attr in ("get", "pop", "setdefault"):
                return any(self.aliases_state(x, tainted, state=state) for x in (func.value, *passed))
            if func.attr in SAME_STORAGE or func.attr in ("values", "items"):
                # w.view(...), and torch.flatten(w) / torch.Tensor.view(w, ...): the tensor first either way
                return (self.aliases_state(func.value, tainted, state=state)
                        or any(self.aliases_state(a, tainted, state=state) for a in node.args[:1]))
            # a method of the candidate's own (self.helper(...)) returns what its returns say
            own = self.c.method_nodes.get(func.attr) if isinstance(func.value, ast.Name) and func.value.id == "self" \
                else None
            return own is not None and self._returns_state(own, passed, tainted, state)
        if isinstance(func, ast.Name):
            if func.id in PASS_THROUGH:
                return any(self.aliases_state(a, tainted, state=state) for a in passed)
            locals_ = self.functions.get(func.id)
            if locals_:  # a lambda or nested function (any one bound to the name): what it returns, as called
                return any(self._returns_state(f, passed, tainted, state) for f in locals_)
            # a name bound some other way may hold any callable of the candidate's
            return func.id in self.bound and func.id not in self.c.entries and func.id not in self.c.modules
        if isinstance(func, ast.Lambda):
            return self._returns_state(func, passed, tainted, state)
        return self.aliases_state(func, tainted, state=state)  # (f())(...), g[0]()

    def _returns_state(self, function, passed: list, tainted: set[str], state: bool) -> bool:
        """Whether a call of the candidate's own `function` (a lambda, a nested function, another method) may return
        (a view of) the state: one of its returns aliases it, read where it is defined, its parameters counted
        as state where an argument passed is."""
        opened = self.c.open_functions
        if function in opened:  # recursion: no more than it already says
            return False
        params = _parameters(function)
        given = params if any(self.aliases_state(p, tainted, state=state) for p in passed) else set()
        reader = self
        if isinstance(function, ast.FunctionDef) and self.c.method_nodes.get(function.name) is function:
            reader = _Method(self.c, function)  # another method: its own names and aliases
            reader.names()
        returns = [function.body] if isinstance(function, ast.Lambda) else [
            n.value for n in ast.walk(function) if isinstance(n, ast.Return) and n.value is not None]
        opened.add(function)
        try:
            seed = reader._bound_to(function, (tainted if reader is self else set()) | given, state=state)
            return any(reader.aliases_state(r, seed, state=state) for r in returns)
        finally:
            opened.discard(function)

    def _comprehension_targets(self, node, tainted: set[str], state: bool) -> set[str]:
        names = set()
        for generator in node.generators:
            if self.aliases_state(generator.iter, tainted | names, state=state):
                names |= {n.id for n in ast.walk(generator.target) if isinstance(n, ast.Name)}
        return names

    def _bound_to(self, root: ast.AST, seed: set[str], *, state: bool) -> set[str]:
        """`seed` and the names in `root` bound to (a view of) one of them or, with `state`, of the module's state,
        through any number of rebindings."""
        tainted, changed = set(seed), True
        while changed:
            changed = False
            for child in ast.walk(root):
                targets, value = [], None
                if isinstance(child, ast.Assign):
                    targets, value = child.targets, child.value
                elif isinstance(child, ast.AnnAssign | ast.NamedExpr | ast.AugAssign):
                    targets, value = [child.target], child.value
                elif isinstance(child, ast.For | ast.comprehension):
                    targets, value = [child.target], child.iter
                if value is None or not self.aliases_state(value, tainted, state=state):
                    continue
                for target in targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name) and name.id not in tainted and name.id != "self":
                            tainted.add(name.id)
                            changed = True
        return tainted

    def _writes(self, root: ast.AST, tainted: set[str], *, state: bool, what: str) -> None:
        """Refuse, in `root`, every in-place method, in-place function (`torch.Tensor.copy_(t, ...)`), subscript
        store or augmented assignment into `what` (see `aliases_state`), and every `out=`."""
        c = self.c
        for child in ast.walk(root):
            if isinstance(child, ast.Call):
                func = child.func
                callee = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
                if callee.endswith("_"):
                    # what an in-place call writes: the tensor it is a method of, or the first argument of the
                    # unbound or function form (`torch.Tensor.copy_(t, src)`, `torch.nn.init.zeros_(t)`)
                    written = [func.value] if isinstance(func, ast.Attribute) else []
                    written += child.args[:1] + [k.value for k in child.keywords
                                                 if k.arg in FIRST_ARGUMENT or not child.args]
                    if any(self.aliases_state(w, tainted, state=state) for w in written):
                        c.refuse(child, TAMPER, f".{callee}() changes {what} in place")
                if state and any(k.arg == "out" for k in child.keywords):
                    c.refuse(child, TAMPER, "out=: write results into new values, not into existing ones")
                if state and any(k.arg is None for k in child.keywords):
                    c.refuse(child, TAMPER, "**: name a call's keywords (a dict of them can hold out=)")
                positions = _writing_positions(c.resolve_entry(func)) if state else {}
                for param, position in positions.items():
                    given = child.args[:position + 1]
                    if any(isinstance(x, ast.Starred) for x in given):
                        c.refuse(child, TAMPER, f"* before {param}: name what a writing parameter gets")
                    elif len(child.args) > position and not _off(child.args[position]):
                        c.refuse(child, TAMPER, f"{WRITING_KEYWORDS.get(param, 'out= (by position)')}: write "
                                                f"results into new values")
                for k in child.keywords:
                    if state and k.arg in WRITING_KEYWORDS and not _off(k.value):
                        c.refuse(child, TAMPER, f"{WRITING_KEYWORDS[k.arg]}: write results into new values")
            called = isinstance(self.parents.get(child), ast.Call) and self.parents[child].func is child
            if state and not called and isinstance(child, ast.Name) and child.id.endswith("_") \
                    and isinstance(child.ctx, ast.Load) and c.resolve_entry(child):
                c.refuse(child, TAMPER, f"{child.id} taken as a value: an in-place function is called where it is "
                                        f"named")
            if state and not called and isinstance(child, ast.Attribute) and child.attr.endswith("_") \
                    and not child.attr.startswith("_"):
                c.refuse(child, TAMPER, f".{child.attr} taken as a value: an in-place method is called where it is "
                                        f"named, on a tensor of the call's own")
            if (state and isinstance(child, ast.Assign | ast.NamedExpr)
                    and _writing_positions(c.resolve_entry(child.value))):
                c.refuse(child, TAMPER, f"{c.resolve_entry(child.value)} bound to a name: a function that can write "
                                        f"into its arguments is called where it is named")
            stores = []
            if isinstance(child, ast.Assign):
                stores = child.targets
            elif isinstance(child, ast.AugAssign):
                stores = [child.target]
            for target in stores:
                inner = target.value if isinstance(target, ast.Subscript) else target
                if (isinstance(target, ast.Subscript) or isinstance(child, ast.AugAssign)) and \
                        self.aliases_state(inner, tainted, state=state):
                    c.refuse(child, TAMPER, f"a store into {what} (or a view of it)")

    def state_writes(self) -> None:
        """A candidate changes its own locals only: no in-place method, subscript store, augmented assignment or
        `out=` into the module's state, whether named from self or through a local bound to a view of it
        (`w = self.p.view(torch.int32); w[0] = ...`; `w = self.p.float(); w.mul_(2)`: float() of an fp32
        tensor is the tensor itself), nor through the unbound form (`torch.Tensor.copy_(self.p, x)`). A helper
        (another method, a nested function, a lambda) changes none of its arguments in place either: a caller may
        hand it the module's state (`bump(self.p)`), and the judge sees only what forward's own inputs become."""
        self._writes(self.node, self._bound_to(self.node, set(), state=True), state=True, what="the module's state")
        helpers = [n for n in ast.walk(self.node) if isinstance(n, ast.FunctionDef | ast.Lambda) and n is not self.node]
        if self.node.name != "forward":
            helpers.append(self.node)
        for helper in helpers:
            params = _parameters(helper)
            if params:
                self._writes(helper, self._bound_to(helper, params, state=False), state=False,
                             what="an argument of a helper")

    def self_path(self, node: ast.AST) -> str | None:
        """The dotted path below self of a chain rooted at self or at an alias of a part of the module."""
        root, attrs = _chain(node)
        if not isinstance(root, ast.Name):
            return None
        if root.id == "self":
            return ".".join(attrs)
        if root.id in self.aliases:
            return ".".join([self.aliases[root.id], *attrs])
        return None

    def statement(self, node: ast.AST) -> None:
        c = self.c
        if isinstance(node, ast.Try | ast.TryStar):
            c.refuse(node, FALLBACK, "try/except: a candidate that fails must fail, not fall back")
        elif isinstance(node, ast.With):
            for item in node.items:
                expr = item.context_expr
                path = c.resolve_path(expr.func) if isinstance(expr, ast.Call) else ""
                if path not in cap.CONTEXT_MANAGERS:
                    c.refuse(node, FALLBACK, "a context manager other than torch.enable_grad / torch.autocast (one "
                                             "can swallow errors, or turn the gradients off)")
        elif isinstance(node, ast.Global | ast.Nonlocal):
            c.refuse(node, TAMPER, f"{type(node).__name__.lower()} statement")
        elif isinstance(node, ast.Import | ast.ImportFrom):
            c.refuse(node, REACH, "an import inside a method: imports are checked at module level only")
        elif isinstance(node, ast.ClassDef | ast.AsyncFunctionDef | ast.AsyncFor | ast.AsyncWith | ast.Await
                        | ast.Yield | ast.YieldFrom | ast.Match):
            c.refuse(node, REACH, f"{type(node).__name__} in a method: plain functions of tensors only")
        elif isinstance(node, ast.FunctionDef) and node is not self.node and node.decorator_list:
            c.refuse(node, IMPORT_TIME, f"a decorator on {node.name}")
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store | ast.Del):
            c.refuse(node, TAMPER, "assignment to an attribute (of a module, a tolerance, self): a candidate "
                                   "changes its own locals only")
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store | ast.Del):
            root = node.value
            while isinstance(root, ast.Subscript | ast.Attribute):
                root = root.value
            if not (isinstance(root, ast.Name) and root.id in self.bound and root.id not in self.aliases
                    and root.id != "self"):
                c.refuse(node, TAMPER, "writing into something other than a local value (the module's state)")

    def name(self, node: ast.Name) -> None:
        c, name = self.c, node.id
        if isinstance(node.ctx, ast.Store | ast.Del):
            return  # bindings are checked in names()
        parent = self.parents.get(node)
        root_of_chain = isinstance(parent, ast.Attribute) and parent.value is node
        if name.startswith("__"):
            c.refuse(node, REACH, f"the name {name}")
        elif name == "self" or name in self.aliases:
            if not root_of_chain:
                c.refuse(node, REACH, f"{name} used as a value: read its parameters, buffers and settings instead")
        elif name in self.bound or name in c.constants or name in c.entries:
            return
        elif name in c.modules:
            if not root_of_chain:
                c.refuse(node, REACH, f"the module {c.modules[name]} used as a value")
        elif name in cap.BUILTINS:
            return
        else:
            c.refuse(node, REACH, f"{name} is not on the allow-list (the capabilities are in show_runtime_api)")

    def attribute_chain(self, node: ast.Attribute) -> None:
        c = self.c
        root, attrs = _chain(node)
        private = [a for a in attrs if a.startswith("_")]
        if private:
            c.refuse(node, REACH, f"attribute .{private[0]}: private and dunder state is out of reach")
            return
        if isinstance(root, ast.Name) and (root.id == "self" or root.id in self.aliases):
            self.state_chain(node, root.id, attrs)
        elif isinstance(root, ast.Name) and root.id in c.modules:
            path = c.modules[root.id]
            for i, attr in enumerate(attrs):
                path = f"{path}.{attr}"
                if is_entry(path):
                    self.values(node, attrs[i + 1:])
                    return
                if path in cap.CONTEXT_MANAGERS and i == len(attrs) - 1 and self.manages(node):
                    return
                if path not in cap.MODULES:
                    break
            c.refuse(node, REACH, f"{path} is not a function or constant on the allow-list")
        else:
            self.values(node, attrs)

    def manages(self, node: ast.AST) -> bool:
        """Whether `node` is called as the context manager of a with statement (`with torch.enable_grad():`)."""
        call = self.parents.get(node)
        return (isinstance(call, ast.Call) and call.func is node
                and isinstance(self.parents.get(call), ast.withitem))

    def values(self, node: ast.AST, attrs: list[str]) -> None:
        bad = [a for a in attrs if a not in cap.ATTRIBUTES]
        if bad:
            self.c.refuse(node, REACH, f"attribute .{bad[0]}: not a tensor method or value attribute on the "
                                       "allow-list")

    def state_chain(self, node: ast.Attribute, root: str, attrs: list[str]) -> None:
        c = self.c
        parts = ([*self.aliases[root].split(".")] if root != "self" else []) + attrs
        if root == "self" and attrs[0] in c.methods:
            parent = self.parents.get(node)
            if len(attrs) != 1 or not (isinstance(parent, ast.Call) and parent.func is node):
                c.refuse(node, REACH, f"self.{attrs[0]}: the class's methods are called, not taken as values")
            return
        if root == "self" and (attrs[0] in c.class_constants or attrs[0] == "training"):
            self.values(node, attrs[1:])
            return
        for i in range(1, len(parts) + 1):
            path = ".".join(parts[:i])
            if path in c.leaves:
                self.values(node, parts[i:])
                return
            if path not in c.containers:
                c.refuse(node, REACH, f"self.{path} is not a parameter, buffer or setting of the module, nor a "
                                      "method of the class")
                return
        parent = self.parents.get(node)
        if not (isinstance(parent, ast.Assign) and parent.value is node and len(parent.targets) == 1
                and isinstance(parent.targets[0], ast.Name)):
            c.refuse(node, REACH, f"self.{'.'.join(parts)} is a part of the module, not a value")

    def call(self, node: ast.Call) -> None:
        func = node.func
        if self.c.resolve_path(func) == "torch.Tensor":
            self.c.refuse(node, TAMPER, "torch.Tensor(...): the legacy constructor aliases the tensor it is given or "
                                        "hands back memory nobody wrote (state from an earlier call); use "
                                        "torch.zeros or torch.tensor")
        if isinstance(func, ast.Name) and func.id in self.aliases:
            self.c.refuse(node, REACH, f"calling {func.id}, a part of the module (its forward is not yours)")


def check(source: str, state: Iterable[str] = ()) -> list[str]:
    """Everything the candidate `source` does that it may not, one line each (empty: it may run); `state`: the
    dotted names of the replaced module's parameters, buffers and settings."""
    if not isinstance(source, str) or len(source) > MAX_SOURCE:
        return [f"line 0: {IMPORT_TIME}: a candidate is a Python file of at most {MAX_SOURCE} characters"]
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        return [f"line {exc.lineno}: not Python ({exc.msg})"]
    except (RecursionError, MemoryError, ValueError):
        return ["line 0: not Python the guard can read (nested too deeply, or null bytes)"]
    checker = _Checker(state)
    try:
        checker.module(tree)
        checker.problems += _scope_problems(tree, source, checker)
    except RecursionError:
        return ["line 0: nested too deeply for the guard to read"]
    return list(dict.fromkeys(checker.problems))


def _scope_problems(tree: ast.Module, source: str, checker: _Checker) -> list[str]:
    """Every name as Python resolves it (`symtable`), scope by scope: a name that is global where it is read is a
    module-level import or constant, the class, or a builtin on the allow-list, whatever binds the same name in
    another scope (a lambda's parameter, a comprehension's variable, an inner function's argument). And none of
    the names that run or reach code (`FORBIDDEN`) in any form: a name, an attribute, an import, an argument."""
    import symtable

    problems = []
    for node in ast.walk(tree):
        words = []
        if isinstance(node, ast.Name):
            words = [node.id]
        elif isinstance(node, ast.Attribute):
            words = [node.attr]
        elif isinstance(node, ast.alias):
            words = [*node.name.split("."), node.asname or ""]
        elif isinstance(node, ast.arg):
            words = [node.arg]
        elif isinstance(node, ast.keyword):
            words = [node.arg or ""]
        elif isinstance(node, ast.FunctionDef):
            words = [node.name]
        for word in words:
            if word in FORBIDDEN:
                problems.append(f"line {getattr(node, 'lineno', 0)}: {REACH}: {word}, in any form, runs or reaches "
                                "code outside the tensor computation")
    try:
        top = symtable.symtable(source, "<candidate>", "exec")
    except (SyntaxError, ValueError) as exc:
        return problems + [f"line 0: {REACH}: the guard could not read the file's scopes ({exc})"]
    module_names = set(checker.modules) | set(checker.entries) | checker.constants | {CLASS_NAME}
    tables = [top]
    while tables:
        table = tables.pop()
        tables.extend(table.get_children())
        if table.get_type() == "module":
            continue  # its names are the imports and constants the module-level check read
        for symbol in table.get_symbols():
            name = symbol.get_name()
            if not symbol.is_referenced() or not (symbol.is_global() or symbol.is_declared_global()):
                continue
            if name in module_names or name in cap.BUILTINS:
                continue
            problems.append(f"line {table.get_lineno()}: {REACH}: {name} is global where it is read (in "
                            f"{table.get_name()}) and not an import, a constant or an allowed builtin")
    return problems
