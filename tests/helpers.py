"""Helpers shared by the tests: the one closeness measure, swapping every DSA attention of a model, and kernels
rendered into the session's kernel store and checked in a process of their own."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from runtime.attention import find_sparse_attention, swap_sparse_attention
from runtime.swap import Swaps

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
# seconds that tell a hang from a slow machine: far above any command on a loaded one, far below never
HANG = 300


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: the relative error of `a` against the reference `b`, in fp64 (0 when both are
    zero)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def check_close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = 1e-5) -> None:
    """For scripts run in a process of their own (tests/kernels/): exit with the failing check unless
    rel(a, b) <= tol; print it otherwise."""
    err = rel(a, b)
    if not err <= tol:
        sys.exit(f"{what}: max |diff| / max |ref| {err:.3g} > {tol}")
    print(f"{what}: ok ({err:.1e})")


def swap_all_sparse(model: torch.nn.Module) -> Swaps:
    """Every DSA attention module of `model` on the runtime, as one Swaps."""
    return Swaps(swap_sparse_attention(model.get_submodule(p), path=p) for p in find_sparse_attention(model))


def stored_kernel(template: str, **params) -> str:
    """Render a kernel template (`onboard.adapt.codegen.render_kernel`) into the session's kernel store; its key."""
    from onboard.adapt.codegen import render_kernel
    from runtime.kernels import store

    kernel = render_kernel(template, **params)
    store.put(kernel.key, kernel.text)
    return kernel.key


def run_kernel_check(script: str, key: str, *, threads: int = 1):
    """tests/kernels/<script> on a stored kernel, in its own process under Triton's CPU interpreter (Triton reads
    TRITON_INTERPRET at import)."""
    import os
    import subprocess

    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(TESTS / "kernels" / script), key], check=False, capture_output=True,
                          text=True, env=env, timeout=600, cwd=ROOT)


def released_model(family: str, folder: Path, **config) -> tuple[Path, Path]:
    """(model directory, bundle) for the family's tiny twin (with `config` fields changed) as a released
    checkpoint: weights drawn away from their init (a load that skipped a tensor shows), saved with
    `save_pretrained` in several safetensors shards, and adapted into a bundle beside it."""
    from transformers import AutoModelForCausalLM

    from onboard.bundle.make import adapt
    from onboard.review.families import default_config
    from onboard.source import from_config, resolve
    from onboard.twin import Twin

    base = default_config(family)
    for key, value in config.items():
        setattr(base, key, value)
    config = Twin.build(from_config(base, family)).config
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    model.save_pretrained(folder / "model", max_shard_size="200KB")
    adapt(resolve(str(folder / "model")), folder / "bundle")
    return folder / "model", folder / "bundle"
