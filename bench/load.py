"""Sharded loading of released weights: peak resident memory per rank at world 1, 2 and 4, against the weights' size.

A Mixtral-shaped model (`--hidden`, `--layers`, 8 experts, fp32) is saved with `save_pretrained` in 64 MB shards
(transformers writes each expert's tensors apart, as released checkpoints are), adapted into a bundle, then
loaded by `world` gloo processes exactly as `onboard train --weights` loads it: built on the meta device,
adapted, parallelised (FSDP2 over all ranks, expert parallelism over all ranks), allocated, and read group by
group (`runtime.train.weights`). Each rank reports how much its peak resident set grew from just before
allocation to the end of loading, and the bytes of the shards it holds; the target is about 1/world of the
weights plus a bounded buffer (one group: the largest, one layer's expert stack, read in full by every rank).

    python bench/load.py [--hidden 512] [--layers 8]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import common  # bench/common.py: the benches' shared command line

EXPERTS = 8


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def worker(folder: Path) -> None:
    """One rank (under torchrun): load, then print this rank's figures as one JSON line."""
    import torch
    import torch.distributed as dist

    from onboard.train.model import build_model
    from runtime.parallel import build_mesh, parallelize
    from runtime.plan import Plan

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    plan = Plan(dp_shard=world, ep=world, dtype="fp32", seq_len=16)
    model, _, pretrained = build_model(folder / "bundle", weights=str(folder / "model"))
    model = parallelize(model, plan, build_mesh(plan)) if world > 1 else model
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # peak resident set := current
    before = _status_kib("VmRSS:")
    model.to_empty(device="cpu")
    loaded = pretrained.load(model)
    peak = _status_kib("VmHWM:")
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
                for p in model.parameters())
    figures = torch.tensor([peak - before, local // 1024], dtype=torch.float64)
    gathered = [torch.zeros_like(figures) for _ in range(world)]
    dist.all_gather(gathered, figures)
    if rank == 0:
        print(json.dumps({"world": world, "growth_kib": [int(g[0]) for g in gathered],
                          "local_kib": [int(g[1]) for g in gathered], "weights_bytes": loaded["bytes"],
                          "largest_group_bytes": loaded["largest_group_bytes"]}))
    dist.barrier()
    # tearing the gloo group down sometimes aborts a finished process (runtime/train/__main__.py says more)
    sys.stdout.flush()
    os._exit(0)


def prepare(folder: Path, hidden: int, layers: int) -> int:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    from onboard.bundle.make import adapt
    from onboard.source import resolve

    config = MixtralConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                           num_attention_heads=8, num_key_value_heads=4, num_local_experts=EXPERTS,
                           num_experts_per_tok=2, vocab_size=8192, max_position_embeddings=256)
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    model.save_pretrained(folder / "model", max_shard_size="64MB")
    del model
    adapt(resolve(str(folder / "model")), folder / "bundle")
    return sum(p.stat().st_size for p in (folder / "model").glob("*.safetensors"))


def main() -> None:
    import subprocess

    args = common.parser(__doc__, hidden=512, layers=8).parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-load-") as scratch:
        folder = Path(scratch)
        common.scratch_kernel_store(folder / "kernels")
        size = prepare(folder, args.hidden, args.layers)
        print(f"weights {size / 2**20:.0f} MiB (fp32, {args.layers} layers, hidden {args.hidden}, {EXPERTS} experts); "
              f"peak resident growth per rank while allocating and loading")
        for world in (1, 2, 4):
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
                   "MALLOC_MMAP_THRESHOLD_": "65536"}  # freed tensors leave the resident set (as bench/offload.py)
            done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   f"--nproc-per-node={world}", __file__, "--worker", str(folder)],
                                  capture_output=True, text=True, env=env, check=False)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode or not lines:
                raise SystemExit(f"world {world} failed: {done.stderr.strip()[-2000:]}")
            r = json.loads(lines[-1])
            growth = max(r["growth_kib"]) * 1024
            local = max(r["local_kib"]) * 1024
            print(f"world {world}: peak growth {growth / 2**20:7.1f} MiB = {growth / size:.2f}x the weights "
                  f"(its shards {local / 2**20:.1f} MiB = {local / size:.2f}x; largest group "
                  f"{r['largest_group_bytes'] / 2**20:.1f} MiB)")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]))
    else:
        main()
