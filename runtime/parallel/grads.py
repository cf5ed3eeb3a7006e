"""Gradient norm and clipping over a parallelized model, as one process training on every rank's data sees them.

After FSDP2's reduction a rank holds a piece of each gradient: a shard over the data-parallel mesh, a tp shard of
a split projection, its own experts' rows. The pieces of one gradient across the world are copies of
`distinct` different pieces, so

    |g|^2 = sum over ranks of  sum over its pieces p of  |p|^2 / copies(p),     copies = (world / pp) / distinct,

where `distinct` multiplies the sizes of the mesh dimensions that shard the tensor (and ep for expert rows), and
world / pp ranks hold the stage a tensor belongs to. One all-reduce over the world (every stage) gives every rank
the same norm whatever the layout. Replica rows of hot experts (`runtime.parallel.rebalance`) hold copies of their
owners' summed gradients and are not counted.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from runtime.model_tree import moe_blocks
from runtime.parallel.mesh import ParallelMesh


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _distinct(t: torch.Tensor) -> int:
    """How many different pieces of the tensor `t` is one of (1 for a whole tensor)."""
    if not isinstance(t, DTensor):
        return 1
    # neither replicated nor partial: a shard (FSDP2 over a tp-split dimension shards it a second time, strided)
    return math.prod(t.device_mesh.size(i) for i, p in enumerate(t.placements)
                     if not (p.is_replicate() or p.is_partial()))


def _rows(grad: torch.Tensor, owned: int | None) -> torch.Tensor:
    """This rank's piece of `grad`, without rows at or past `owned` (replica rows) when that is given."""
    local = _local(grad)
    if owned is None:
        return local
    start = 0
    if isinstance(grad, DTensor):  # which rows of the whole stack this shard holds
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        start = compute_local_shape_and_global_offset(grad.shape, grad.device_mesh, grad.placements)[1][0]
    return local[:max(0, min(local.shape[0], owned - start))]


def grad_norm(model: nn.Module, mesh: ParallelMesh) -> torch.Tensor:
    """The global L2 norm of all gradients (collective: every rank calls it)."""
    from runtime.parallel.rebalance import owned_rows

    expert_ids = {id(p) for _, block in moe_blocks(model) if block.expert_parallel is not None
                  for p in block.experts.parameters()}
    owned = owned_rows(model)
    stage_ranks = mesh.world_size // mesh.plan.pp
    total = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.grad is None:
            continue
        distinct = _distinct(p.grad) * (mesh.ep if id(p) in expert_ids else 1)
        total += _rows(p.grad, owned.get(id(p))).double().pow(2).sum() * (distinct / stage_ranks)
    if mesh.dense is not None:
        dist.all_reduce(total)
    return total.sqrt().float()


def clip_grad_norm_(model: nn.Module, mesh: ParallelMesh, max_norm: float) -> torch.Tensor:
    """Scale all gradients so that their global norm is at most `max_norm`; returns the norm before."""
    total = grad_norm(model, mesh)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in model.parameters():
        if p.grad is not None:
            _local(p.grad).mul_(coef)
    return total
