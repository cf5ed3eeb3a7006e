"""Expert load imbalance in the cost model and the planner: measured per-expert counts price each EP degree's
busiest rank, an imbalanced layout costs more than a balanced one, and `onboard plan --runlog` uses a run's
measurement (one-line errors for logs that cannot be used)."""

import json

import pytest

from onboard.errors import OnboardError
from predictors.costmodel import estimate
from predictors.hardware import find
from predictors.imbalance import ExpertLoad
from runtime.dims import Dims
from runtime.plan import Plan
from runtime.runlog import RunLogWriter


def skewed(experts: int, hot: float) -> list[float]:
    """Counts where expert 0 gets `hot` times what each other expert gets."""
    return [hot * 100.0] + [100.0] * (experts - 1)


def test_measured_imbalance_grows_with_the_ep_degree_and_placement_lowers_it():
    load = ExpertLoad(16, [skewed(16, 6.0)] * 3)
    together = ExpertLoad(16, [[600.0, 600.0] + [100.0] * 14])  # two hot experts on rank 0 of the static layout
    assert together.factor(4, rebalanced=True) < together.factor(4)
    static = [load.factor(ep) for ep in (1, 2, 4, 8, 16)]
    assert static[0] == 1.0
    assert all(a < b for a, b in zip(static, static[1:])), static
    # 16 ranks, one expert each: the busiest rank is the hot expert's, 6 / mean(6, 1 x 15) = 6 * 16 / 21
    assert static[-1] == pytest.approx(6 * 16 / 21)
    # one hot expert: moving experts cannot help, a replica of it can
    assert load.factor(4, rebalanced=True) == pytest.approx(static[2])
    assert load.factor(4, rebalanced=True, spare=1) < static[2]
    assert ExpertLoad(16, [[5.0] * 16]).factor(8) == pytest.approx(1.0)


def _moe() -> Dims:
    return Dims.from_record({"name": "moe", "layers": 8, "hidden": 2048, "heads": 16, "kv_heads": 4, "head_dim": 128,
                             "ffn": 0, "vocab": 32000, "experts": 64, "top_k": 4, "expert_ffn": 1024,
                             "shared_experts": 0, "moe_layers": 8})


def test_the_busiest_rank_is_charged_for_routed_compute_and_all_to_all():
    d, hw = _moe(), find("H100")
    plan = Plan(dp_shard=16, ep=8, seq_len=4096, micro_batch=1, grad_accum=4)
    balanced, skewed_est = estimate(d, plan, hw), estimate(d, plan, hw, imbalance=2.0)
    assert balanced.imbalance_s == 0 and skewed_est.imbalance_s > 0
    assert skewed_est.ep_s == pytest.approx(2 * balanced.ep_s)
    assert skewed_est.step_time_s > balanced.step_time_s
    # without expert parallelism no rank waits for another's experts
    alone = Plan(dp_shard=16, ep=1, seq_len=4096, micro_batch=1, grad_accum=4)
    assert estimate(d, alone, hw, imbalance=2.0).step_time_s == estimate(d, alone, hw).step_time_s
    with pytest.raises(ValueError, match="at least 1"):
        estimate(d, plan, hw, imbalance=0.5)


def _runlog(path, counts_per_step, experts, **model):
    record = {"name": "m", "experts": experts, **model}
    with RunLogWriter(path, model=record, plan=Plan(dtype="fp32").to_dict(), hardware={"name": "cpu", "devices": 1},
                      precision="fp32") as log:
        for step, counts in enumerate(counts_per_step):
            log.step(step, step_time_s=1.0, tokens_per_s=1.0, expert_tokens=[counts, counts])
    return path


def _layout(candidate) -> str:
    return json.dumps({k: v for k, v in candidate.plan.to_dict().items() if k != "predicted"}, sort_keys=True)


@pytest.fixture(scope="module")
def mixtral():
    from onboard.plan import load_spec

    return load_spec("mixtral-8x7b")


