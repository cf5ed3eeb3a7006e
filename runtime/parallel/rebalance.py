"""Rebalancing experts while training: move them between expert-parallel ranks, keep their replicas equal.

`apply_placement` lays a block's experts out as a new `runtime.moe.placement.Placement`: every row whose expert
changes takes that expert's parameters and optimizer state (AdamW's moments) from the rank that owned it, through
one all-reduce over the EP group per tensor of just the rows that move (every rank computes the same placement
from the same all-reduced counts, so each knows what moves without asking). Replica rows get the owner's
values and moments, so owner and replicas start equal.

`sum_replica_grads` keeps them equal: after backward, each replicated expert's gradient is the sum of its copies'
gradients (each computed its share of the expert's tokens), written to every copy. Owner and replicas then take
the same optimizer step from the same state, and the sum is the gradient the expert would have had unreplicated;
the gradient norm counts owned rows only (`owned_rows`). So a placement changes where tokens are computed and
nothing else.

Parameters sharded by FSDP2 over the ranks that hold the same experts are DTensors: rows are moved on the full
tensor (gathered over that mesh) and each rank keeps its shard of the result.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from runtime.model_tree import moe_blocks
from runtime.moe.placement import Placement
from runtime.parallel.expert import per_expert


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def _write(target: torch.Tensor, full: torch.Tensor) -> None:
    if isinstance(target, DTensor):  # every rank holds the same full tensor: each keeps its shard
        shard = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(shard.to_local())
    else:
        target.copy_(full)


def _stacks(block: nn.Module) -> list[nn.Parameter]:
    ep = block.expert_parallel
    return [getattr(block.experts, name) for name in per_expert(block.experts, ep.local)]


def _moments(optimizer: torch.optim.Optimizer | None, p: torch.Tensor, group) -> list[torch.Tensor]:
    """`p`'s optimizer state tensors shaped like it (AdamW's moments), on every rank of `group` or none: a rank
    without state (no step taken yet) must not leave the others waiting in a collective."""
    state = optimizer.state.get(p, {}) if optimizer is not None else {}
    tensors = [state[k] for k in sorted(state) if isinstance(state[k], torch.Tensor) and state[k].shape == p.shape]
    present = torch.tensor([len(tensors)], dtype=torch.int64)
    dist.all_reduce(present, op=dist.ReduceOp.MIN, group=group)
    return tensors if int(present) == len(tensors) else []


@torch.no_grad()
def apply_placement(block: nn.Module, placement: Placement, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Lay `block`'s experts out as `placement`, moving rows (parameters and optimizer state); returns how many
    rows of this rank changed. Collective over the block's EP group."""
    ep = block.expert_parallel
    old = ep.placement
    if placement == old:
        return 0
    if placement.spare != old.spare:
        raise ValueError(f"the experts have {old.spare} replica rows per rank, the placement {placement.spare}")
    before, after = old.rows(ep.rank), placement.rows(ep.rank)
    # the experts some row of some rank receives: identical on every rank, so the collectives match
    moving = sorted({e for r in range(placement.ep) for e, was in zip(placement.rows(r), old.rows(r))
                     if e is not None and e != was})
    index = {e: i for i, e in enumerate(moving)}
    source = old.owner_of()
    changed = sum(e != was for e, was in zip(after, before))
    for p in _stacks(block):
        for t in [p, *_moments(optimizer, p, ep.group)]:
            full = _full(t)
            buffer = full.new_zeros(len(moving), *full.shape[1:])
            for e in moving:
                rank, row = source[e]
                if rank == ep.rank:
                    buffer[index[e]] = full[row]
            if moving:
                dist.all_reduce(buffer, group=ep.group)
            for row, (e, was) in enumerate(zip(after, before)):
                if e != was:
                    full[row] = buffer[index[e]] if e is not None else 0
            _write(t, full)
    ep.place(placement)
    return changed


@torch.no_grad()
def sum_replica_grads(model: nn.Module) -> None:
    """Each replicated expert's gradient summed over its copies, on every copy: one all-reduce per MoE block of
    just the replicated experts' rows (every per-expert tensor's, side by side)."""
    for _, block in moe_blocks(model):
        ep = block.expert_parallel
        if ep is None or not ep.placement.spare:
            continue
        copies = ep.placement.copies()
        replicated = [e for e, c in enumerate(copies) if len(c) > 1]
        if not replicated:
            continue
        # this rank's rows that hold a replicated expert, and which of the replicated experts each holds
        mine = [(row, i) for i, e in enumerate(replicated) for rank, row in copies[e] if rank == ep.rank]
        rows = torch.tensor([row for row, _ in mine], dtype=torch.int64)
        which = torch.tensor([i for _, i in mine], dtype=torch.int64)
        grads = []
        for p in _stacks(block):
            if p.grad is None:
                raise RuntimeError("an expert stack has no gradient: its replicas cannot be summed")
            grads.append((p.grad, _full(p.grad) if isinstance(p.grad, DTensor) else p.grad))
        pieces = [full.index_select(0, rows).flatten(1) for _, full in grads]
        widths = [piece.shape[1] for piece in pieces]
        total = pieces[0].new_zeros(len(replicated), sum(widths))
        total.index_add_(0, which, torch.cat(pieces, dim=1))
        dist.all_reduce(total, group=ep.group)
        for (grad, full), summed in zip(grads, total.index_select(0, which).split(widths, dim=1)):
            full.index_copy_(0, rows, summed.reshape(len(mine), *full.shape[1:]).to(full.dtype))
            if full is not grad:
                _write(grad, full)


def owned_rows(model: nn.Module) -> dict[int, int]:
    """id(parameter) -> its owned rows (the rest are replica rows) for expert stacks that have replica rows."""
    out = {}
    for _, block in moe_blocks(model):
        ep = block.expert_parallel
        if ep is not None and ep.placement.spare:
            out.update({id(p): ep.placement.local for p in _stacks(block)})
    return out
