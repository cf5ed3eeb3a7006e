"""Where commands write files: checked before any work starts, never over something the user did not ask to
replace, always atomically (a temporary file beside the target, renamed into place)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from onboard.errors import OnboardError


def output_file(path, *, force: bool, what: str) -> Path:
    """`path` as a place to write `what` (a plan, a plot): refused, in one line, when it is a directory, when
    its parent is a file or cannot be created, and when it exists and `force` was not given."""
    path = Path(path)
    if path.is_dir():
        raise OnboardError(f"{path} is a directory; give the file to write the {what} to")
    if path.exists() and not force:
        raise OnboardError(f"{path} exists; pass --force to replace it with the {what}")
    parent = path.parent
    if parent.exists() and not parent.is_dir():
        raise OnboardError(f"cannot write the {what} to {path}: {parent} is a file")
    writable_folder(parent, what)
    return path


def writable_folder(folder: Path, what: str) -> Path:
    """`folder`, created where missing, as a place this process may write `what` into; one line where not."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OnboardError(f"cannot create {folder} for the {what}: {exc.strerror or exc}") from None
    if not os.access(folder, os.W_OK):
        raise OnboardError(f"cannot write the {what} to {folder}: permission denied")
    return folder


def write_atomically(path: Path, text: str) -> Path:
    """Write `text` to `path` through a temporary file in the same folder: readers see the old file or the new."""
    path = Path(path)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as tmp:
        tmp.write(text)
    os.replace(tmp.name, path)
    return path
