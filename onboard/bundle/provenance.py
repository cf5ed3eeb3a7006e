"""What produced a bundle (provenance.json): onboard's version and git commit, the versions of transformers and
torch, the model's source (its reference, the revision where the HuggingFace cache names one, a hash of its
config), and a hash of every template the bundle was rendered from and every runtime module its code imports,
directly or through other runtime modules. Templates are hashed as the renderer reads them.

A runtime module is recorded by what it does, not where it lives: keyed by its qualified name and hashed over
its syntax tree (comments, docstrings and layout left out), with every runtime module name in its imports, and
its own, written as the name it was first recorded under. `runtime_moves.json` maps each module that moved to
its new name, so a refactor that moves code without changing it gives every bundle the same record: `onboard
check` calls them up to date.

Identical inputs give identical bytes. The commit is the one field that changes while every input stays the
same (a commit that touched nothing the bundle uses), so `onboard check` reports it and does not call a bundle
stale for it: the file hashes say whether what the bundle was made from changed.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import subprocess
from pathlib import Path

import onboard
from onboard.adapt import codegen
from onboard.source import ModelSource

SCHEMA_VERSION = 2  # 2: runtime modules by qualified name and syntax tree (1: by file path and bytes)
FILE = "provenance.json"  # one of bundle_files.FILES
MOVES = Path(__file__).with_name("runtime_moves.json")  # {"schema_version": 1, "moves": {old name: new name}}
ROOT = Path(onboard.__file__).resolve().parent.parent  # the project: onboard/, runtime/, templates/
TEMPLATES = ("adapter.py.j2", "REVIEW.md.j2", "train.sh.j2", "train.slurm.j2")  # every bundle's
VOLATILE = ("onboard", "commit")  # the field check does not compare


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def commit() -> str | None:
    """The git commit of the onboard checkout that runs (None outside a git checkout)."""
    try:
        done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def model_source(source: ModelSource) -> dict:
    """The reference, its kind, the HuggingFace cache's revision (the snapshot folder), and the config's hash:
    of config.json's bytes where there is one, else of the config's canonical JSON."""
    config_file = Path(source.path) / "config.json"
    if config_file.is_file():
        digest = _sha256(config_file.read_bytes())
    else:
        digest = _sha256(json.dumps(source.config.to_dict(), sort_keys=True, default=str).encode())
    revision = Path(source.path).name if source.kind == "hf-cache" else None
    return {"ref": source.ref, "kind": source.kind, "revision": revision, "config_sha256": digest}


def templates_used(bundle: Path) -> list[str]:
    """Every bundle's templates, its kernels' (kernels.json) and those its generated modules were rendered from
    (the rules policy's readings in decision.json)."""
    from onboard.bundle.kernel_list import read_kernels

    used = set(TEMPLATES)
    kernels = read_kernels(bundle)
    used |= {k.template for k in kernels.kernels} if kernels else set()
    decision = bundle / "decision.json"
    if decision.is_file():
        used |= {f"generated/{e['reading']}.py.j2" for e in json.loads(decision.read_text()).get("generated", [])
                 if e.get("file") and e.get("policy") == "rules" and e.get("reading")}
    return sorted(used)


def _module_file(name: str, root: Path = ROOT) -> Path | None:
    base = root.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _absolute(node: ast.ImportFrom, package: str) -> str:
    """The module a `from ... import` in a module of `package` names, relative levels resolved."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    return ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))


def _imports(path: Path, package: str) -> set[str]:
    """The modules `path` (a module of `package`) imports: absolute names, relative ones resolved; for `from A
    import B` both A and A.B (B may be a submodule)."""
    return set(_imports_of(path.read_bytes(), package))


# Parsing the runtime's modules is most of a bundle's provenance; a process that writes many bundles (onboard check,
# the tests) reads the same bytes each time, so what they parse to is kept by their bytes (an edited file is new
# bytes, parsed again).
@functools.lru_cache(maxsize=1024)
def _imports_of(source: bytes, package: str) -> frozenset[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            out.add(base)
            out |= {f"{base}.{alias.name}" for alias in node.names}
    return frozenset(out)


def runtime_modules(sources: list[Path], root: Path = ROOT) -> dict[str, Path]:
    """The runtime modules (under `root`) that code in `sources` imports, transitively, with the packages that
    hold them: name -> file."""
    seen: dict[str, Path] = {}
    todo = [(path, "") for path in sources]
    while todo:
        path, package = todo.pop()
        for name in _imports(path, package):
            if not name.startswith("runtime"):
                continue
            parts = name.split(".")
            for i in range(1, len(parts) + 1):  # importing runtime.moe.block runs runtime/ and runtime/moe/ too
                module = ".".join(parts[:i])
                found = _module_file(module, root)
                if found is not None and module not in seen:
                    seen[module] = found
                    todo.append((found, module if found.name == "__init__.py" else ".".join(parts[:i - 1])))
    return dict(sorted(seen.items()))


def moves(path: Path = MOVES) -> dict[str, str]:
    """Old qualified module name -> new, for every runtime module that moved (packages move their modules)."""
    if not path.is_file():
        return {}
    record = json.loads(path.read_text())
    if record.get("schema_version") != 1 or not isinstance(record.get("moves"), dict):
        raise ValueError(f"{path}: not a runtime move map (schema_version 1, moves: {{old: new}})")
    return dict(record["moves"])


def first_name(name: str, renamed: dict[str, str]) -> str:
    """The name a module was first recorded under: `renamed` (new -> old) applied, to the longest prefix that
    moved, until nothing more applies."""
    for _ in range(len(renamed) + 1):
        parts = name.split(".")
        prefix = next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in renamed), None)
        if prefix is None:
            return name
        name = renamed[prefix] + name[len(prefix):]
    raise ValueError(f"runtime_moves.json: the moves of {name} go round in a circle")


class _FirstNames(ast.NodeTransformer):
    """A module's tree as it would read under first names: absolute imports, runtime names mapped, no
    docstrings (they do not decide behaviour)."""

    def __init__(self, package: str, renamed: dict[str, str]):
        self.package, self.renamed = package, renamed

    def _name(self, name: str) -> str:
        return first_name(name, self.renamed) if name.split(".")[0] == "runtime" else name

    def visit_Import(self, node):
        for alias in node.names:
            alias.name = self._name(alias.name)
        return node

    def visit_ImportFrom(self, node):
        node.module, node.level = self._name(_absolute(node, self.package)), 0
        return node

    def generic_visit(self, node):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
        return super().generic_visit(node)


def module_digest(path: Path, name: str, renamed: dict[str, str]) -> str:
    """sha256 of module `name`'s syntax tree under first names (module docstring)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    return _digest_of(path.read_bytes(), package, tuple(sorted(renamed.items())))


@functools.lru_cache(maxsize=1024)
def _digest_of(source: bytes, package: str, renamed: tuple) -> str:
    tree = _FirstNames(package, dict(renamed)).visit(ast.parse(source))
    return _sha256(ast.dump(tree, include_attributes=False).encode())


def runtime_digests(sources: list[Path], move_map: dict[str, str] | None = None,
                    root: Path = ROOT) -> dict[str, str]:
    """First name -> digest of every runtime module (under `root`) that code in `sources` imports."""
    renamed = {new: old for old, new in (moves() if move_map is None else move_map).items()}
    return dict(sorted((first_name(name, renamed), module_digest(path, name, renamed))
                       for name, path in runtime_modules(sources, root).items()))


def provenance(bundle: Path, source: ModelSource) -> dict:
    """The provenance record of the bundle being written in `bundle` (its code files are in place)."""
    import torch
    import transformers

    code = [bundle / "adapter.py"] + sorted((bundle / "generated").glob("*.py"))
    files = {f"templates/{name}": _sha256(codegen.template_text(name).encode()) for name in templates_used(bundle)}
    files |= runtime_digests([p for p in code if p.is_file()])
    return {
        "schema_version": SCHEMA_VERSION,
        "onboard": {"version": onboard.__version__, "commit": commit()},
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
        "source": model_source(source),
        "files": dict(sorted(files.items())),
    }


def write(bundle: Path, source: ModelSource) -> None:
    (bundle / FILE).write_text(json.dumps(provenance(bundle, source), indent=2, sort_keys=True) + "\n")


def comparable(record: dict) -> dict:
    """`record` without the field that changes with no input changed (the commit)."""
    out = json.loads(json.dumps(record))
    out.get(VOLATILE[0], {}).pop(VOLATILE[1], None)
    return out


def causes(old: dict | None, new: dict) -> list[str]:
    """What both bundles were made from that changed between two provenance records (versions, the model's
    config, templates and runtime files whose contents differ)."""
    if old is None:
        return ["made by an onboard that kept no provenance"]
    out = [f"{name} {old.get('versions', {}).get(name)} -> {version}" for name, version in new["versions"].items()
           if old.get("versions", {}).get(name) != version]
    if old.get("source", {}).get("config_sha256") != new["source"]["config_sha256"]:
        out.append("the model's config")
    before, after = old.get("files", {}), new["files"]
    return out + [name for name in sorted(set(before) & set(after)) if before[name] != after[name]]


def uses(old: dict | None, new: dict) -> tuple[list[str], list[str]]:
    """Templates and runtime files the newer bundle uses that the older did not, and the other way round."""
    before, after = set((old or {}).get("files", {})), set(new["files"])
    return sorted(after - before), sorted(before - after)
