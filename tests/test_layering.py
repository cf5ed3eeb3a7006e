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
    (planted / "a.py").write_text("def f():\n    from onboard.inspect.spec import _private\n    from . import b\n")
    assert _imports(planted / "a.py", tmp_path) == [("onboard.inspect.spec", ["_private"], 2), ("runtime", ["b"], 3)]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


# The stages of onboard/ in data-flow order (onboard/__init__.py): each imports only stages before it, and the
# stages at the end (review, plan, train, report) do not import one another. The agent's sandbox builds the
# reference twin and checks candidates with the agent's guard, so it is a stage of its own before the bundle.
STAGES = [("shared", ("onboard", "onboard.errors", "onboard.outputs", "onboard.contract", "onboard.user_key")),
          ("source", ("onboard.source", "onboard.catalogue")),  # the catalogue: model configs and code, as data
          ("twin", ("onboard.twin",)), ("inspect", ("onboard.inspect",)), ("adapt", ("onboard.adapt",)),
          ("sandbox", ("onboard.agent.sandbox", "onboard.agent.guard", "onboard.agent.capabilities")),
          ("bundle", ("onboard.bundle",)), ("agent", ("onboard.agent",)),
          ("review", ("onboard.review",)), ("plan", ("onboard.plan",)), ("train", ("onboard.train",)),
          ("report", ("onboard.report",))]
LAST = ("review", "plan", "train", "report")  # side by side: none imports another


def stage_of(module: str) -> str | None:
    """The stage a module belongs to: the longest prefix that names it (the agent's sandbox before the agent)."""
    best = None
    for stage, prefixes in STAGES:
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".") and prefix != "onboard") and (
                    best is None or len(prefix) > len(best[1])):
                best = (stage, prefix)
    return best[0] if best else None


def stage_violations(imports: dict[str, list[tuple[str, int]]]) -> list[str]:
    """'module:line imports module' for each import of a later stage, or of a side-by-side last stage."""
    order = {stage: i for i, (stage, _) in enumerate(STAGES)}
    bad = []
    for name, found in imports.items():
        mine = stage_of(name)
        for module, line in found:
            theirs = stage_of(module)
            if mine is None or theirs is None or theirs == mine:
                continue
            if order[theirs] > order[mine] or (mine in LAST and theirs in LAST):
                bad.append(f"{name}:{line} ({mine}) imports {module} ({theirs})")
    return bad


def test_every_onboard_module_belongs_to_a_stage():
    assert [name for name in PROJECT if name.split(".")[0] == "onboard" and stage_of(name) is None] == []


def test_stages_import_only_earlier_stages():
    def named(module, names):  # `from onboard.agent import capabilities` imports onboard.agent.capabilities
        return [f"{module}.{n}" if f"{module}.{n}" in PROJECT else module for n in names] or [module]

    imports = {name: [(target, line) for module, names, line in _imports(path) if module.startswith("onboard")
                      for target in named(module, names)]
               for name, path in PROJECT.items() if name.startswith("onboard")}
    assert stage_violations(imports) == []


def test_the_stage_rule_sees_a_planted_violation():
    """An upward import, a sideways one between the last stages, and what is allowed."""
    planted = {"onboard.twin.build": [("onboard.inspect.spec", 3), ("onboard.source", 4)],
               "onboard.train.launch": [("onboard.report.page", 7), ("onboard.bundle.files", 8)],
               "onboard.agent.sandbox.remote": [("onboard.agent.guard", 2), ("onboard.agent.loop", 9)]}
    assert stage_violations(planted) == [
        "onboard.twin.build:3 (twin) imports onboard.inspect.spec (inspect)",
        "onboard.train.launch:7 (train) imports onboard.report.page (report)",
        "onboard.agent.sandbox.remote:9 (sandbox) imports onboard.agent.loop (agent)"]
