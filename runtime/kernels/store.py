"""The kernel store: Triton kernels rendered for one model's shapes, each kept once, by key.

A rendered kernel is a Python module whose `register()` puts its ops into `runtime.kernels.registry`. onboard
renders it from a template (templates/kernels/) and names it `<template>-<hash of the template's text and the
parameters>`, so the same template at the same parameters is one file whoever renders it, and a changed
template is a new key. Bundles say which keys they use (their adapter's `KERNELS`, and kernels.json); a pull
request that adds a model shows each new kernel once, here.

    put(key, text)       # store a rendered kernel (atomic; the same key with other text is refused)
    load(key)            # its module, imported once per process
    load_kernels(keys)   # register the NPU ops where torch_npu imports, and each kernel where Triton can run

The store is the folder `store/` beside this module, or the one named by $ONBOARD_KERNEL_STORE.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import tempfile
from pathlib import Path

from runtime.errors import InputError
from runtime.kernels import registry

_KEY = re.compile(r"[a-z0-9_]+-[0-9a-f]{12}")


def root() -> Path:
    return Path(os.environ.get("ONBOARD_KERNEL_STORE") or Path(__file__).with_name("store"))


def check_writable() -> None:
    """The store is a folder this process can write (made where it is missing); InputError, one line, where it is
    not: said before an adapt builds anything, not when its first kernel is rendered."""
    folder = root()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as exc:
        raise InputError(f"cannot write the kernel store {folder}: {exc.strerror or exc} "
                         f"(set ONBOARD_KERNEL_STORE to a writable folder)") from None


def path_of(key: str) -> Path:
    if not _KEY.fullmatch(key):
        raise ValueError(f"{key!r} is not a kernel key (<template>-<12 hex digits>)")
    return root() / f"{key}.py"


def put(key: str, text: str) -> Path:
    """Keep `text` under `key`. A key already stored with the same text is left as it is; with other text it is
    refused (ValueError): keys are content hashes, so that is a kernel edited by hand."""
    path = path_of(key)
    if path.is_file():
        if path.read_text() != text:
            raise ValueError(f"{path} holds another kernel under the same key (edited by hand?); "
                             f"delete it and adapt again")
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{key}.", delete=False) as tmp:
            tmp.write(text)
        os.replace(tmp.name, path)
    except OSError as exc:
        raise InputError(f"cannot write the kernel store {path.parent}: {exc.strerror or exc} "
                         f"(set ONBOARD_KERNEL_STORE to a writable folder)") from None
    return path


def load(key: str):
    """The stored kernel module under `key`, imported once per process (not registered)."""
    name = f"onboard_kernel_{key.replace('-', '_')}"
    if name not in sys.modules:
        path = path_of(key)
        if not path.is_file():
            raise FileNotFoundError(f"kernel {key} is not in the kernel store {root()}: adapt the model again "
                                    f"(onboard adapt) or point ONBOARD_KERNEL_STORE at the store it was written to")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def load_kernels(keys: list[str]) -> list[str]:
    """Register the NPU ops where torch_npu imports, and each stored kernel (its `register()`) when the Triton
    backend can run; returns what was loaded. A key missing from the store is an error only where Triton could
    run it."""
    from runtime.kernels import npu

    loaded = ["npu"] if npu.register() else []
    if not keys or "triton" not in registry.available_backends():
        return loaded
    for key in keys:
        load(key).register()
        loaded.append(key)
    return loaded
