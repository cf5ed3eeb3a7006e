"""Putting a bundle in place without losing anything the user had.

A bundle is written into a staging folder beside its target (`.NAME.onboard-XXXX`, holding a record of the
process that writes it) and renamed into place only when complete. The target is checked when adapt starts
and again, under a lock on its parent folder, right before the rename:

- `--force` replaces only a directory that is recognisably a bundle (it holds `MARKER`, which every bundle
  gets, or the files every bundle has); never a directory that is, or contains, the model being adapted; never
  the current directory, a symlink or a file;
- without `--force` the target must be absent or empty, at the end as at the start (a directory created at
  `--out` while adapt ran, or a concurrent adapt that finished first, is kept and this run fails);
- what a killed run left behind is recognised and put right by the next run for the same target: staging
  folders whose writer is gone are removed, and an old bundle moved aside (`.NAME.old-XXXX`) but not yet
  replaced is moved back;
- a bundle replaced keeps what is not onboard's (`bundle_files.owned`: checkpoints/, runs/, data, any file the
  user put there): each such entry moves into the new bundle, and a run killed halfway finishes the move.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import tempfile
import uuid
from pathlib import Path

from onboard.bundle.files import MARKER, REQUIRED, owned
from onboard.errors import OnboardError

_WRITER = ".onboard-staging"  # in a staging folder: which process writes it


def is_bundle(path: Path) -> bool:
    """A directory onboard wrote: the marker, or (bundles from before it) every file a bundle must have."""
    return (path / MARKER).is_file() or all((path / name).is_file() for name in REQUIRED)


def check_target(out: Path, *, force: bool, protect: tuple[Path, ...] = ()) -> Path:
    """`out` as a bundle's destination, absolute; one-line refusals for anything `--force` must not touch."""
    out = Path(os.path.abspath(os.path.expanduser(out)))
    if out.is_symlink():
        raise OnboardError(f"{out} is a symlink; give the folder itself as --out")
    if out.exists() and not out.is_dir():
        raise OnboardError(f"{out} exists and is not a directory")
    if out == Path.cwd():
        raise OnboardError("--out is the current directory; name a folder for the bundle")
    for kept in protect:
        kept = Path(os.path.abspath(kept))
        if out == kept or out in kept.parents:
            raise OnboardError(f"--out {out} holds the model being adapted ({kept}); choose another folder")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise OnboardError(f"{out} already holds files; pass --force to replace a bundle there")
        if not is_bundle(out):
            raise OnboardError(f"{out} is not a bundle onboard wrote; --force replaces only bundles, so move "
                               f"or empty it first")
    parent = out.parent
    try:  # the default --out, bundles/<model>, starts a bundles/ folder on a fresh checkout
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OnboardError(f"cannot create {parent}: {exc.strerror or exc}") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OnboardError(f"cannot write to {parent}: permission denied")
    return out


@contextlib.contextmanager
def locked(folder: Path):
    """An exclusive lock on `folder` (flock on the directory itself: nothing is left behind)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _writer_alive(staging: Path) -> bool:
    """Whether the process that writes a staging folder still runs (unknown writers count as alive). Called under
    the folder's lock, which `staging_for` holds from making the folder to writing its record: a folder with no
    record was made by a process killed in between."""
    if not (staging / _WRITER).exists() and not (staging / _WRITER).is_symlink():
        return False
    try:
        record = json.loads((staging / _WRITER).read_text())
        if record["host"] != socket.gethostname():
            return True
        os.kill(int(record["pid"]), 0)
    except ProcessLookupError:
        return False
    except (OSError, ValueError, KeyError, TypeError):
        return True  # not ours, unreadable, or another user's process: leave it
    return True


def _carry(old: Path, new: Path) -> list[str]:
    """Move the entries of bundle `old` that are not onboard's into bundle `new` (where the name is free); their
    names. An entry whose name `new` already holds stays in `old`."""
    carried = []
    for entry in sorted(old.iterdir()):
        if not owned(entry.name) and not (new / entry.name).exists() and not (new / entry.name).is_symlink():
            entry.rename(new / entry.name)
            carried.append(entry.name + ("/" if (new / entry.name).is_dir() else ""))
    return carried


def tidy(out: Path) -> list[str]:
    """Put right what a killed run for `out` left behind; returns what it did (one phrase each)."""
    done = []
    with locked(out.parent):
        for old in sorted(out.parent.glob(f".{out.name}.old-*")):
            if out.exists():
                carried = _carry(old, out)
                if any(not owned(e.name) for e in old.iterdir()):
                    done.append(f"left {old.name} in place: it holds files of yours that {out.name} holds too")
                    continue
                shutil.rmtree(old)
                done.append(f"removed {old.name}, a bundle already replaced"
                            + (f" (moved {', '.join(carried)} into {out.name})" if carried else ""))
            else:
                old.rename(out)
                done.append(f"moved {old.name} back to {out.name}: a killed run had moved it aside")
        for staging in sorted(out.parent.glob(f".{out.name}.onboard-*")):
            if staging.is_dir() and not _writer_alive(staging):
                shutil.rmtree(staging)
                done.append(f"removed {staging.name}, left by a killed run")
    return done


def staging_for(out: Path) -> Path:
    """A fresh staging folder beside `out`, recording which process writes it."""
    with locked(out.parent):  # (`tidy` reads a folder without its record as a killed run's)
        staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.onboard-"))
        (staging / _WRITER).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    return staging


def move_into_place(staging: Path, out: Path, *, force: bool, protect: tuple[Path, ...] = ()) -> list[str]:
    """Move a complete staging folder to `out`, checking `out` again under the lock first; what it kept of the
    bundle it replaced (entries that are not onboard's, moved into the new one)."""
    (staging / _WRITER).unlink()
    (staging / MARKER).write_text("a bundle written by onboard adapt: onboard adapt --force may replace it\n")
    with locked(out.parent):
        check_target(out, force=force, protect=protect)
        if not out.exists():
            staging.rename(out)
            return []
        old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
        out.rename(old)
        staging.rename(out)
        carried = _carry(old, out)  # a run killed before this line leaves `old`: the next run's tidy carries it
        shutil.rmtree(old)
        return carried
