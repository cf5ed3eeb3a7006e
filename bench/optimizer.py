"""The AdamW step on FSDP2 parameters: PyTorch's per-tensor loop against the runtime's foreach AdamW.

A tiny Mixtral (the catalogue config at hidden 64, 8 experts) is wrapped with FSDP2 per decoder layer on a one-rank
gloo group, so every parameter is a DTensor and each operator of the update pays DTensor's dispatch; the model's
forward and backward run between steps as in training. Prints the median step of each and their ratio: what
`runtime.train.loop` gains by `runtime.train.optimizer.AdamW` (the loop used `foreach=False`, since PyTorch's own
foreach AdamW refuses parameter lists that mix plain tensors, DTensors and meshes).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  bench/common.py


def model(layers: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("mixtral", hidden_size=64, intermediate_size=128, num_local_experts=8,
                                  num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
                                  num_hidden_layers=layers, vocab_size=512)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def optimizer_steps(make, layers: int, repeats: int) -> tuple[float, int]:
    """Median seconds of `optimizer.step()` and the number of parameter tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    net = model(layers)
    mesh = init_device_mesh("cpu", (1,))
    for layer in net.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    params = list(net.parameters())
    opt = make(params)
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    times = []
    for i in range(repeats + 3):
        net(input_ids=ids, labels=ids).loss.backward()
        t0 = time.perf_counter()
        opt.step()
        if i >= 3:
            times.append(time.perf_counter() - t0)
        opt.zero_grad()
    return statistics.median(times), len(params)


def main():
    parser = common.parser(__doc__, layers=4, repeats=20, threads=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import torch.distributed as dist

    from runtime.train.optimizer import AdamW

    with tempfile.TemporaryDirectory() as scratch:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(scratch, "store"), 1), rank=0, world_size=1)
        try:
            loop, tensors = optimizer_steps(lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False), args.layers,
                                            args.repeats)
            ours, _ = optimizer_steps(lambda ps: AdamW(ps, lr=1e-3), args.layers, args.repeats)
        finally:
            dist.destroy_process_group()
    print(f"AdamW step over {tensors} FSDP2 (DTensor) parameter tensors, {args.layers} layers, {args.threads} thread, "
          f"load average {os.getloadavg()[0]:.1f}: per-tensor loop {loop * 1e3:.1f} ms, runtime foreach "
          f"{ours * 1e3:.1f} ms, {loop / ours:.2f}x")
    print(json.dumps({"tensors": tensors, "loop_ms": round(loop * 1e3, 2), "foreach_ms": round(ours * 1e3, 2),
                      "ratio": round(loop / ours, 2)}))


if __name__ == "__main__":
    main()
