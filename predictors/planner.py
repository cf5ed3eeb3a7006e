"""Parallel-plan search: enumerate legal layouts, keep those that fit in memory, rank by predicted tokens/s.

For each layout (tp, pp, cp, dp_shard / dp_replicate, ep, micro-batch) the memory policies are tried
from cheapest to most memory-saving (no recompute, loss chunking, selective recompute, MoE offload, full
recompute, offload everything) and the first that fits is kept, so a layout is never charged for recompute
it does not need. The cost model prices every layout; the learned predictor ranks the ones that fit in
one batch.

Tensor parallelism stays inside a node, or inside the scale-up domain up to MAX_TP ways (an NVL72 rack's
trays hold 4 GPUs, but tp=8 across two of them still rides NVLink). An MoE model also gets folded layouts
(Megatron-Core's MoE parallel folding, `Plan.etp` = 1: experts not tensor-split, ep drawn from tp x dp_shard x cp
rather than dp_shard x cp) where they add an ep the plain layouts cannot have; they are priced like any other
and marked not runnable (`runtime.parallel.runnable.not_runnable`) until runtime.parallel lays them out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from predictors import pipeline
from predictors.costmodel import Estimate, estimate, fits, memory_per_device, moe_extra_flops
from predictors.features import FEATURES, features
from predictors.hardware import Hardware
from runtime.dims import Dims
from runtime.parallel.runnable import not_runnable
from runtime.plan import LoRA, Plan

LOSS_CHUNK = 8192  # tokens per loss chunk: the logits of a chunk stay small next to a layer's activations
POLICIES = (  # (recompute, offload, loss chunking)
    ("none", "none", False), ("none", "none", True), ("selective", "none", True), ("selective", "moe", True),
    ("full", "none", True), ("full", "all", True),
)
MICRO_BATCHES = (1, 2, 4)
TARGET_TOKENS = 2 ** 22  # default global batch: about 4M tokens, a common pre-training setting
MAX_TP = 8  # tensor-parallel degree beyond a node, within the scale-up domain


@dataclass
class Candidate:
    plan: Plan
    estimate: Estimate
    step_time_s: float = 0.0  # learned prediction (the cost model's when no predictor is given)
    extrapolates_on: list = field(default_factory=list)  # features outside the predictor's training runs
    model: Dims | None = None  # what the plan is for: the model-dependent part of `not_runnable`
    low_s: float = 0.0  # the predicted step time's interval (predictors.learned.Interval); the point without one
    high_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.plan.tokens_per_step / self.step_time_s

    @property
    def memory_bytes(self) -> float:
        return self.estimate.memory_per_device_bytes

    @property
    def not_runnable(self) -> list[str]:
        """Why runtime.parallel cannot lay this plan out yet (empty when `onboard train` runs it)."""
        return not_runnable(self.plan, self.model)


@dataclass
class SearchResult:
    ranked: list  # Candidates that fit, fastest first
    infeasible: list  # the least memory-hungry policy of each layout that fits nowhere
    layouts: int = 0
    estimates: int = 0
    notes: list = field(default_factory=list)


def divisors(n: int) -> list[int]:
    """The divisors of n in increasing order, in O(sqrt n) steps."""
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return small + [n // k for k in reversed(small) if k * k != n]


def default_global_batch(devices: int, seq_len: int) -> int:
    return devices * max(1, math.ceil(TARGET_TOKENS / (seq_len * devices)))


def layouts(d: Dims, devices: int, hw: Hardware, seq_len: int, global_batch: int):
    """Every (tp, pp, cp, dp_shard, dp_replicate, ep, micro_batch, grad_accum) that is legal, and for an MoE
    model the folded ones (`etp` set) whose ep only folding allows."""
    max_tp = max(hw.devices_per_node, min(hw.domain, MAX_TP))
    for tp in divisors(devices):
        if tp > max_tp or d.heads % tp:
            continue
        for pp in divisors(devices // tp):
            if pp > max(1, d.layers // 2):  # at least two layers per stage
                continue
            for cp in (1, 2, 4, 8):
                if (devices // (tp * pp)) % cp or seq_len % (2 * cp):
                    continue
                dp = devices // (tp * pp * cp)
                for dp_shard in divisors(dp):
                    eps = [e for e in divisors(dp_shard * cp) if d.experts and d.experts % e == 0] or [1]
                    folded = [e for e in divisors(tp * dp_shard * cp)
                              if d.experts and d.experts % e == 0 and e not in eps]
                    for ep, etp in [(e, None) for e in eps] + [(e, 1) for e in folded]:
                        for mb in MICRO_BATCHES:
                            if global_batch % (mb * dp):
                                continue
                            yield {"tp": tp, "pp": pp, "cp": cp, "dp_shard": dp_shard,
                                   "dp_replicate": dp // dp_shard, "ep": ep, "micro_batch": mb,
                                   "grad_accum": global_batch // (mb * dp), **({"etp": etp} if etp else {})}


def search(d: Dims, devices: int, hw: Hardware, *, lora: LoRA | None = None, seq_len: int = 4096,
           global_batch: int | None = None, precision: str = "bf16", predictor=None,
           imbalance=None) -> SearchResult:
    """`imbalance`: the expert load imbalance to price at each EP degree (`predictors.imbalance.ExpertLoad.factor`,
    or any function of ep); None prices perfect balance."""
    global_batch = global_batch or default_global_batch(devices, seq_len)
    skew: dict[int, float] = {}  # per ep: one measurement prices every layout with it
    result = SearchResult([], [])
    for layout in layouts(d, devices, hw, seq_len, global_batch):
        result.layouts += 1
        if imbalance is not None and layout["ep"] not in skew:
            skew[layout["ep"]] = max(1.0, float(imbalance(layout["ep"])))
        # balanced by cost where the stack is known, an MoE layer's costs beyond its FLOPs included
        extra = moe_extra_flops(d, Plan(**layout, seq_len=seq_len, lora=lora), hw, precision,
                                skew.get(layout["ep"], 1.0)) if layout["pp"] > 1 and d.moe_layers else 0.0
        stages = pipeline.layers_per_stage(d, layout["pp"], seq_len, extra)
        # the first policy that fits is priced and ranked; a layout none fits keeps the one needing least memory
        fitting, least = None, None
        for recompute, offload, chunk in POLICIES:
            plan = Plan(**layout, seq_len=seq_len, recompute=recompute, offload=offload, lora=lora, dtype=precision,
                        loss_chunk=LOSS_CHUNK if chunk else None, pp_layers=stages,
                        pp_schedule="1f1b" if layout["grad_accum"] >= layout["pp"] else "gpipe")
            needs = memory_per_device(d, plan, hw, precision, skew.get(plan.ep, 1.0))
            if fits(needs, hw):
                fitting = plan
                break
            if least is None or needs < least[1]:
                least = (plan, needs)
        plan = fitting if fitting is not None else least[0]
        est = estimate(d, plan, hw, precision, skew.get(plan.ep, 1.0))
        result.estimates += 1
        kept = result.ranked if fitting is not None else result.infeasible
        kept.append(Candidate(plan, est, est.step_time_s, model=d))
    if global_batch % devices and not result.layouts:
        result.notes.append(f"global batch {global_batch} leaves no legal data-parallel split of {devices} devices")
    if predictor is not None and result.ranked:
        names = getattr(predictor, "feature_names", FEATURES)
        X = np.array([features(d, c.plan, hw, precision, c.estimate, names) for c in result.ranked])
        steps = np.array([c.estimate.step_time_s for c in result.ranked]) * predictor.correction(X)
        low, high = predictor.bounds(X, steps)
        for c, x, step, lo, hi in zip(result.ranked, X, steps, low, high):
            c.step_time_s, c.low_s, c.high_s = float(step), float(lo), float(hi)
            c.extrapolates_on = predictor.outside(x)
    for c in result.ranked:
        c.high_s = c.high_s or c.step_time_s
        c.low_s = c.low_s or c.step_time_s
    # conservative: by the slow end of each interval (where intervals do not overlap, the order of the points)
    result.ranked.sort(key=lambda c: (c.high_s / c.plan.tokens_per_step, -c.tokens_per_s, c.memory_bytes))
    result.infeasible.sort(key=lambda c: c.memory_bytes)
    return result
