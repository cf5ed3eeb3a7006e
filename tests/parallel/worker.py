"""One rank of a multi-process training check: load the pickled adapted model, parallelize it, train.

Usage: python worker.py <job.json>, with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set. The job names
the pickled model, the plan, the batch (one row per rank) and where rank 0 writes its results: the mean
loss of every step, the first step's gradients and, with LoRA, the adapters, all as full tensors.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)


def init_lora(model, seed: int) -> None:
    """Random adapters (B included) so every adapter gets a gradient; same values on every rank."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.requires_grad:
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo", timeout=timedelta(seconds=job.get("timeout", 120)))
    from runtime.lora import apply_lora, lora_state_dict
    from runtime.parallel import build_mesh, gather_experts, parallelize
    from runtime.plan import Plan

    rank = dist.get_rank()
    plan = Plan.from_dict(job["plan"])
    model = torch.load(job["model"], weights_only=False)
    if plan.lora is not None:
        apply_lora(model, plan.lora)
        init_lora(model, job["lora_seed"])
    trace: list = []
    parallelize(model, plan, build_mesh(plan), trace=trace)
    batch = torch.load(job["batch"])
    ids = batch[rank * plan.micro_batch:(rank + 1) * plan.micro_batch]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=job["lr"])
    losses, grads = [], None
    for step in range(job["steps"]):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
        if step == 0:
            grads = gather_experts(model, {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
    adapters = lora_state_dict(model) if plan.lora is not None else None
    if rank == 0:
        torch.save({"losses": losses, "grads": grads, "trace": trace, "adapters": adapters}, job["out"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
