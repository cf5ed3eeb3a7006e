"""Helpers shared by the tests: closeness of tensors, and swapping every DSA attention of a model."""

from __future__ import annotations

import torch

from runtime.attention import find_sparse_attention, swap_sparse_attention
from runtime.swap import Swaps


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: the relative error of `a` against the reference `b` (0 when both are zero)."""
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def swap_all_sparse(model: torch.nn.Module) -> Swaps:
    """Every DSA attention module of `model` on the runtime, as one Swaps."""
    return Swaps(swap_sparse_attention(model.get_submodule(p), path=p) for p in find_sparse_attention(model))


def stored_kernel(template: str, **params) -> str:
    """Render a kernel template (`onboard.codegen.render_kernel`) into the session's kernel store; its key."""
    from onboard.codegen import render_kernel
    from runtime.kernels import store

    kernel = render_kernel(template, **params)
    store.put(kernel.key, kernel.text)
    return kernel.key


def run_kernel_check(script: str, key: str, *, threads: int = 1):
    """tests/kernels/<script> on a stored kernel, in its own process under Triton's CPU interpreter (Triton reads
    TRITON_INTERPRET at import)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": str(threads)}
    return subprocess.run([sys.executable, str(here / "kernels" / script), key], check=False, capture_output=True,
                          text=True, env=env, timeout=600, cwd=here.parent)
