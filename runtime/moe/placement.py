"""Where each routed expert lives on the expert-parallel ranks, and how to choose that from measured load.

A placement gives every EP rank `E / ep` experts it owns (their parameters and optimizer state live there) and
up to `spare` replica rows holding copies of hot experts owned elsewhere. Tokens routed to an expert are split
evenly over its copies (the owner and its replicas), so with `n_e` copies of expert e receiving `c_e` tokens,

    load(rank) = sum over the copies of e on `rank` of  c_e / n_e,

and the step waits for the busiest rank: imbalance = max(load) / mean(load). Copies compute the same function
(their rows are equal), and their gradients are summed before the optimizer step, so a placement changes where
tokens are computed and nothing else.

`place` chooses a placement from per-expert token counts: owners by longest-processing-time bin packing with
`E / ep` experts per rank (heaviest expert first, onto the least-loaded rank with room: cold experts end up
together on the ranks that took hot ones), then replicas greedily: the busiest rank's heaviest expert gets copies
on the least-loaded ranks with a free replica row (as few as lower the busiest load of all), while that is
possible. Pure Python and deterministic: every rank computes the same placement from the same (all-reduced) counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    experts: int
    owners: tuple[tuple[int, ...], ...]  # per EP rank: the experts whose rows it owns, in row order
    replicas: tuple[tuple[int, ...], ...]  # per EP rank: the experts its replica rows copy, in row order
    spare: int = 0  # replica rows per rank (the memory budget, in experts); unused rows hold no expert

    @classmethod
    def contiguous(cls, experts: int, ep: int, spare: int = 0) -> Placement:
        """The static layout: rank r owns experts [r E/ep, (r+1) E/ep), no replicas."""
        if ep < 1 or experts % ep:
            raise ValueError(f"{experts} experts cannot be split over an expert-parallel group of {ep}")
        local = experts // ep
        return cls(experts, tuple(tuple(range(r * local, (r + 1) * local)) for r in range(ep)),
                   tuple(() for _ in range(ep)), spare)

    @property
    def ep(self) -> int:
        return len(self.owners)

    @property
    def local(self) -> int:
        """Owned rows per rank."""
        return self.experts // self.ep

    @property
    def slots(self) -> int:
        """Rows per rank: owned and replica."""
        return self.local + self.spare

    @property
    def is_contiguous(self) -> bool:
        return self == Placement.contiguous(self.experts, self.ep, self.spare)

    def copies(self) -> list[list[tuple[int, int]]]:
        """Per expert: its (rank, row) copies, the owner first."""
        out: list[list[tuple[int, int]]] = [[] for _ in range(self.experts)]
        for rank, owned in enumerate(self.owners):
            for row, e in enumerate(owned):
                out[e].append((rank, row))
        for rank, copied in enumerate(self.replicas):
            for k, e in enumerate(copied):
                out[e].append((rank, self.local + k))
        return out

    def rows(self, rank: int) -> list[int | None]:
        """The expert each row of `rank` holds, owned rows then replica rows (None: an unused replica row)."""
        held: list[int | None] = [*self.owners[rank], *self.replicas[rank]]
        return held + [None] * (self.slots - len(held))

    def owner_of(self) -> list[tuple[int, int]]:
        """Per expert: the (rank, row) that owns it."""
        return [c[0] for c in self.copies()]

    def problems(self) -> list[str]:
        out = []
        if self.ep < 1 or self.experts % self.ep:
            return [f"{self.experts} experts cannot be split over {self.ep} ranks"]
        if len(self.replicas) != self.ep:
            out.append(f"replicas are given for {len(self.replicas)} ranks, owners for {self.ep}")
        if any(len(o) != self.local for o in self.owners):
            out.append(f"every rank owns {self.local} experts")
        owned = sorted(e for o in self.owners for e in o)
        if owned != list(range(self.experts)):
            out.append("every expert must be owned exactly once")
        for rank, copied in enumerate(self.replicas):
            if len(copied) > self.spare:
                out.append(f"rank {rank} has {len(copied)} replicas and {self.spare} replica rows")
            here = set(self.owners[rank]) if rank < self.ep else set()
            if len(set(copied)) != len(copied) or here & set(copied):
                out.append(f"rank {rank} holds an expert twice")
            if any(not 0 <= e < self.experts for e in copied):
                out.append(f"rank {rank} replicates an expert that does not exist")
        return out

    def to_dict(self) -> dict:
        return {"experts": self.experts, "spare": self.spare, "owners": [list(o) for o in self.owners],
                "replicas": [list(r) for r in self.replicas]}

    @classmethod
    def from_dict(cls, d: dict) -> Placement:
        try:
            placement = cls(int(d["experts"]), tuple(tuple(int(e) for e in o) for o in d["owners"]),
                            tuple(tuple(int(e) for e in r) for r in d["replicas"]), int(d.get("spare", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not an expert placement: {exc}") from None
        if why := placement.problems():
            raise ValueError(f"not a valid expert placement: {'; '.join(why)}")
        return placement


def rank_loads(counts: Sequence[float], placement: Placement) -> list[float]:
    """Tokens each EP rank computes when expert e's `counts[e]` tokens split evenly over its copies."""
    if len(counts) != placement.experts:
        raise ValueError(f"{len(counts)} counts for {placement.experts} experts")
    loads = [0.0] * placement.ep
    for e, copies in enumerate(placement.copies()):
        for rank, _ in copies:
            loads[rank] += float(counts[e]) / len(copies)
    return loads


