"""What the bench scripts share: their command line, and starting their gloo ranks."""

from __future__ import annotations

import argparse
import socket


def parser(doc: str, *, children: tuple[str, ...] = (), **options) -> argparse.ArgumentParser:
    """A bench's argument parser, described by the first line of its docstring, with a whole-number option for
    each keyword: `name=default`, or `name=(default, help)` (underscores become dashes; defaults are shown in
    --help). With `children` (the variants a bench runs one per process, `run_child`), the hidden options a
    child reads: --worker (which variant) and --out (where it writes its tensors)."""
    out = argparse.ArgumentParser(description=doc.splitlines()[0],
                                  formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    if children:
        out.add_argument("--worker", choices=children, help=argparse.SUPPRESS)
        out.add_argument("--out", help=argparse.SUPPRESS)
    for name, value in options.items():
        default, text = value if isinstance(value, tuple) else (value, name.replace("_", " "))
        out.add_argument(f"--{name.replace('_', '-')}", type=count, default=default, help=text)
    return out


def count(text: str) -> int:
    """A count or a size: a whole number above zero (argparse turns the error into one line)."""
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def run_child(script: str, args: list[str], threads: int, what: str, **popen) -> dict:
    """Run `script` again in a fresh process (one variant per process: peak memory and allocator state are its
    own) with these arguments and `threads` OpenMP threads; the JSON object on its last `{` line. Exits with the
    child's error when it fails."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": str(threads), **popen.pop("env", {})}
    result = subprocess.run([sys.executable, script, *args], check=False, capture_output=True, text=True, env=env,
                            **popen)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        raise SystemExit(f"{what} failed (exit {result.returncode}): {result.stderr.strip()[-2000:]}")
    return json.loads(lines[-1])


def scratch_kernel_store(folder) -> None:
    """Kernels rendered while a bench adapts a model into a scratch folder go to `folder`, not into the
    repository's store (unless ONBOARD_KERNEL_STORE already names one); the bench's child processes inherit it."""
    import os

    os.environ.setdefault("ONBOARD_KERNEL_STORE", str(folder))


# Flush-to-zero: every bench reports its figures with it off (what users run) and on, and how many subnormal
# values the cores' intermediate tensors held (runtime.subnormals). Child processes learn the mode from BENCH_FTZ.
FTZ_ENV = "BENCH_FTZ"


def add_ftz(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ftz", choices=["off", "on", "both"], default="both",
                        help="the CPU's flush-to-zero for the timed runs: off (every process's default), on, or "
                             "both, each reported")


def ftz_modes(choice: str) -> list[bool]:
    return {"off": [False], "on": [True], "both": [False, True]}[choice]


def ftz_label(on: bool) -> str:
    return "flush-to-zero on " if on else "flush-to-zero off"


def child_env(on: bool) -> dict:
    """The environment entry that tells a child process (`apply_child_ftz`) which mode to time in."""
    return {FTZ_ENV: "1" if on else "0"}


def apply_child_ftz() -> bool:
    """In a child process: set flush-to-zero as the parent asked (off unless told); returns the mode."""
    import os

    import torch

    on = os.environ.get(FTZ_ENV) == "1"
    torch.set_flush_denormal(on)
    return on


def alternate_modes(fns: dict, modes: list[bool], repeats: int) -> tuple[dict, dict]:
    """Run every fn of `fns` (name -> fn) once a round under each flush-to-zero mode, the modes and variants
    taking turns so that machine drift hits them alike; the first round warms up and is not kept. Returns
    ({(mode, name): [what fn returned in each kept round]}, {name: what fn returned last})."""
    from runtime.subnormals import flush_to_zero

    rounds = {(ftz, name): [] for ftz in modes for name in fns}
    last = {}
    for kept in [False] + [True] * repeats:
        for ftz in modes:
            with flush_to_zero(ftz):
                for name, fn in fns.items():
                    last[name] = fn()
                    if kept:
                        rounds[ftz, name].append(last[name])
    return rounds, last


def subnormals(fn) -> tuple[int, str]:
    """Run fn() once under a SubnormalCensus (flush-to-zero off): the subnormal values its operations made,
    forward and backward, and the operations that made most of them."""
    import torch
    from runtime.subnormals import SubnormalCensus

    torch.set_flush_denormal(False)
    with SubnormalCensus() as census:
        fn()
    return census.total, census.worst(3)


def spawn_ranks(rank_main, args, world: int) -> None:
    """Run `rank_main(rank, args, port)` in `world` processes, `port` a free local one for their rendezvous."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(args, port), nprocs=world)
