"""Expert parallelism: each rank of the EP group holds E/ep experts; tokens travel to them and back.

Per MoE block and step: the per-expert counts are exchanged first (equal splits, synchronous: the token
splits depend on them), then the tokens bound for other ranks leave with an asynchronous All-to-All of
variable splits while the first half of this rank's own tokens runs through its local experts. Received
tokens arrive grouped by source rank; they are regrouped by local expert, computed, and sent back the same
way while the second half of the own tokens runs. Backward mirrors it: each exchange's reverse is issued,
the matching half's gradients are computed, then it is waited on.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from runtime.moe.block import ModuleExperts
from runtime.moe.dispatch import Dispatch
from runtime.parallel import exchange
from runtime.parallel.exchange import CommTime, Exchange, Mark


class ExpertParallel:
    """The `MoEBlock.expert_parallel` hook: runs sorted tokens through experts spread over `group`."""

    def __init__(self, num_experts: int, group, *, overlap: bool = True, trace: list | None = None):
        self.num_experts = num_experts
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.local = num_experts // self.size
        self.overlap = overlap
        self.trace = trace  # a list to record issue / wait order into (tests and debugging)
        self.comm = CommTime()  # time blocked on exchanges, forward and backward; `comm.reset()` per step

    def _log(self, event: str) -> None:
        if self.trace is not None:
            self.trace.append(event)

    def __call__(self, experts: nn.Module, tokens: torch.Tensor, d: Dispatch,
                 scale: torch.Tensor | None) -> torch.Tensor:
        el, me = self.local, self.rank
        counts = d.counts.to(torch.int64)
        recv_counts = torch.empty_like(counts)
        start = time.perf_counter()
        dist.all_to_all_single(recv_counts, counts.contiguous(), group=self.group)
        self.comm.seconds += time.perf_counter() - start
        recv_counts = recv_counts.view(self.size, el)
        send = counts.view(self.size, el).sum(1).tolist()
        recv = recv_counts.sum(1).tolist()
        lo = sum(send[:me])
        hi = lo + send[me]
        # this rank's own tokens never enter the exchange
        send[me] = recv[me] = 0
        recv_counts[me] = 0

        own = counts[me * el:(me + 1) * el]
        # this rank's rows are split in two: the first part runs while the tokens travel out, the second
        # while the results travel back (without overlap all of it runs between the exchanges, unhidden)
        mid = lo + (hi - lo + 1) // 2 if self.overlap else hi
        dispatch = Exchange(send, recv, self.group, "dispatch", self.trace, self.comm)
        in_flight = exchange.start(torch.cat([tokens[:lo], tokens[hi:]]), dispatch)
        if not self.overlap:
            received = exchange.finish(in_flight, dispatch)
        first = self._local(experts, tokens, d, scale, own, lo, (lo, mid), "local_experts")
        if self.overlap:
            received = exchange.finish(in_flight, dispatch)

        remote_out = self._remote(experts, received, recv_counts)
        combine = Exchange(recv, send, self.group, "combine", self.trace, self.comm)
        in_flight = exchange.start(remote_out, combine)
        second = self._local(experts, tokens, d, scale, own, lo, (mid, hi), "local_experts_combine")
        returned = exchange.finish(in_flight, combine)
        if scale is not None:
            returned = returned * torch.cat([scale[:lo], scale[hi:]]).unsqueeze(-1).to(returned.dtype)
        return torch.cat([returned[:lo], first, second, returned[lo:]])

    def _local(self, experts: nn.Module, tokens: torch.Tensor, d: Dispatch, scale: torch.Tensor | None,
               own: torch.Tensor, base: int, rows: tuple[int, int], event: str) -> torch.Tensor:
        """Sorted rows [a, b) of this rank's own tokens, whose `own` per-expert counts start at row `base`."""
        a, b = rows
        end = base + torch.cumsum(own, 0)
        counts = end.clamp(a, b) - (end - own).clamp(a, b)
        self._log(event)
        part = Dispatch(order=d.order[a:b], expert_ids=d.expert_ids[a:b] - self.rank * self.local,
                        counts=counts, keep=None, top_k=d.top_k)
        y = experts(tokens[a:b], part, scale=None if scale is None else scale[a:b])
        return Mark.apply(y, self.trace, f"{event}_backward") if self.trace is not None else y

    def _remote(self, experts: nn.Module, received: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
        """Run rows grouped by (source rank, local expert) through the local experts, in received order."""
        ids = torch.arange(self.local, device=received.device).repeat(self.size)
        expert_ids = torch.repeat_interleave(ids, recv_counts.reshape(-1))
        order = torch.sort(expert_ids, stable=True).indices
        d = Dispatch(order=order, expert_ids=expert_ids[order], counts=recv_counts.sum(0), keep=None, top_k=1)
        y = experts(received.index_select(0, order), d, scale=None)
        return y.index_select(0, torch.argsort(order))


def shard_experts(experts: nn.Module, num_experts: int, rank: int, size: int) -> None:
    """Keep this rank's slice of every per-expert tensor of `experts` (stacks, biases, LoRA stacks).

    The slice becomes a new Parameter (not a view) so that the full stack can be freed and FSDP2 sees a
    plain tensor to shard over the ranks that hold the same experts."""
    if num_experts % size:
        raise ValueError(f"{num_experts} experts cannot be split over an expert-parallel group of {size}")
    local = num_experts // size
    lo = rank * local
    if isinstance(experts, ModuleExperts):
        experts.experts = nn.ModuleList(list(experts.experts)[lo:lo + local])
        experts.expert_shard = (rank, size, num_experts)
        return
    for name, p in list(experts.named_parameters(recurse=False)):
        if p.dim() == 0 or p.shape[0] < num_experts:
            continue
        setattr(experts, name, nn.Parameter(p.detach()[lo:lo + local].clone(), requires_grad=p.requires_grad))
    experts.experts = local  # rows computed (extra zero-expert rows are gone with the slice)
    experts.expert_shard = (rank, size, num_experts)  # read by checkpoint / adapter gathering
