"""Helpers shared by the tests: the one closeness measure, swapping every DSA attention of a model, and kernels
rendered into the session's kernel store and checked in a process of their own."""

from __future__ import annotations

import subprocess
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


class _Hang(SystemExit):
    """Raised in a command run in this process when it is not done in its time (SIGALRM); a SystemExit, so that
    cli.main's catch-all does not turn it into an internal error."""


def run_cli(*args, env: dict | None = None, cwd=None, timeout: float = HANG) -> subprocess.CompletedProcess:
    """`onboard ARGS` run in this process (`cli.main(argv)`): its exit code and what it printed on stdout and
    stderr, as the CompletedProcess of a run in a process of its own would have them, without a Python, torch
    and transformers start per command (a few seconds of CPU each). For cases that need no process of their own
    (a hang they guard against in C code, a signal, a kill, or code that must never run in the test's process
    still take `subprocess`). `env` is set for the command's duration, `cwd` is its working directory, and torch's
    thread count is put back after it (`onboard train --threads N` sets it); a command not done in `timeout`
    seconds fails the test."""
    import contextlib
    import io
    import os
    import signal

    import cli

    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    saved_env = {k: os.environ.get(k) for k in (env or {})}
    here, threads = os.getcwd(), torch.get_num_threads()

    def hang(signum, frame):
        raise _Hang(f"onboard {' '.join(argv)}: not done in {timeout} s")

    hung = None
    previous = signal.signal(signal.SIGALRM, hang)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        os.environ.update({k: str(v) for k, v in (env or {}).items()})
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(argv)
            except _Hang as exc:
                hung = str(exc)
            except SystemExit as exc:  # argparse: --help (0) and bad arguments (2)
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if not isinstance(exc.code, (int, type(None))):
                    print(exc.code, file=sys.stderr)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        os.chdir(here)
        torch.set_num_threads(threads)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if hung:
        raise AssertionError(hung)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def run_kernel_check(script: str, key: str, *, threads: int = 1):
    """tests/kernels/<script> on a stored kernel, in its own process under Triton's CPU interpreter (Triton reads
    TRITON_INTERPRET at import)."""
    import os

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


def verify_rendered(spec, twin, decision, folder: Path):
    """Render the adapter of `decision` into `folder` (beside its spec) and verify it with whatever runtime is in
    place now (a test may have planted a broken piece)."""
    from onboard.adapt.codegen import render_adapter
    from onboard.adapt.verify import verify
    from onboard.bundle.files import load_adapter

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "spec.json").write_text(spec.to_json())
    (folder / "adapter.py").write_text(render_adapter(spec, decision.taken()))
    return verify(spec, twin, load_adapter(folder).adapt, decision.taken())
