"""Expert parallelism: each rank of the EP group holds E/ep experts; tokens travel to them and back.

Per MoE block and step: the per-expert counts are exchanged first (equal splits, synchronous: the token
splits depend on them), then the tokens bound for other ranks leave with an asynchronous All-to-All of
variable splits while the first half of this rank's own tokens runs through its local experts. Received
tokens arrive grouped by source rank; they are regrouped by local expert, computed, and sent back the same
way while the second half of the own tokens runs. Backward mirrors it: each exchange's reverse is issued,
the matching half's gradients are computed, then it is waited on.

Where experts live is a `runtime.moe.placement.Placement`: each rank's stacks hold its owned experts' rows and
`spare` replica rows (copies of hot experts owned elsewhere). The exchange works on physical rows (rank * rows
per rank + row): a token routed to expert e goes to one of e's copies, the i-th of e's tokens on this rank to
copy i mod copies(e), so each copy computes an even share. With the static layout (contiguous, no replicas) the
logical expert is the physical row and nothing is remapped.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from runtime.moe.block import ModuleExperts
from runtime.moe.dispatch import Dispatch
from runtime.moe.placement import Placement
from runtime.parallel import exchange
from runtime.parallel.exchange import CommTime, Exchange, Mark


class ExpertParallel:
    """The `MoEBlock.expert_parallel` hook: runs sorted tokens through experts spread over `group`."""

    def __init__(self, num_experts: int, group, *, overlap: bool = True, trace: list | None = None,
                 spare: int = 0):
        self.num_experts = num_experts
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.overlap = overlap
        self.trace = trace  # a list to record issue / wait order into (tests and debugging)
        self.comm = CommTime()  # time blocked on exchanges, forward and backward; `comm.reset()` per step
        self.rows = 0  # token rows this rank's experts computed in the last call (its load)
        self.place(Placement.contiguous(num_experts, self.size, spare))

    def place(self, placement: Placement) -> None:
        """Route by `placement` from now on (the rows must already hold what it says: `runtime.parallel.rebalance`
        moves them)."""
        if placement.experts != self.num_experts or placement.ep != self.size:
            raise ValueError(f"a placement of {placement.experts} experts on {placement.ep} ranks does not fit "
                             f"{self.num_experts} experts on {self.size}")
        if getattr(self, "placement", None) is not None and placement.spare != self.placement.spare:
            raise ValueError(f"the experts have {self.placement.spare} replica rows per rank, the placement "
                             f"{placement.spare}")
        self.placement = placement
        self.local = placement.slots  # rows per rank: owned, then replicas
        self.remap = None
        if not placement.is_contiguous or placement.spare:
            copies = placement.copies()
            table = torch.zeros(self.num_experts, max(len(c) for c in copies), dtype=torch.int64)
            for e, rows in enumerate(copies):
                table[e, :len(rows)] = torch.tensor([rank * self.local + row for rank, row in rows])
            self.remap = (table, torch.tensor([len(c) for c in copies], dtype=torch.int64))

    def _physical(self, d: Dispatch) -> tuple[Dispatch, torch.Tensor]:
        """`d` (sorted by expert) re-sorted by physical row, and the permutation from `d`'s order to it."""
        table, copies = (t.to(d.expert_ids.device) for t in self.remap)
        logical = d.expert_ids
        starts = torch.cumsum(d.counts, 0) - d.counts
        ordinal = torch.arange(logical.numel(), device=logical.device) - starts.index_select(0, logical)
        rows = table[logical, ordinal % copies.index_select(0, logical)]
        perm = torch.sort(rows, stable=True).indices
        counts = torch.bincount(rows, minlength=self.size * self.local)
        return Dispatch(order=d.order.index_select(0, perm), expert_ids=rows.index_select(0, perm), counts=counts,
                        keep=None, top_k=d.top_k), perm

    def _log(self, event: str) -> None:
        if self.trace is not None:
            self.trace.append(event)

    def __call__(self, experts: nn.Module, tokens: torch.Tensor, d: Dispatch,
                 scale: torch.Tensor | None) -> torch.Tensor:
        if self.remap is None:
            return self._exchange(experts, tokens, d, scale)
        d, perm = self._physical(d)
        out = self._exchange(experts, tokens.index_select(0, perm), d,
                             None if scale is None else scale.index_select(0, perm))
        return out.index_select(0, torch.argsort(perm))

    def _exchange(self, experts: nn.Module, tokens: torch.Tensor, d: Dispatch,
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
        self.rows = hi - lo + sum(recv)

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


def per_expert(experts: nn.Module, rows: int) -> list[str]:
    """Names of the per-expert tensors of a stacked experts module (stacks, biases, LoRA stacks): those with
    `rows` or more rows (stacks may carry unused rows for zero experts)."""
    return [name for name, p in experts.named_parameters(recurse=False) if p.dim() and p.shape[0] >= rows]


def shard_experts(experts: nn.Module, num_experts: int, rank: int, size: int, spare: int = 0) -> None:
    """Keep this rank's slice of every per-expert tensor of `experts` (stacks, biases, LoRA stacks), plus `spare`
    replica rows (zero until a placement copies hot experts into them).

    The slice becomes a new Parameter (not a view) so that the full stack can be freed and FSDP2 sees a
    plain tensor to shard over the ranks that hold the same experts."""
    if num_experts % size:
        raise ValueError(f"{num_experts} experts cannot be split over an expert-parallel group of {size}")
    local = num_experts // size
    lo = rank * local
    if isinstance(experts, ModuleExperts):
        if spare:
            raise ValueError("replicas of hot experts need experts stored as stacks; these are one module each")
        experts.experts = nn.ModuleList(list(experts.experts)[lo:lo + local])
        experts.expert_shard = (rank, size, num_experts)
        return
    flat = [n for n in getattr(experts, "STACKS", ()) if getattr(experts, n, None) is not None
            and getattr(experts, n).dim() == 2]
    if flat:  # the slices, their gathering and replica rows all cut a stack's first dim by expert
        raise ValueError(f"expert parallelism needs (experts, rows, cols) stacks; these experts keep "
                         f"{', '.join(flat)} flat, (experts x rows, cols) (DBRX's layout): run them with ep 1")
    for name in per_expert(experts, num_experts):
        p = getattr(experts, name)
        rows = p.detach()[lo:lo + local].clone()
        if spare:
            rows = torch.cat([rows, rows.new_zeros(spare, *rows.shape[1:])])
        setattr(experts, name, nn.Parameter(rows, requires_grad=p.requires_grad))
    experts.experts = local + spare  # rows computed (extra zero-expert rows are gone with the slice)
    experts.expert_shard = (rank, size, num_experts)  # read by checkpoint / adapter gathering
