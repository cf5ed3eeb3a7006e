"""`python -m runtime.train` (what torchrun starts on every rank): one `TrainJob`, from `--job job.json` or from
flags (each generated from a TrainJob field).

The model comes from a factory the job names, `module:function` with JSON keyword arguments, so the runtime
never needs to know where models come from (`onboard.train:build_model` builds a bundle's adapted model).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

import torch
import torch.distributed as dist

from runtime.plan import Plan
from runtime.train.job import TrainJob
from runtime.train.loop import train


def _factory(name: str, kwargs: dict):
    module, _, attr = name.partition(":")
    if not attr:
        raise ValueError(f"--model must be module:function, got {name!r}")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load model factory {name}: {e}") from None
    return lambda: fn(**kwargs)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime.train", description="train one TrainJob on this rank "
                                "(torchrun starts one per process)")
    p.add_argument("--job", help="job.json (a TrainJob, as `onboard train` writes it); flags given as well win")
    TrainJob.add_arguments(p, internal=True)
    return p


def parse(argv=None) -> TrainJob:
    """The job of a command line: --job's file, with the flags given on the line over it."""
    p = parser()
    args = p.parse_args(argv)
    if args.job:
        base = TrainJob.load(args.job)
        p.set_defaults(**vars(base))
        args = p.parse_args(argv)
    if args.model is None or args.plan is None:
        raise ValueError("a job names its model factory (--model module:function) and its plan (--plan)")
    return TrainJob.from_args(args)


def main(argv=None) -> int:
    code = 0
    try:
        job = parse(argv)
        if job.threads:
            torch.set_num_threads(job.threads)
        train(_factory(job.model, job.model_kwargs), Plan.from_dict(job.plan), job)
    except (ValueError, json.JSONDecodeError) as e:
        rank = os.environ.get("RANK", "0")
        print(f"runtime.train (rank {rank}): error: {e}", file=sys.stderr)
        code = 1
    if dist.is_initialized():
        if code == 0:
            dist.barrier()  # every rank is past its last collective
        # Tearing down the gloo process group (explicitly or at interpreter exit) sometimes aborts the process
        # with "terminate called without an active exception" after a complete run (seen in 1 of 6 runs):
        # the run log and checkpoints are closed by now, so leave without running C++ destructors.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
