"""The import rules of ARCHITECTURE.md, read from the source: runtime and predictors never import onboard,
runtime never imports predictors, nothing imports cli, no import cycles, and no module imports another's
underscore names. Imports inside functions count as much as those at the top of a file."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("onboard", "runtime", "predictors")


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources(*tops: str) -> dict[str, Path]:
    """{module name: file} for the project's packages (templates excluded: not Python until rendered)."""
    out = {}
    for top in tops:
        base = ROOT / top
        files = [base] if base.suffix == ".py" else sorted(base.rglob("*.py"))
        for path in files:
            out[_module_name(path)] = path
    return out


def _imports(path: Path, root: Path = ROOT) -> list[tuple[str, list[str], int]]:
    """(module, names imported from it, line) for every import statement in a file, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    name = _module_name(path, root)
    package = name.rsplit(".", 1)[0] if path.name != "__init__.py" else name
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            out.append((module, [alias.name for alias in node.names], node.lineno))
    return out


PROJECT = _sources(*PACKAGES, "cli.py")


def _edges() -> dict[str, set[str]]:
    """Module -> project modules it imports (a name that is itself a module counts as that module)."""
    graph: dict[str, set[str]] = {name: set() for name in PROJECT}
    for name, path in PROJECT.items():
        for module, names, _ in _imports(path):
            if module not in PROJECT:
                continue
            targets = {f"{module}.{n}" for n in names if f"{module}.{n}" in PROJECT}
            if not targets or len(targets) < len(names):
                targets.add(module)
            graph[name] |= targets - {name}
    return graph


@pytest.mark.parametrize("package, forbidden", [("runtime", ("onboard", "predictors", "cli")),
                                                ("predictors", ("onboard", "cli")),
                                                ("onboard", ("cli",))])
def test_layers_import_downward_only(package, forbidden):
    bad = [f"{path.relative_to(ROOT)}:{line} imports {module}"
           for name, path in PROJECT.items() if name.split(".")[0] == package
           for module, _, line in _imports(path) if module.split(".")[0] in forbidden]
    assert not bad, bad


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of a module graph: its strongly connected components of more than one module."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node):  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_no_import_cycles():
    cycles = _cycles(_edges())
    assert not cycles, cycles


def test_no_module_imports_another_modules_underscore_names():
    """Across the whole repository, tests and benchmarks included (`from __future__` aside)."""
    files = {**PROJECT, **_sources("tests", "bench")}
    bad = [f"{path.relative_to(ROOT)}:{line} imports {module}.{name}"
           for path in files.values() for module, names, line in _imports(path) if module != "__future__"
           for name in names if name.startswith("_")]
    bad += [f"{path.relative_to(ROOT)}:{line} imports {module}"
            for path in files.values() for module, names, line in _imports(path)
            if not names and any(part.startswith("_") and part != "__future__" for part in module.split("."))]
    assert not bad, bad


def test_the_checks_see_a_planted_violation(tmp_path):
    """The reader finds what the rules forbid: a cycle, an upward import and an underscore import."""
    planted = tmp_path / "runtime"
    planted.mkdir()
    (planted / "a.py").write_text("def f():\n    from onboard.spec import _private\n    from . import b\n")
    assert _imports(planted / "a.py", tmp_path) == [("onboard.spec", ["_private"], 2), ("runtime", ["b"], 3)]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
