"""Kernels a bundle names, rendered again where the kernel store lacks them.

The store (`runtime.kernels.store`) is not committed: it holds what this machine rendered. A bundle's
kernels.json records, per kernel, the template, the parameters, the store key and the sha256 of the text, so a
fresh clone renders a missing kernel from them and checks both: the key (template text and parameters) says the
template is the one the bundle was made with, the sha256 that the text is the one it verified with.

kernels.json arrives in pull requests, so it is read as hostile (`onboard.bundle.kernel_list.read_kernels`: its size
and each record's fields), and only the kernel templates onboard ships are rendered, with parameters that are
numbers or plain names (a parameter is rendered into Python code).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from onboard.bundle.kernel_list import FILE, KernelRecord, read_kernels
from onboard.errors import OnboardError

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}")


def _checked(record: KernelRecord, where: str) -> None:
    from onboard.adapt.codegen import DEFAULT_KERNELS

    if record.template not in DEFAULT_KERNELS:
        raise OnboardError(f"{where}: template {record.template!r} is not one of onboard's kernel templates")
    if not re.fullmatch(r"[0-9a-f]{64}", record.sha256):
        raise OnboardError(f"{where}: 'sha256' must be 64 hex digits")
    if len(record.params) > 32:
        raise OnboardError(f"{where}: params must be an object of at most 32 fields")
    for name, value in record.params.items():
        plain = (isinstance(value, (int, float)) and not isinstance(value, bool)) or (
            isinstance(value, str) and _NAME.fullmatch(value))
        if not _NAME.fullmatch(name) or not plain:
            raise OnboardError(f"{where}: parameter {name!r} must be a number or a plain name, not {value!r}")


def restore_kernels(bundle) -> list[str]:
    """Render into the store every kernel of `bundle`'s kernels.json the store lacks; the keys restored. A
    kernel that no longer renders to what the bundle recorded is a one-line error: adapt the model again."""
    from onboard.adapt.codegen import kernel_key, render_kernel
    from runtime.kernels import store

    path = Path(bundle) / FILE
    kernels = read_kernels(bundle)
    restored = []
    for i, record in enumerate(kernels.kernels if kernels else []):
        _checked(record, f"{path} [{i}]")
        key, template, params, digest = record.key, record.template, record.params, record.sha256
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
