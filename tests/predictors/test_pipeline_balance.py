"""Pipeline stages balanced by cost (predictors.pipeline): stages of a stack whose layers cost differently are
within 20% of each other's predicted time where a split by layer count is not, the split is the best contiguous
one, the cost model prices the slowest stage, and the planner writes the split into the plans it ranks."""

import dataclasses
import itertools

import pytest

from predictors import pipeline
from predictors.costmodel import estimate
from predictors.hardware import find
from runtime.dims import Dims
from runtime.plan import Plan

RECORD = {"name": "mixed", "layers": 24, "hidden": 1024, "heads": 8, "kv_heads": 8, "head_dim": 128, "ffn": 1024,
          "vocab": 32000, "experts": 64, "top_k": 8, "expert_ffn": 1024, "shared_experts": 0, "moe_layers": 21,
          "mixers": [{"kind": "softmax", "layers": 24, "heads": 8, "head_dim": 128}]}


def dims(moe: list[bool]) -> Dims:
    return dataclasses.replace(Dims.from_record({**RECORD, "moe_layers": sum(moe)}), stack=tuple((0, m) for m in moe))


def spread(d: Dims, counts: list[int]) -> float:
    times = pipeline.stage_costs(d.layer_flops(4096), counts, d.head_flops())
    return max(times) / min(times)


@pytest.mark.parametrize(("moe", "pp"), [
    ([False] * 3 + [True] * 21, 2), ([False] * 3 + [True] * 21, 3), ([False] * 3 + [True] * 21, 4),  # dense prefix
    # dense and MoE layers alternating for half the stack, MoE only after
    ([False, True] * 6 + [True] * 12, 2), ([False, True] * 6 + [True] * 12, 3), ([False, True] * 6 + [True] * 12, 4),
])
def test_stages_balanced_by_cost_are_within_20_percent_where_a_split_by_count_is_not(moe, pp):
    d = dims(moe)
    costs = d.layer_flops(4096)
    assert max(costs) > 2.5 * min(costs)  # an MoE layer (top-8 of 64) against a dense one
    counts = pipeline.layers_per_stage(d, pp, 4096)
    assert sum(counts) == 24 and len(counts) == pp and min(counts) >= 1
    assert spread(d, counts) <= 1.2 < spread(d, pipeline.even(24, pp))
    # the best contiguous split there is: no other makes the slowest stage faster
    slowest = max(pipeline.stage_costs(costs, counts, d.head_flops()))
    for cuts in itertools.combinations(range(1, 24), pp - 1):
        other = [b - a for a, b in zip((0, *cuts), (*cuts, 24))]
        assert max(pipeline.stage_costs(costs, other, d.head_flops())) >= slowest * (1 - 1e-12)


def test_the_split_is_the_best_contiguous_one_for_any_costs_ties_and_a_head_included():
    """Random stacks, equal costs among them (where many splits tie), with and without the head on the last stage:
    the slowest stage is as fast as any contiguous split makes it, every stage non-empty."""
    import random

    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        costs = [float(rng.choice((1, 2, 3))) if rng.random() < 0.5 else rng.uniform(0.1, 5) for _ in range(n)]
        stages, tail = rng.randint(1, n), rng.choice((0.0, rng.uniform(0, 4)))
        counts = pipeline.balance(costs, stages, tail)
        assert len(counts) == stages and min(counts) >= 1 and sum(counts) == n
        best = min(max(pipeline.stage_costs(costs, [b - a for a, b in zip((0, *cuts), (*cuts, n))], tail))
                   for cuts in itertools.combinations(range(1, n), stages - 1))
        assert max(pipeline.stage_costs(costs, counts, tail)) == pytest.approx(best, rel=1e-12)


def test_the_cost_model_prices_the_slowest_stage():
    d = dims([False] * 3 + [True] * 21)
    hw = find("H100")
    balanced = Plan(pp=4, dp_shard=2, grad_accum=8, seq_len=4096, pp_layers=pipeline.layers_per_stage(d, 4, 4096))
    by_count = dataclasses.replace(balanced, pp_layers=None)
    assert pipeline.share(d, balanced) == pytest.approx(max(pipeline.stage_costs(
        d.layer_flops(4096), balanced.pp_layers, d.head_flops())) * 4 / (sum(d.layer_flops(4096)) + d.head_flops()))
    assert 1 <= pipeline.share(d, balanced) < pipeline.share(d, by_count)
    assert estimate(d, balanced, hw).compute_s < estimate(d, by_count, hw).compute_s
    # without the stack (a run log's record) the figure is the count-based one the predictors were trained with
    flat = Dims.from_record(RECORD)
    assert pipeline.share(flat, by_count) == 6 * 4 / 24


def test_the_planner_writes_the_balanced_split(inspected):
    from onboard.plan import plan_model

    spec = inspected("deepseek-v3")[0]
    report = plan_model(spec, devices=256, hardware_name="H800", mode="full", seq_len=4096)
    piped = [c.plan for c in report.result.ranked if c.plan.pp > 1]
    assert piped
    for plan in piped[:20]:
        assert sum(plan.pp_layers) == 61 and len(plan.pp_layers) == plan.pp
    assert pipeline.bubble_fraction(4, 12) == pytest.approx(3 / 15)
