"""What candidate code may contain, checked on its syntax tree before anything imports or runs it.

    problems = check(source)          # [] or one line each: "line 12: try/except: ..."

A candidate is a file that imports from torch, math and runtime only and defines `class Replacement(Generated)`
with a `forward` and helper methods. Refused, whatever a policy (or a model's reply) says:
- other imports (os, sys, subprocess, socket, inspect, transformers, ...), `__import__`, `importlib`;
- `try` / `except`: a candidate that fails must fail, not fall back to something else;
- eval, exec, compile, open, breakpoint, globals, locals, vars, getattr / setattr / delattr, and any
  dunder attribute (`__class__`, `__dict__`, `__globals__`, ...): the ways back to the original module, its
  class, the caller's frame or the file system;
- frame and code introspection (`f_back`, `f_globals`, `gi_frame`, `_getframe`, ...), and torch's own file
  and extension loaders (`torch.load`, `torch.save`, `torch.hub`, `load_library`, `cpp_extension`);
- an `__init__`, `global` / `nonlocal`, assignments to attributes of anything but `self` (`torch.x = ...`), and
  module-level statements other than imports, constants, functions and classes: `runtime.generated.Generated`
  builds the module from the original's state, nothing else does.
"""

from __future__ import annotations

import ast

ALLOWED_ROOTS = {"torch", "math", "runtime"}
FORBIDDEN_CALLS = {"eval", "exec", "compile", "open", "breakpoint", "globals", "locals", "vars",
                   "getattr", "setattr", "delattr", "__import__", "memoryview"}
FORBIDDEN_ATTRIBUTES = {"f_back", "f_globals", "f_locals", "f_code", "gi_frame", "cr_frame", "tb_frame",
                        "_getframe", "load", "save", "hub", "load_library", "cpp_extension", "_C", "system",
                        "forward_with_globals", "replaced"}
CLASS_NAME = "Replacement"


def _imports(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        return ["." * node.level + (node.module or "")]
    return []


def _foreign_attribute(target: ast.AST) -> bool:
    """An assignment target through an attribute of anything but `self`: torch.x = ..., probe.TOLERANCE[0] = ...
    (a local tensor's items, out[..., :n] = ..., are the candidate's own)."""
    through_attribute = False
    while isinstance(target, ast.Attribute | ast.Subscript):
        through_attribute |= isinstance(target, ast.Attribute)
        target = target.value
    return through_attribute and not (isinstance(target, ast.Name) and target.id == "self")


def check(source: str) -> list[str]:
    """Everything the candidate `source` does that it may not, one line each (empty: it may run)."""
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        return [f"line {exc.lineno}: not Python ({exc.msg})"]
    problems = []

    def refuse(node: ast.AST, what: str) -> None:
        problems.append(f"line {getattr(node, 'lineno', 0)}: {what}")

    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # a docstring
        if not isinstance(node, ast.Import | ast.ImportFrom | ast.FunctionDef | ast.ClassDef | ast.Assign
                          | ast.AnnAssign):
            refuse(node, f"{type(node).__name__} at module level: only imports, constants, functions, classes")
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == CLASS_NAME]
    if not classes:
        refuse(tree, f"no class {CLASS_NAME}(Generated) at module level")
    for node in ast.walk(tree):
        for name in _imports(node):
            if name.split(".")[0] not in ALLOWED_ROOTS:
                refuse(node, f"import of {name or 'a relative module'}: only torch, math and runtime")
        if isinstance(node, ast.Try | ast.TryStar):
            refuse(node, "try/except: a candidate that fails must fail, not fall back")
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign) and any(
                _foreign_attribute(t) for t in (node.targets if isinstance(node, ast.Assign) else [node.target])):
            refuse(node, "assignment to an attribute of something other than self (a module, a tolerance)")
        elif isinstance(node, ast.Global | ast.Nonlocal):
            refuse(node, f"{type(node).__name__.lower()} statement")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FORBIDDEN_CALLS:
            refuse(node, f"call of {node.func.id}()")
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN_CALLS and isinstance(node.ctx, ast.Load):
            refuse(node, f"use of {node.id}")
        elif isinstance(node, ast.Attribute):
            if node.attr.startswith("__") and node.attr.endswith("__"):
                refuse(node, f"dunder attribute .{node.attr}")
            elif node.attr in FORBIDDEN_ATTRIBUTES:
                refuse(node, f"attribute .{node.attr} (files, extensions, frames or the replaced module)")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == "__init__":
            refuse(node, "__init__: Generated builds the module from the original's state")
        elif isinstance(node, ast.AsyncFunctionDef):
            refuse(node, "async function")
    return list(dict.fromkeys(problems))
