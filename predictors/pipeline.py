"""Pipeline stages balanced by cost, and the time a schedule leaves them idle.

A stage's time per micro-batch is proportional to the forward FLOPs per token of its layers (`Dims.layer_flops`:
a layer of 896 routed experts at top-16 and a dense layer are not counted alike) and, for an MoE layer, what its
grouped GEMMs, permutation and exposed exchanges take beyond its FLOPs (`layer_costs`), plus the LM head on the
last stage. `balance` cuts the stack into contiguous stages minimising the slowest one,

    min over cuts of  max_k  sum_{i in stage k} c_i        (dynamic programming over prefix sums, O(pp L^2)),

and `share` is what the cost model multiplies a perfectly even split by: the slowest stage over the mean.

For 1F1B and GPipe alike each of the p stages idles p - 1 micro-batch slots of the slowest stage per step, so with
m micro-batches of time t the step takes (m + p - 1) t and the idle fraction (the bubble) is (p - 1) / (m + p - 1).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from runtime.dims import Dims
from runtime.plan import Plan


@lru_cache(maxsize=256)
def _balance(costs: tuple[float, ...], stages: int, tail: float) -> tuple[int, ...]:
    n = len(costs)
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    # segment[i, j]: the layers j..i-1 as one stage; segments that do not end after they start are never taken
    segment = prefix[:, None] - prefix[None, :]
    ends_after = np.arange(n + 1)[None, :] < np.arange(n + 1)[:, None]
    # best[k][i]: the slowest stage when the first i layers form k stages; cut[k][i]: where the last one starts
    # (the first j that attains it, as a loop over j taking only strict improvements would find)
    best = np.full((stages + 1, n + 1), np.inf)
    cut = np.zeros((stages + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0.0
    rows = np.arange(n + 1)
    for k in range(1, stages + 1):
        last = segment + tail if k == stages else segment
        worst = np.where(ends_after, np.maximum(best[k - 1][None, :], last), np.inf)
        reachable = (rows >= k) & (rows <= n - (stages - k))
        cut[k] = np.where(reachable, worst.argmin(axis=1), 0)
        best[k] = np.where(reachable, worst[rows, cut[k]], np.inf)
    counts, i = [], n
    for k in range(stages, 0, -1):
        counts.append(i - int(cut[k][i]))
        i = int(cut[k][i])
    return tuple(reversed(counts))


def balance(costs: list[float], stages: int, tail: float = 0.0) -> list[int]:
    """Layers per stage: contiguous, non-empty, the slowest stage as fast as it can be (`tail`: a cost the last
    stage carries besides its layers, the LM head)."""
    if not 1 <= stages <= len(costs):
        raise ValueError(f"{len(costs)} layers do not make {stages} non-empty stages")
    return list(_balance(tuple(costs), stages, tail))


def even(layers: int, stages: int) -> list[int]:
    """Layers per stage split by count (the first stages one longer), as the runtime does without a balance."""
    base, extra = divmod(layers, stages)
    return [base + (i < extra) for i in range(stages)]


def stage_costs(costs: list[float], counts: list[int], tail: float = 0.0) -> list[float]:
    """Each stage's cost for `counts` layers per stage."""
    out, start = [], 0
    for n in counts:
        out.append(sum(costs[start:start + n]))
        start += n
    out[-1] += tail
    return out


def layer_costs(d: Dims, seq_len: int, moe_extra: float = 0.0) -> list[float]:
    """Each layer's cost in forward FLOPs per token at the dense rate: `Dims.layer_flops`, and for an MoE layer
    `moe_extra` more, what its grouped GEMMs, permutation and exposed exchanges take beyond its FLOPs
    (`predictors.costmodel.moe_extra_flops`)."""
    costs = d.layer_flops(seq_len)
    if moe_extra:
        costs = [c + moe_extra if is_moe else c for c, (_, is_moe) in zip(costs, d.stack)]
    return costs


def layers_per_stage(d: Dims, pp: int, seq_len: int, moe_extra: float = 0.0) -> list[int] | None:
    """The cost-balanced split of `d`'s stack over pp stages (None when the stack is not known, or pp is 1)."""
    if pp == 1 or not d.stack or pp > len(d.stack):
        return None
    return balance(layer_costs(d, seq_len, moe_extra), pp, d.head_flops())


def share(d: Dims, plan: Plan, moe_extra: float = 0.0) -> float:
    """The slowest stage's share of a step's compute over an even 1 / pp: 1 for a perfect balance. With the stack
    known, from the layers' costs (`layer_costs`) and plan.pp_layers (an even split by count when it has none);
    without, the count-based figure the predictors were trained with (the stage with the most layers)."""
    if plan.pp == 1:
        return 1.0
    if not d.stack or len(d.stack) != d.layers:
        return math.ceil(d.layers / plan.pp) * plan.pp / d.layers
    counts = plan.pp_layers if plan.pp_layers and sum(plan.pp_layers) == len(d.stack) else even(len(d.stack), plan.pp)
    # kept on the model's instance (as `Dims.layer_flops` is): a planner prices each split under several policies
    cache = d.__dict__.setdefault("_stage_share", {})
    key = (plan.seq_len, tuple(counts), moe_extra)
    if key not in cache:
        per_stage = stage_costs(layer_costs(d, plan.seq_len, moe_extra), counts, d.head_flops())
        cache[key] = max(per_stage) * plan.pp / sum(per_stage)
    return cache[key]


def bubble_fraction(pp: int, micro_batches: int) -> float:
    """The share of a 1F1B / GPipe step each stage spends idle: (p - 1) / (m + p - 1)."""
    return (pp - 1) / (micro_batches + pp - 1) if pp > 1 else 0.0
