"""Training sweep on this machine: real runs over world size, expert parallelism, micro-batch, sequence
length, LoRA, activation offload and model size, written as run logs (the throughput predictor's data).

World size 1 runs in this process; each larger world size is one torchrun launch whose ranks run their
configurations one after another in the same process group (a launch costs more than a short run). Every
configuration trains a few steps of an adapted catalogue model at twin scale, fp32, synthetic tokens,
through `runtime.train` exactly as `onboard train` does, and appends one run to the log.

    python bench/sweep.py [--out predictors/data/runlogs/cpu_sweep.jsonl] [--steps 5] [--only-world 2]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common  # bench/common.py: what the benches share

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "predictors" / "data" / "runlogs" / "cpu_sweep.jsonl"
MODELS = ("mixtral-8x7b", "qwen3-30b-a3b", "olmoe-1b-7b", "gpt-oss-120b")
SIZES = {"small": {"layers": 2, "width": 1}, "medium": {"layers": 4, "width": 2}, "large": {"layers": 4, "width": 4}}


def configurations() -> list[dict]:
    """The sweep: each entry a plan (as a dict), a model and a size. Deterministic order."""
    out = []

    def add(world_plan: dict, model: str, size: str, *, mb: int, seq: int, offload: str = "none",
            lora: bool = False, recompute: str = "none"):
        plan = {"micro_batch": mb, "seq_len": seq, "offload": offload, "recompute": recompute, "dtype": "fp32",
                **world_plan}
        if lora:
            plan["lora"] = {"rank": 8, "alpha": 16.0, "targets": ["attention", "experts"]}
        out.append({"model": model, "size": size, "plan": plan})

    one = {"dp_shard": 1}
    for model in MODELS:
        for size in ("small", "medium"):
            for mb, seq in ((1, 128), (4, 128), (2, 256)):
                for offload in ("none", "moe"):
                    add(one, model, size, mb=mb, seq=seq, offload=offload)
            add(one, model, size, mb=2, seq=128, lora=True)
            add(one, model, size, mb=2, seq=128, lora=True, offload="moe")
            add(one, model, size, mb=2, seq=128, recompute="full")
    for model in MODELS:
        for mb, seq in ((1, 128), (2, 256)):
            for offload in ("none", "moe"):
                add(one, model, "large", mb=mb, seq=seq, offload=offload)
    for model in MODELS:
        for ep in (1, 2):
            for lora in (False, True):
                add({"dp_shard": 2, "ep": ep}, model, "small", mb=2, seq=128, lora=lora)
        add({"dp_shard": 2, "ep": 2}, model, "medium", mb=2, seq=128)
        add({"dp_shard": 2}, model, "medium", mb=1, seq=256, offload="moe")
    for ep in (1, 2, 4):
        add({"dp_shard": 4, "ep": ep}, "mixtral-8x7b", "small", mb=1, seq=128)
    add({"dp_shard": 4, "ep": 4}, "mixtral-8x7b", "small", mb=1, seq=128, lora=True)
    add({"dp_replicate": 2, "dp_shard": 2, "ep": 2}, "mixtral-8x7b", "small", mb=1, seq=128)
    add({"dp_shard": 4, "ep": 2}, "qwen3-30b-a3b", "small", mb=1, seq=128, lora=True)
    add({"dp_shard": 4, "ep": 4}, "qwen3-30b-a3b", "medium", mb=1, seq=128)
    return out


def world_of(plan: dict) -> int:
    return plan.get("dp_replicate", 1) * plan.get("dp_shard", 1)


def run_one(entry: dict, bundles: dict, configs: dict, out: Path, steps: int) -> None:
    """One configuration through runtime.train (every rank calls it)."""
    from onboard.train.model import build_model
    from runtime.plan import Plan
    from runtime.train import TrainJob, train

    plan = Plan.from_dict(entry["plan"])
    key = f"{entry['model']}/{entry['size']}"
    # the machine is shared: the load average says how much the timings can be trusted
    meta = {"sweep": "cpu", "model_ref": entry["model"], "size": entry["size"], **SIZES[entry["size"]],
            "load_average": os.getloadavg()[0]}
    cfg = TrainJob(steps=steps, lr=1e-3, runlog=str(out), run_meta=meta, progress=False)
    train(lambda: build_model(bundles[entry["model"]], config=configs[key]), plan, cfg)
    gc.collect()


def worker(spec_path: str) -> None:
    """A torchrun rank: every configuration of one world size, in order."""
    import torch
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    dist.init_process_group("gloo")
    for entry in spec["entries"]:
        t = time.perf_counter()
        run_one(entry, spec["bundles"], spec["configs"], Path(spec["out"]), spec["steps"])
        if dist.get_rank() == 0:
            print(f"  world {dist.get_world_size()} {entry['model']} {entry['size']} {entry['plan']}: "
                  f"{time.perf_counter() - t:.1f}s", flush=True)
    dist.barrier()
    os._exit(0)  # as runtime.train does: gloo's teardown can abort a finished run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--steps", type=int, default=5, help="steps per configuration (the first is warm-up)")
    p.add_argument("--only-world", type=int, help="run only the configurations of this world size")
    # one thread per rank: on a shared, busy machine OpenMP threads that spin at barriers make steps 10-50x
    # slower and the timings meaningless (measured here: 0.07 s steps took 1-10 s with two threads each)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker)
        return
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # freed tensors leave RSS (per-run peaks)
    import torch
    from onboard.bundle.make import adapt
    from onboard.source import resolve
    from onboard.train.model import train_config

    entries = configurations()
    if args.only_world:
        entries = [e for e in entries if world_of(e["plan"]) == args.only_world]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="onboard-sweep-"))
    common.scratch_kernel_store(scratch / "kernels")
    bundles, configs = {}, {}
    for model in sorted({e["model"] for e in entries}):
        bundles[model] = str(scratch / model)
        adapt(resolve(model), Path(bundles[model]))
        for size, dims in SIZES.items():
            path = scratch / f"{model}-{size}.json"
            path.write_text(json.dumps(train_config(bundles[model], **dims)))
            configs[f"{model}/{size}"] = str(path)
    print(f"{len(entries)} configurations -> {out}", flush=True)
    start = time.perf_counter()
    for world in sorted({world_of(e["plan"]) for e in entries}):
        group = [e for e in entries if world_of(e["plan"]) == world]
        threads = args.threads
        if world == 1:
            torch.set_num_threads(threads)
            for entry in group:
                t = time.perf_counter()
                run_one(entry, bundles, configs, out, args.steps)
                print(f"  world 1 {entry['model']} {entry['size']} {entry['plan']}: {time.perf_counter() - t:.1f}s",
                      flush=True)
            continue
        spec = scratch / f"world-{world}.json"
        spec.write_text(json.dumps({"entries": group, "bundles": bundles, "configs": configs, "out": str(out),
                                    "steps": args.steps, "threads": threads}))
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               str(Path(__file__).resolve()), "--worker", str(spec)]
        subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    print(f"done in {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
