"""`onboard check`: is each committed bundle what today's onboard makes of its recorded source, and does it
still verify? What CI runs on every pull request.

For each bundle: the bundle is made again from its recorded source (`source.json`; an agent's bundle by replaying
its own `agent.jsonl`, whose candidates meet the guard and run only in the agent's sandbox) into a scratch
folder, verified there, and compared file by file. The committed bundle's own code is never run (it arrives in a
pull request): a bundle whose files are what onboard makes now has exactly the verification just run; one that
differs is stale, whatever its edited code would compute. The bundle is never touched unless `fix`. A bundle is stale when a file differs, one
line each, naming what it was made from that changed since (provenance.json: templates, runtime files,
versions, the model's config) or saying that nothing did (an edit by hand). Files that hold measured errors are
compared by their verdicts: the last digits of a float, and so which gradient comes out worst, differ from one
CPU to another; whether each seed passed, what was swapped and how often it ran do not. REVIEW.md is not
compared: it renders files that are (and a template whose hash provenance.json holds). `fix` replaces a stale
or failing bundle with the one made now, atomically.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from onboard.bundle import provenance
from onboard.bundle.files import bundle_source, owned, read_bundle
from onboard.errors import OnboardError

if TYPE_CHECKING:  # onboard.adapt.verify loads torch: read only where a record is compared
    from onboard.adapt.verify import Verification

DERIVED = ("REVIEW.md",)  # rendered from compared files
SEED_VERDICTS = ("seed", "passed", "truth", "decays", "runtime_calls", "original_calls", "runtime_loss_calls",
                 "runtime_attention_calls")
NUMBER = re.compile(r"-?\d+\.\d+(?:e[-+]?\d+)?|-?\d+e[-+]?\d+", re.IGNORECASE)


@dataclass
class Checked:
    bundle: Path
    stale: list[str] = field(default_factory=list)  # one line per file that differs
    failed: str = ""  # why the committed bundle no longer verifies ("" when it does)
    fixed: bool = False
    fresh_passed: bool = True  # whether the bundle made now verifies
    commit: str = ""  # the commit it was made at, where that is not the one running
    kept: list[str] = field(default_factory=list)  # what --fix kept of the user's, moved into the new bundle

    @property
    def ok(self) -> bool:
        return not self.stale and not self.failed

    def lines(self) -> list[str]:
        if self.ok:
            return [f"{self.bundle}: up to date and verifies" + (f" (made at {self.commit[:12]})" if self.commit
                                                                 else "")]
        out = [f"{self.bundle}: stale: {line}" for line in self.stale]
        if self.failed:
            out.append(f"{self.bundle}: {self.failed}")
        if self.fixed:
            out.append(f"{self.bundle}: fixed: replaced by the bundle made now"
                       + ("" if self.fresh_passed else ", which does not verify either")
                       + (f"; kept {', '.join(self.kept)} (not onboard's)" if self.kept else ""))
        return out


def masked(text: str) -> str:
    """`text` with every decimal or exponent number replaced by one placeholder."""
    return NUMBER.sub("<n>", text)


def _files(folder: Path) -> set[str]:
    """The files onboard writes in a bundle (checkpoints/, runs/ and other files of the user's are not compared)."""
    return {str(p.relative_to(folder)) for p in folder.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and owned(p.relative_to(folder).parts[0])}


def verdicts(verification: Verification) -> dict:
    """What a verification record decided, without what it measured."""
    out = {k: getattr(verification, k) for k in ("schema_version", "passed", "replaced", "expected", "swaps",
                                                  "backends")}
    out["note"] = masked(verification.note)
    out["aux_passed"] = verification.aux_loss.get("passed")
    out["kept_apart"] = verification.packed.get("kept_apart")
    out["seeds"] = [{k: getattr(s, k) for k in SEED_VERDICTS} for s in verification.seeds]
    return out


def _events(text: str) -> list[dict]:
    """agent.jsonl with each probe's result cut to its verdict and every number masked."""
    out = []
    for line in text.splitlines():
        event = json.loads(line)
        if isinstance(event.get("result"), dict):
            event["result"] = {"passed": event["result"].get("passed")}
        out.append(json.loads(masked(json.dumps(event, sort_keys=True))))
    return out


def _same(name: str, old: Path, new: Path) -> bool:
    a, b = old.read_bytes(), new.read_bytes()
    if a == b or name in DERIVED:
        return True
    try:
        if name == provenance.FILE:
            return provenance.comparable(json.loads(a)) == provenance.comparable(json.loads(b))
        if name == "verification.json":
            from onboard.adapt.verify import Verification

            return (verdicts(Verification.from_dict(json.loads(a), str(old)))
                    == verdicts(Verification.from_dict(json.loads(b), str(new))))
        if name == "agent.jsonl":
            return _events(a.decode()) == _events(b.decode())
    except (ValueError, AttributeError, TypeError, RecursionError, OnboardError):
        return False
    return False


def record(folder: Path) -> dict | None:
    """A bundle's provenance record; None where it has none, or one that is not a record (a pull request's
    edit: the file then differs, and that is said as a difference)."""
    path = folder / provenance.FILE
    try:
        value = json.loads(path.read_text()) if path.is_file() else None
    except (ValueError, UnicodeDecodeError, RecursionError, OSError):
        return None
    ok = isinstance(value, dict) and all(isinstance(value.get(k), dict) for k in ("versions", "files", "source"))
    return value if ok and isinstance(value.get("onboard", {}), dict) else None


def differences(old: Path, new: Path) -> list[str]:
    """One line per file of bundle `old` that differs from bundle `new`, with what changed in between."""
    before, after = _files(old), _files(new)
    changed = sorted(name for name in before & after if not _same(name, old / name, new / name))
    lines = [f"{name}: no longer made" for name in sorted(before - after)]
    lines += [f"{name}: made now, missing from the bundle" for name in sorted(after - before)]
    if changed or lines:
        why = provenance.causes(record(old), record(new))
        since = (f"changed since it was made: {', '.join(why[:6])}{' ...' if len(why) > 6 else ''}" if why
                 else "nothing it was made from changed: edited by hand?")
        lines += [f"{name} differs from what onboard makes now ({since})" for name in changed]
    return lines


def regenerate(bundle: Path, out: Path, *, trust_remote_code: bool = False):
    """Make `bundle` again from its recorded source into `out` (an agent's bundle by replaying its record); the
    new bundle's verification."""
    from onboard.agent.loop import RECORD, run
    from onboard.bundle.make import adapt

    _, _, origin = read_bundle(bundle)
    source = bundle_source(origin, trust_remote_code)
    if (bundle / RECORD).is_file():
        return run(source, out, replay=bundle / RECORD)[1]
    return adapt(source, out)[1]


def committed_bundles(root: Path = Path("bundles")) -> list[Path]:
    """The bundles under `root` (folders holding a spec.json), in order."""
    return sorted(p.parent for p in root.glob("*/spec.json")) if root.is_dir() else []


def _worst(verification) -> str:
    failed = [s for s in verification.seeds if not s.passed]
    if not failed:
        return "see onboard verify"
    seed = failed[0]
    return (f"seed {seed.seed}: logits {seed.logits_max_rel:.1e} relative, worst gradient {seed.grad_worst_param} "
            f"{seed.grad_worst_rel:.1e}")


def check_bundle(bundle: Path, *, fix: bool = False, trust_remote_code: bool = False) -> Checked:
    from onboard.bundle.target import move_into_place, staging_for

    directory, _, _ = read_bundle(bundle)
    result = Checked(directory)
    with tempfile.TemporaryDirectory(prefix="onboard-check-") as scratch:
        fresh = Path(scratch) / "fresh"
        verification = regenerate(directory, fresh, trust_remote_code=trust_remote_code)
        result.fresh_passed = verification.passed
        if not verification.passed:
            result.failed = f"no longer verifies: {verification.note or _worst(verification)}"
        result.stale = differences(directory, fresh)
        made_at = (record(directory) or {}).get("onboard", {}).get("commit")
        if made_at and made_at != provenance.commit():
            result.commit = made_at
        if fix and not result.ok:
            staging = staging_for(directory)
            shutil.copytree(fresh, staging, dirs_exist_ok=True)
            result.kept = move_into_place(staging, directory, force=True)
            result.fixed = True
    return result
