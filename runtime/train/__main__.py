"""`python -m runtime.train` (what torchrun starts on every rank).

The model comes from a factory named on the command line, `module:function` with JSON keyword
arguments, so the runtime never needs to know where models come from (`onboard.train:build_model`
builds a bundle's adapted model).
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
from runtime.train.loop import TrainConfig, train


def _factory(name: str, kwargs: dict):
    module, _, attr = name.partition(":")
    if not attr:
        raise ValueError(f"--model must be module:function, got {name!r}")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load model factory {name}: {e}") from None
    return lambda: fn(**kwargs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.train", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="model factory, module:function")
    p.add_argument("--model-kwargs", default="{}", help="JSON keyword arguments for the factory")
    p.add_argument("--plan", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--data", help="tokenized file (.npy, or .bin of uint16) or packed corpus folder; default: "
                                  "synthetic tokens")
    p.add_argument("--eval-data", help="held-out data, as --data: its loss goes into the run log")
    p.add_argument("--eval-every", type=int, default=0, help="steps between held-out losses (0: at the end)")
    p.add_argument("--export-hf", help="after training: a HuggingFace checkpoint of the model here (LoRA merged)")
    p.add_argument("--export-peft", help="after training: the LoRA adapters as a PEFT adapter folder here")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--checkpoint-dir")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--keep-checkpoints", type=int, default=2)
    p.add_argument("--rebalance-every", type=int, default=0,
                   help="steps between expert placements from measured load (0: never)")
    p.add_argument("--expert-replicas", type=int, default=0,
                   help="replica rows per expert-parallel rank for copies of hot experts")
    p.add_argument("--runlog")
    p.add_argument("--threads", type=int, help="torch threads per rank (default: OMP_NUM_THREADS or torch's)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    code = 0
    try:
        plan = Plan.load(args.plan)
        factory = _factory(args.model, json.loads(args.model_kwargs))
        cfg = TrainConfig(steps=args.steps, lr=args.lr, seed=args.seed, clip=args.clip, data=args.data,
                          eval_data=args.eval_data, eval_every=args.eval_every, export_hf=args.export_hf,
                          export_peft=args.export_peft,
                          checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                          keep_checkpoints=args.keep_checkpoints, runlog=args.runlog,
                          rebalance_every=args.rebalance_every, expert_replicas=args.expert_replicas,
                          progress=not args.no_progress)
        train(factory, plan, cfg)
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