def test_plan_prices_the_measured_imbalance(tmp_path, mixtral):
    from onboard.plan import plan_model

    hot = _runlog(tmp_path / "hot.jsonl", [skewed(8, 20.0)] * 4, 8)
    even = _runlog(tmp_path / "even.jsonl", [[100.0] * 8] * 4, 8)
    kwargs = {"devices": 64, "hardware_name": "H100"}
    plain, flat, measured = (plan_model(mixtral, **kwargs), plan_model(mixtral, runlog=[even], **kwargs),
                             plan_model(mixtral, runlog=[hot], **kwargs))
    # perfectly even counts price exactly what no measurement prices
    assert [c.plan for c in flat.result.ranked[:5]] == [c.plan for c in plain.result.ranked[:5]]
    ep_plans = [c for c in measured.result.ranked if c.plan.ep > 1]
    assert ep_plans and all(c.estimate.imbalance > 1.5 for c in ep_plans)
    same = {_layout(c): c for c in plain.result.ranked}
    slower = [c for c in ep_plans if _layout(c) in same]
    # host dispatch and the device's work combine as a p-norm (`costmodel.dispatch_s`), which grows with the device's
    # work wherever the host stands: the busiest rank's extra work makes every such plan slower
    assert slower and all(c.estimate.step_time_s > same[_layout(c)].estimate.step_time_s for c in slower)
    note = measured.imbalance_note()
    assert note and "expert load imbalance" in note
    assumed = plan_model(mixtral, imbalance=3.0, **kwargs)
    assert all(c.estimate.imbalance == 3.0 for c in assumed.result.ranked if c.plan.ep > 1)


def test_plan_refuses_run_logs_it_cannot_use(tmp_path, mixtral):
    from onboard.plan import plan_model

    kwargs = {"devices": 64, "hardware_name": "H100"}
    other = _runlog(tmp_path / "other.jsonl", [skewed(16, 3.0)], 16)
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("not json\n")
    for runlog, words in (([tmp_path / "missing.jsonl"], "no such file"), ([other], "experts 16, the model planned has 8"),
                          ([garbage], "no complete runs")):
        with pytest.raises(OnboardError, match=words) as e:
            plan_model(mixtral, runlog=runlog, **kwargs)
        assert "\n" not in str(e.value)
    with pytest.raises(OnboardError, match="give one"):
        plan_model(mixtral, runlog=[other], imbalance=2.0, **kwargs)
    with pytest.raises(OnboardError, match="1 or more"):
        plan_model(mixtral, imbalance=0.5, **kwargs)
    assert other.read_text().count("\n") == 2  # the logs were only read


def test_run_logs_of_another_model_are_left_out_and_said(tmp_path, mixtral):
    """A log of a model with the same expert count but another shape must not price this one's plans silently."""
    from onboard.plan import plan_model

    kwargs = {"devices": 64, "hardware_name": "H100"}
    folder = tmp_path / "runs"
    folder.mkdir()
    even = _runlog(folder / "even.jsonl", [[100.0] * 8] * 4, 8, hidden=4096, model_type="mixtral")
    alone = plan_model(mixtral, runlog=[even], **kwargs)
    _runlog(folder / "other.jsonl", [skewed(8, 20.0)] * 4, 8, hidden=2048, model_type="mixtral")
    mixed = plan_model(mixtral, runlog=[folder], **kwargs)
    assert [c.plan for c in mixed.result.ranked[:5]] == [c.plan for c in alone.result.ranked[:5]]
    assert len(mixed.load.counts) == len(alone.load.counts)
    assert "1 run(s) of another model left out" in mixed.imbalance_note() and "hidden 2048" in mixed.imbalance_note()
    with pytest.raises(OnboardError, match="no run of this model .*hidden 2048"):
        plan_model(mixtral, runlog=[folder / "other.jsonl"], **kwargs)
