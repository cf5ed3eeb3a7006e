"""Expert load imbalance: how much longer than perfectly balanced the busiest expert-parallel rank works.

Under expert parallelism every MoE layer waits for its busiest EP rank, so the expert compute and the All-to-All
of a step scale with max / mean of the ranks' token loads, not with the mean the rest of the cost model assumes.
That ratio depends on the layout as well as on routing: the same routing is worse on 64 ranks than on 8 (fewer
experts per rank average less), and a placement from measured load (`runtime.moe.placement.place`, with replicas
of hot experts) brings it back towards 1.

`ExpertLoad` holds measured per-expert token counts (every step of every MoE layer of a run log) and prices any
EP degree from them: the mean over steps and layers of max / mean, under the static layout or under a placement
chosen from the same counts. An assumed figure (`--imbalance`) stands in where nothing was measured.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from runtime.moe.placement import Placement, imbalance, place


@dataclass
class ExpertLoad:
    experts: int
    counts: list[list[float]]  # one row per (step, MoE layer): tokens per expert
    source: str = ""

    @classmethod
    def from_runs(cls, runs, experts: int | None = None) -> ExpertLoad:
        """The per-expert counts of every step of `runs` (`runtime.runlog.Run`s); ValueError when none carry them
        or their expert count is not `experts` (the model being planned)."""
        rows, sources = [], []
        for run in runs:
            for step in run.steps:
                for layer in step.get("expert_tokens") or []:
                    if layer and sum(layer) > 0:
                        rows.append([float(n) for n in layer])
            sources.append(run.header.get("run_id", "?"))
        if not rows:
            raise ValueError("the run logs carry no per-expert token counts (expert_tokens): nothing to measure "
                             "imbalance from")
        widths = {len(r) for r in rows}
        if len(widths) != 1:
            raise ValueError(f"the run logs mix MoE layers of {sorted(widths)} experts")
        width = widths.pop()
        if experts is not None and width != experts:
            raise ValueError(f"the run logs measured {width} experts per layer and the model has {experts}: "
                             f"give logs of this model")
        return cls(width, rows, ", ".join(sources))

    def factor(self, ep: int, *, rebalanced: bool = False, spare: int = 0) -> float:
        """Mean over the measured steps and layers of the busiest EP rank's tokens over the mean at degree `ep`:
        under the static layout, or (`rebalanced`) under a placement chosen from each layer's own counts (the best
        rebalancing every step could do; a real run rebalances every N steps from the steps before)."""
        if ep <= 1:
            return 1.0
        if self.experts % ep:
            raise ValueError(f"{self.experts} experts cannot be split over ep={ep}")
        static = Placement.contiguous(self.experts, ep)
        return statistics.fmean(imbalance(row, place(row, ep, spare) if rebalanced else static)
                                for row in self.counts)
