"""Which implementation of each runtime op runs: picked per op by backend, the reference as fallback.

Backends: "npu" (torch_npu fused ops, where torch_npu imports), "triton" (CUDA, or the CPU interpreter
when TRITON_INTERPRET=1), "cpu" (the plain PyTorch reference, always present). Rendered kernels register
themselves under their backend; ops ask `lookup(name)` at call time, so registering takes effect at once.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Callable

_OPS: dict[str, dict[str, Callable]] = {}
_forced: str | None = None


def register(op: str, backend: str, fn: Callable) -> None:
    _OPS.setdefault(op, {})[backend] = fn


def unregister(op: str, backend: str) -> None:
    _OPS.get(op, {}).pop(backend, None)


def available_backends() -> list[str]:
    """Backends this process can run, best first."""
    out = []
    if importlib.util.find_spec("torch_npu") is not None:
        out.append("npu")
    if importlib.util.find_spec("triton") is not None:
        import torch

        if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
            out.append("triton")
    out.append("cpu")
    return out


def use(backend: str | None) -> None:
    """Force one backend (tests, benchmarks); None returns to automatic choice."""
    global _forced
    _forced = backend


def lookup(op: str, reference: Callable) -> Callable:
    """The implementation of `op` for the best available backend that has one, else `reference`."""
    impls = _OPS.get(op, {})
    order = [_forced] if _forced else available_backends()
    for backend in order:
        if backend in impls:
            return impls[backend]
    return reference


def backend_of(op: str, reference: Callable) -> str:
    fn = lookup(op, reference)
    return next((b for b, f in _OPS.get(op, {}).items() if f is fn), "cpu")
