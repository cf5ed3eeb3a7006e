"""What a bundle holds, and reading it back: its files, its spec, source and decision, its adapter module."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import sys
import uuid
from pathlib import Path

from onboard.bundle.source_record import FILE, SourceRecord
from onboard.contract import load
from onboard.errors import OnboardError, one_line
from runtime import bounded

MARKER = ".onboard-bundle"  # every bundle holds it: what `onboard adapt --force` may replace
# what `onboard adapt` writes (kernels themselves go to the runtime's kernel store; kernels.json names them)
FILES = ("spec.json", "source.json", "decision.json", "adapter.py", "kernels.json", "verification.json",
         "REVIEW.md", "plan.json", "train.sh", "train.slurm", "provenance.json", MARKER)
REQUIRED = ("spec.json", "adapter.py", "source.json")
# every name a bundle's top level may hold that onboard writes (FILES, and from `onboard agent` generated/ and
# agent.jsonl); anything else in a bundle folder is the user's (checkpoints/, runs/, data, notes): never replaced
GENERATED = (*FILES, "generated", "agent.jsonl")


def owned(name: str) -> bool:
    """Whether the top-level entry `name` of a bundle is one onboard writes (and --force / --fix replace)."""
    return name in GENERATED


def only_regular_files(bundle: Path) -> None:
    """Refuse (one line) a bundle whose own entries (`owned`, and everything below them) are anything but regular
    files and directories: a link could lead out of the bundle (a review would print its target into a pull
    request), a FIFO would block the reader, a loop would never end."""
    for name in sorted(os.listdir(bundle)):
        if not owned(name):
            continue
        stack = [bundle / name]
        while stack:
            path = stack.pop()
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                raise OnboardError(f"{path}: a symbolic link; onboard reads a bundle's own regular files only")
            if stat.S_ISDIR(mode):
                stack.extend(sorted(path.iterdir()))
            elif not stat.S_ISREG(mode):
                raise OnboardError(f"{path}: not a regular file (a FIFO, socket or device); onboard reads a "
                                   f"bundle's own regular files only")


def read_bundle(bundle) -> tuple[Path, dict, SourceRecord]:
    """The bundle directory, its spec and its source record; one-line errors for anything missing, and for a
    bundle that is not made of regular files (`only_regular_files`)."""
    bundle = Path(bundle)
    if not bundle.is_dir():
        raise OnboardError(f"{bundle}: no such bundle directory (write one with `onboard adapt MODEL --out DIR`)")
    try:
        only_regular_files(bundle)
    except OSError as exc:
        raise OnboardError(f"{bundle}: unreadable bundle ({one_line(exc)})") from None
    missing = [f for f in REQUIRED if not (bundle / f).is_file()]
    if missing:
        raise OnboardError(f"{bundle} is not a bundle: missing {', '.join(missing)}")
    try:
        spec = json.loads(bounded.read_text(bundle / "spec.json", "bundle file"))  # (Refused: a ValueError)
        origin = json.loads(bounded.read_text(bundle / "source.json", "bundle file"))
    except (ValueError, OSError, RecursionError) as exc:
        raise OnboardError(f"{bundle}: unreadable bundle ({one_line(exc)})") from None
    if not isinstance(spec, dict):
        raise OnboardError(f"{bundle}/spec.json must hold a JSON object")
    return bundle, spec, SourceRecord.from_dict(origin, str(bundle / FILE))


def bundle_source(origin: SourceRecord, trust_remote_code: bool):
    """The model a bundle was made from. Remote code runs only with consent given on this command line: the
    bundle's own record of it is never enough (a bundle may come from anyone's pull request)."""
    from onboard.source import resolve

    return resolve(origin.ref, trust_remote_code=trust_remote_code)


def read_decision(bundle: Path):
    """The bundle's adapt decision (decision.json)."""
    from onboard.adapt.decision import Decision

    path = Path(bundle) / "decision.json"
    if not path.is_file():
        raise OnboardError(f"{bundle} has no decision.json (written by an older onboard): adapt the model again")
    try:
        return Decision.from_json(bounded.read_text(path, "bundle file"))
    except (ValueError, KeyError, TypeError) as exc:
        raise OnboardError(f"{path}: unreadable decision ({one_line(exc)})") from None


def read_verification(bundle: Path):
    """The bundle's verification record (verification.json), or None where it has none; one line naming the file
    and field for anything else (it arrives in pull requests)."""
    from onboard.adapt.verify import Verification

    path = Path(bundle) / "verification.json"
    if not path.is_file():
        return None
    return Verification.from_dict(load(path), str(path))


def load_adapter(directory: Path):
    """Import a bundle's adapter.py as a module of its own (this runs the bundle's code: callers say so).
    An adapter that does not import, or has no `adapt(model)`, is a one-line OnboardError."""
    from onboard.bundle.kernels import restore_kernels
    from runtime.kernels.registry import available_backends

    if "triton" in available_backends():  # where the adapter loads its kernels: a fresh clone's store is empty
        restore_kernels(directory)
    path = Path(directory) / "adapter.py"
    name = f"onboard_adapter_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - generated (or edited) code: report it in one line
        del sys.modules[name]
        raise OnboardError(f"{path} does not import: {one_line(exc)}") from None
    if not callable(getattr(module, "adapt", None)):
        raise OnboardError(f"{path} has no adapt(model) function: not a bundle's adapter")
    return module
