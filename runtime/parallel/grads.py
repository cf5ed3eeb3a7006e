"""Gradient norm and clipping over a parallelized model, as one process training on every rank's data sees them.

After FSDP2's reduction each rank holds a shard of every dense gradient (the same shard on each replica) and
a shard of its own experts' gradients. Squares are summed locally, then over the shard group (dense) or over
the expert shard group and the EP group (experts); replicas hold copies and are not summed again.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from runtime.model_tree import moe_blocks
from runtime.parallel.mesh import ParallelMesh


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def grad_norm(model: nn.Module, mesh: ParallelMesh) -> torch.Tensor:
    """The global L2 norm of all gradients (collective: every rank calls it)."""
    expert_ids = {id(p) for _, block in moe_blocks(model) if block.expert_parallel is not None
                  for p in block.experts.parameters()}
    squares = {True: torch.zeros((), dtype=torch.float64), False: torch.zeros((), dtype=torch.float64)}
    for p in model.parameters():
        if p.grad is not None:
            squares[id(p) in expert_ids] += _local(p.grad).double().pow(2).sum()
    dense, experts = squares[False], squares[True]
    if mesh.dense is not None:
        dist.all_reduce(dense, group=mesh.dense.get_group("dp_shard"))
    if mesh.experts is not None:
        dist.all_reduce(experts, group=mesh.experts.get_group("edp_shard"))
        dist.all_reduce(experts, group=mesh.ep_group)
    return (dense + experts).sqrt().float()


def clip_grad_norm_(model: nn.Module, mesh: ParallelMesh, max_norm: float) -> torch.Tensor:
    """Scale all gradients so that their global norm is at most `max_norm`; returns the norm before."""
    total = grad_norm(model, mesh)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in model.parameters():
        if p.grad is not None:
            _local(p.grad).mul_(coef)
    return total
