"""Full tensors out of a parallelized model (checkpoints, adapters) and back in.

Under FSDP2 parameters are DTensors sharded over the data-parallel mesh; under expert parallelism an expert
module holds only its rank's rows of each stack. Saving gathers both; loading slices a full tensor back to
what this rank holds. Both are collective: every rank calls them with the same keys.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from runtime.model_tree import moe_blocks


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def gather_experts(model: nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """A full state dict on every rank: FSDP2 shards gathered and expert-parallel slices concatenated
    (per-module experts renumbered to their global index). Collective: every rank must call it."""
    return dict(iter_full(model, state if state is not None else model.state_dict()))


def iter_full(model: nn.Module, state: dict[str, torch.Tensor]):
    """(full-model key, full tensor) for each entry of `state` (this rank's, e.g. `model.state_dict()`), one key
    at a time, so that a writer holds one full tensor at once: FSDP2 shards gathered, expert-parallel slices
    concatenated, per-module experts under their global index (one entry each). Collective: every rank iterates
    the same keys in the same order."""
    groups = {}
    for name, block in moe_blocks(model):
        shard = getattr(block.experts, "expert_shard", None)
        if shard is not None and block.expert_parallel is not None:
            groups[f"{name}.experts." if name else "experts."] = (shard, block.expert_parallel)
    for key, value in state.items():
        value = _full(value)
        prefix = next((p for p in groups if key.startswith(p)), None)
        if prefix is None:
            yield key, value
            continue
        (_, size, total), ep = groups[prefix]
        local = total // size
        rest = key[len(prefix):]
        parts = rest.split(".")
        pieces = [torch.empty_like(value) for _ in range(size)]
        dist.all_gather(pieces, value.contiguous(), group=ep.group)
        if parts[0] == "experts" and len(parts) > 2 and parts[1].isdigit():  # ModuleExperts: one key each
            for r, piece in enumerate(pieces):
                yield prefix + ".".join(["experts", str(r * local + int(parts[1])), *parts[2:]]), piece
        elif "." not in rest and value.dim() and value.shape[0] == ep.placement.slots:  # a stack sliced by EP
            yield key, _logical_rows(pieces, ep.placement)
        else:
            yield key, value


def _logical_rows(pieces: list[torch.Tensor], placement) -> torch.Tensor:
    """The EP ranks' stacks as one stack in expert order: owned rows where the placement put them, replicas
    (copies) left out."""
    if placement.is_contiguous and not placement.spare:
        return torch.cat(pieces)
    full = pieces[0].new_empty(placement.experts, *pieces[0].shape[1:])
    for rank, piece in enumerate(pieces):
        full[list(placement.owners[rank])] = piece[:placement.local]
    return full


def _expert_slices(model: nn.Module) -> dict[str, tuple[int, int, list]]:
    """Key prefix of each expert-parallel experts module -> (first expert, experts) of the static layout and the
    expert each of this rank's stack rows holds now (None: an unused replica row)."""
    slices = {}
    for name, block in moe_blocks(model):
        shard = getattr(block.experts, "expert_shard", None)
        if shard is not None:
            rank, size, total = shard
            rows = block.expert_parallel.placement.rows(rank)
            slices[f"{name}.experts." if name else "experts."] = (rank * (total // size), total // size, rows)
    return slices


def _local_view(state: dict[str, torch.Tensor], slices: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    """Full-model keys and tensors -> this rank's: expert stacks cut to its rows, per-module experts
    renumbered from their global index (and other ranks' experts left out)."""
    out = {}
    for key, value in state.items():
        for prefix, (lo, n, rows) in slices.items():
            if not key.startswith(prefix):
                continue
            parts = key[len(prefix):].split(".")
            if parts[0] == "experts" and len(parts) > 2 and parts[1].isdigit():
                index = int(parts[1]) - lo
                key = prefix + ".".join(["experts", str(index), *parts[2:]]) if 0 <= index < n else None
            elif len(parts) == 1 and value.dim():
                value = value[lo:lo + n] if rows == list(range(lo, lo + n)) else torch.stack(
                    [value[e] if e is not None else value.new_zeros(value.shape[1:]) for e in rows])
            break
        if key is not None:
            out[key] = value
    return out


class LocalCopier:
    """Copies full tensors, a few at a time, into this rank's part of a parallelized model (what
    `load_full_state` does for a whole state dict at once; a streaming loader calls it group by group).
    Every rank holds the same full tensors, so each takes its shard without communication."""

    def __init__(self, model: nn.Module):
        self.own = model.state_dict()
        self.slices = _expert_slices(model)

    def expert_rows(self, key: str) -> tuple[int, int] | None:
        """(first expert, experts) of the expert stack at `key` this rank holds under expert parallelism (None: not
        such a stack)."""
        for prefix, (lo, n, _) in self.slices.items():
            if key.startswith(prefix) and "." not in key[len(prefix):]:
                return lo, n
        return None

    def rows(self, key: str, length: int) -> tuple[int, int] | None:
        """[start, stop) of dim 0 of a tensor of `length` rows this rank's part of `key` is (FSDP2's even split
        over a 1-D mesh; the tensor as this rank's expert slice has it); None where the part is not such a
        block of rows (replicated, or sharded over several mesh dimensions)."""
        from torch.distributed.tensor import Shard

        target = self.own[key]
        if not isinstance(target, DTensor):
            return (0, length) if target.shape[0] == length else None
        if target.device_mesh.ndim != 1 or tuple(target.placements) != (Shard(0),) or target.shape[0] != length:
            return None
        size, index = target.device_mesh.size(), target.device_mesh.get_local_rank()
        chunk = -(-length // size)
        start = min(index * chunk, length)
        stop = min(start + chunk, length)
        return (start, stop) if target.to_local().shape[0] == stop - start else None

    def copy_rows(self, key: str, value: torch.Tensor) -> None:
        """Copy this rank's rows (`rows`) of `key`, read as they are, into the model."""
        target = self.own[key]
        local = target.to_local() if isinstance(target, DTensor) else target
        with torch.no_grad():
            local.copy_(value.to(local.dtype))

    def copy(self, full: dict[str, torch.Tensor], *, expert_local: bool = False) -> list[str]:
        """Copy `full` (full-model keys) into the model; returns the local keys written. ValueError for a key the
        model does not have or a shape that does not fit. `expert_local`: `full` is this rank's view already (its
        expert stacks hold this rank's experts only, per-module experts under local indices)."""
        local = dict(full) if expert_local else _local_view(full, self.slices)
        unexpected = sorted(set(local) - set(self.own))
        if unexpected:
            raise ValueError(f"not in the model: {', '.join(unexpected[:3])}")
        with torch.no_grad():
            for key in sorted(local):
                value, target = local[key], self.own[key]
                if expert_local and self.expert_rows(key) and value.shape[0] < target.shape[0]:
                    # this rank's experts, read into a stack with replica rows (unused until a placement)
                    value = torch.cat([value, value.new_zeros(target.shape[0] - value.shape[0], *value.shape[1:])])
                if tuple(value.shape) != tuple(target.shape):
                    raise ValueError(f"{key}: shape {tuple(value.shape)} does not fit {tuple(target.shape)}")
                value = value.to(target.dtype)
                if isinstance(target, DTensor):
                    shard = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
                    target.to_local().copy_(shard.to_local())
                else:
                    target.copy_(value)
        return sorted(local)


def load_full_state(model: nn.Module, state: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    """Copy full tensors (as `gather_experts` returns them) into a parallelized model, each rank keeping its
    shard. With `strict`, the keys must be exactly the model's (state-dict keys of parameters and buffers)."""
    copier = LocalCopier(model)
    local = _local_view(state, copier.slices)
    missing, unexpected = sorted(set(copier.own) - set(local)), sorted(set(local) - set(copier.own))
    if unexpected or (strict and missing):
        raise ValueError(f"state does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    copier.copy(local, expert_local=True)  # already this rank's view
