"""Kernels a bundle names, rendered again where the kernel store lacks them.

The store (`runtime.kernels.store`) is not committed: it holds what this machine rendered. A bundle's
kernels.json records, per kernel, the template, the parameters, the store key and the sha256 of the text, so a
fresh clone renders a missing kernel from them and checks both: the key (template text and parameters) says the
template is the one the bundle was made with, the sha256 that the text is the one it verified with.

kernels.json arrives in pull requests, so it is read as hostile: only the kernel templates onboard ships, and
parameters that are numbers or plain names (a parameter is rendered into Python code).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from onboard.errors import OnboardError

MAX_BYTES = 1 << 20  # a bundle's kernels.json is a few hundred bytes a kernel
MAX_KERNELS = 64
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}")


def _entries(path: Path) -> list[dict]:
    if path.is_symlink() or not path.is_file():
        raise OnboardError(f"{path}: not a regular file")
    if path.stat().st_size > MAX_BYTES:
        raise OnboardError(f"{path}: over {MAX_BYTES >> 10} KiB: not a bundle's kernel list")
    try:
        entries = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise OnboardError(f"{path}: not JSON") from None
    if not isinstance(entries, list) or len(entries) > MAX_KERNELS or not all(isinstance(e, dict) for e in entries):
        raise OnboardError(f"{path}: must be a list of at most {MAX_KERNELS} kernel records")
    return entries


def _checked(entry: dict, where: str) -> tuple[str, str, dict, str]:
    from onboard.adapt.codegen import DEFAULT_KERNELS

    key, template, params, digest = (entry.get(k) for k in ("key", "template", "params", "sha256"))
    if template not in DEFAULT_KERNELS:
        raise OnboardError(f"{where}: template {template!r} is not one of onboard's kernel templates")
    if not isinstance(key, str) or not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise OnboardError(f"{where}: a kernel record needs a key and a sha256")
    if not isinstance(params, dict) or len(params) > 32:
        raise OnboardError(f"{where}: params must be an object of at most 32 fields")
    for name, value in params.items():
        plain = (isinstance(value, (int, float)) and not isinstance(value, bool)) or (
            isinstance(value, str) and _NAME.fullmatch(value))
        if not _NAME.fullmatch(name) or not plain:
            raise OnboardError(f"{where}: parameter {name!r} must be a number or a plain name, not {value!r}")
    return key, template, params, digest


def restore_kernels(bundle) -> list[str]:
    """Render into the store every kernel of `bundle`'s kernels.json the store lacks; the keys restored. A
    kernel that no longer renders to what the bundle recorded is a one-line error: adapt the model again."""
    from onboard.adapt.codegen import kernel_key, render_kernel
    from runtime.kernels import store

    path = Path(bundle) / "kernels.json"
    if not path.exists() and not path.is_symlink():
        return []
    restored = []
    for i, entry in enumerate(_entries(path)):
        key, template, params, digest = _checked(entry, f"{path} [{i}]")
        try:
            if store.path_of(key).is_file():
                continue
        except ValueError as exc:
            raise OnboardError(f"{path} [{i}]: {exc}") from None
        if kernel_key(template, params) != key:
            raise OnboardError(f"{path} [{i}]: {key} was rendered from another version of {template} (or other "
                               f"parameters): adapt the model again to render its kernels")
        kernel = render_kernel(template, **params)
        if hashlib.sha256(kernel.text.encode()).hexdigest() != digest:
            raise OnboardError(f"{path} [{i}]: {key} renders to other text than the bundle recorded (sha256): "
                               f"adapt the model again")
        try:
            store.put(key, kernel.text)
        except ValueError as exc:
            raise OnboardError(str(exc)) from None
        restored.append(key)
    return restored