def imbalance(counts: Sequence[float], placement: Placement) -> float:
    """max / mean of the ranks' loads (1.0: perfect balance; 1.0 as well when nothing was routed)."""
    loads = rank_loads(counts, placement)
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def place(counts: Sequence[float], ep: int, spare: int = 0) -> Placement:
    """A placement that keeps the busiest rank's load low for these per-expert token counts (module docstring)."""
    experts = len(counts)
    base = Placement.contiguous(experts, ep, spare)
    local = base.local
    loads = [0.0] * ep
    owners: list[list[int]] = [[] for _ in range(ep)]
    for e in sorted(range(experts), key=lambda e: (-float(counts[e]), e)):
        rank = min((r for r in range(ep) if len(owners[r]) < local), key=lambda r: (loads[r], r))
        owners[rank].append(e)
        loads[rank] += float(counts[e])
    owners = [sorted(o) for o in owners]  # row order by expert id: the contiguous layout when nothing moved
    replicas: list[list[int]] = [[] for _ in range(ep)]
    holders = {e: {r} for r, o in enumerate(owners) for e in o}

    def loads_now() -> list[float]:
        out = [0.0] * ep
        for e, ranks in holders.items():
            for r in ranks:
                out[r] += float(counts[e]) / len(ranks)
        return out

    while spare:
        now = loads_now()
        worst = max(now)
        busiest = max(range(ep), key=lambda r: (now[r], -r))
        best = None
        # the busiest rank's experts, heaviest share first: copy one onto the least-loaded ranks with a free row,
        # as few copies as make the busiest rank of all lighter (one copy of an expert that outweighs a rank's
        # fair share can leave its target busier than the owner was; several do not)
        for e in sorted((e for e, ranks in holders.items() if busiest in ranks),
                        key=lambda e: (-float(counts[e]) / len(holders[e]), e)):
            if not counts[e]:
                continue
            free = sorted((r for r in range(ep) if len(replicas[r]) < spare and r not in holders[e]),
                          key=lambda r: (now[r], r))
            for n in range(1, len(free) + 1):
                share_before = float(counts[e]) / len(holders[e])
                share_after = float(counts[e]) / (len(holders[e]) + n)
                after = [load - (share_before - share_after if r in holders[e] else 0.0) for r, load in enumerate(now)]
                for r in free[:n]:
                    after[r] += share_after
                if max(after) < worst - 1e-9:
                    best = (e, free[:n])
                    break
            if best is not None:
                break
        if best is None:
            break
        e, targets = best
        for target in targets:
            replicas[target].append(e)
            holders[e].add(target)
    return Placement(experts, tuple(tuple(o) for o in owners), tuple(tuple(r) for r in replicas), spare)
