"""The device mesh of a plan: data-parallel replicate x shard x tensor-parallel for dense weights, an
expert-parallel view for experts.

Expert parallelism is carved out of the data-parallel ranks (see `runtime.plan`). Ranks are laid out as

    (pp, dp_replicate / er, er, dp_shard * cp / es, es, tp)      ep = er * es

where the shard dimension holds dp_shard groups of cp ranks (context parallelism: the cp ranks of one group hold
segments of the same sequences, `cp_group`); FSDP2 shards dense weights over all dp_shard * cp of them.

tensor parallelism innermost (the ranks of a tp group are neighbours: one node's devices, where the all-reduce
after every split module is cheapest), pipeline stages outermost (one activation send per micro-batch crosses
them). The ranks of a tp group read the same data and compute the same experts; so do the stages of a pipeline.

A folded plan (MoE parallel folding, etp 1) counts the tp ranks as shard ranks for the experts: under sequence
parallelism each tp rank holds its own part of the sequence, so its MoE blocks route their own tokens and the EP
group may span tp ranks (ranks (pp, dp_replicate / er, er, dp_shard * cp * tp / es, es)).

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

from runtime.parallel.runnable import ep_split, not_runnable
from runtime.plan import Plan


@dataclass
class ParallelMesh:
    plan: Plan
    dense: DeviceMesh | None  # ("pp", "dp_replicate", "dp_shard", "tp"); None in a single process
    experts: DeviceMesh | None  # ("edp_replicate", "edp_shard"); None without expert parallelism
    ep_group: dist.ProcessGroup | None
    ep_rank: int = 0
    dp_rank: int = 0  # which data-parallel slice of each batch this rank reads (the same across tp and pp)
    pp_rank: int = 0  # this rank's pipeline stage
    cp_group: dist.ProcessGroup | None = None  # the ranks holding segments of the same sequences (cp > 1)

    @property
    def data_parallel(self) -> DeviceMesh | None:
        """The ("dp_replicate", "dp_shard") mesh FSDP2 shards and reduces over (None in a single process)."""
        return None if self.dense is None else self.dense["dp_replicate", "dp_shard"]

    @property
    def tp(self) -> DeviceMesh | None:
        """The tensor-parallel mesh (None without tensor parallelism)."""
        return None if self.dense is None or self.plan.tp == 1 else self.dense["tp"]

    @property
    def pp(self) -> DeviceMesh | None:
        """The pipeline mesh: this rank's position in each stage, across the stages (None without pipelining)."""
        return None if self.dense is None or self.plan.pp == 1 else self.dense["pp"]

    @property
    def ep(self) -> int:
        return self.plan.ep

    @property
    def world_size(self) -> int:
        return self.plan.world_size


def build_mesh(plan: Plan) -> ParallelMesh:
    """The meshes for `plan` on the initialised default process group (CPU/gloo or GPU/nccl)."""
    if why := not_runnable(plan):
        raise ValueError("; ".join(why))
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != plan.world_size:
        raise ValueError(f"the plan needs {plan.world_size} processes, this run has {world}")
    if world == 1:
        return ParallelMesh(plan, None, None, None)
    er, es = ep_split(plan)
    device = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    shard = plan.dp_shard * plan.cp  # FSDP2 shards over the cp ranks too (each holds different tokens)
    ranks = torch.arange(world).view(plan.pp, plan.dp_replicate, shard, plan.tp)
    dense = DeviceMesh(device, ranks,
                       mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
    where = {"dp_rank": dense["dp_replicate"].get_local_rank() * plan.dp_shard
             + dense["dp_shard"].get_local_rank() // plan.cp, "pp_rank": dense["pp"].get_local_rank()}
    if plan.cp > 1:  # cp innermost within the shard ranks: the ranks of one sequence
        by_sequence = DeviceMesh(device, ranks.reshape(plan.pp, plan.dp_replicate, plan.dp_shard, plan.cp, plan.tp),
                                 mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"))
        where["cp_group"] = by_sequence["cp"].get_group()
    if plan.ep == 1:
        return ParallelMesh(plan, dense, None, None, **where)
    if plan.folded:  # MoE parallel folding (etp 1): the tp ranks join the shard ranks, each routing its own tokens
        folded = ranks.reshape(plan.pp, plan.dp_replicate // er, er, shard * plan.tp // es, es)
        by_expert = folded.permute(0, 1, 3, 2, 4).reshape(plan.pp, plan.dp_replicate // er, shard * plan.tp // es,
                                                           plan.ep)
        full = DeviceMesh(device, by_expert, mesh_dim_names=("pp", "edp_replicate", "edp_shard", "ep"))
    else:  # experts are replicated over tp and live in one stage: each (stage, tp position) has its own expert mesh
        unfolded = ranks.reshape(plan.pp, plan.dp_replicate // er, er, shard // es, es, plan.tp)
        by_expert = unfolded.permute(0, 1, 3, 2, 4, 5).reshape(plan.pp, plan.dp_replicate // er, shard // es,
                                                              plan.ep, plan.tp)
        full = DeviceMesh(device, by_expert, mesh_dim_names=("pp", "edp_replicate", "edp_shard", "ep", "tp"))
    return ParallelMesh(plan, dense, full["edp_replicate", "edp_shard"], full["ep"].get_group(),
                        full["ep"].get_local_rank(), **where)
