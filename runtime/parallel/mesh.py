"""The device mesh of a plan: data-parallel replicate x shard for dense weights, an expert-parallel view for experts.

Expert parallelism is carved out of the data-parallel ranks (see `runtime.plan`). Ranks are laid out as

    (dp_replicate / er, er, dp_shard / es, es)      ep = er * es

with `es = ep` when ep divides dp_shard (the EP group lies inside one shard group, as in torchtitan), or
`es = dp_shard` when the EP group spans every shard group and part of the replicas. Dense weights see the
(dp_replicate, dp_shard) mesh; experts see (edp_replicate, edp_shard) = the ranks holding the same experts,
over which FSDP2 shards (and replicates) them; the `ep` dimension exchanges tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from runtime.plan import Plan


@dataclass
class ParallelMesh:
    plan: Plan
    dense: DeviceMesh | None  # ("dp_replicate", "dp_shard"); None in a single process
    experts: DeviceMesh | None  # ("edp_replicate", "edp_shard"); None without expert parallelism
    ep_group: dist.ProcessGroup | None
    ep_rank: int = 0

    @property
    def ep(self) -> int:
        return self.plan.ep

    @property
    def world_size(self) -> int:
        return self.plan.world_size


def _ep_split(plan: Plan) -> tuple[int, int]:
    """(er, es): how the EP group splits over the replicate and the shard dimensions."""
    ep, shard, dp = plan.ep, plan.dp_shard, plan.dp
    if shard % ep == 0:
        return 1, ep
    if ep % shard == 0 and dp % ep == 0:
        return ep // shard, shard
    raise ValueError(f"ep={ep} must divide dp_shard={shard}, or be a multiple of it dividing "
                     f"dp_replicate*dp_shard={dp}")


NOT_BUILT = {"tp": "tensor", "pp": "pipeline", "cp": "context"}  # degrees runtime.parallel does not lay out yet


def not_runnable(plan: Plan) -> list[str]:
    """Why runtime.parallel cannot lay out `plan` (empty when it can): the one answer the planner, the training
    loop and `build_mesh` all use."""
    out = list(plan.problems())
    out += [f"{kind} parallelism ({name} > 1) is not built in runtime.parallel yet"
            for name, kind in NOT_BUILT.items() if getattr(plan, name) != 1]
    if plan.ep > 1 and not out:
        try:
            _ep_split(plan)
        except ValueError as exc:
            out.append(str(exc))
    return out


def build_mesh(plan: Plan) -> ParallelMesh:
    """The meshes for `plan` on the initialised default process group (CPU/gloo or GPU/nccl)."""
    if why := not_runnable(plan):
        raise ValueError("; ".join(why))
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != plan.world_size:
        raise ValueError(f"the plan needs {plan.world_size} processes, this run has {world}")
    if world == 1:
        return ParallelMesh(plan, None, None, None)
    er, es = _ep_split(plan)
    device = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    ranks = torch.arange(world).view(plan.dp_replicate // er, er, plan.dp_shard // es, es)
    dense = DeviceMesh(device, ranks.reshape(plan.dp_replicate, plan.dp_shard),
                       mesh_dim_names=("dp_replicate", "dp_shard"))
    if plan.ep == 1:
        return ParallelMesh(plan, dense, None, None)
    by_expert = ranks.permute(0, 2, 1, 3).reshape(plan.dp_replicate // er, plan.dp_shard // es, plan.ep)
    full = DeviceMesh(device, by_expert, mesh_dim_names=("edp_replicate", "edp_shard", "ep"))
    return ParallelMesh(plan, dense, full["edp_replicate", "edp_shard"], full["ep"].get_group(),
                        full["ep"].get_local_rank())
