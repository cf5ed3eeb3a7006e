"""MoE parallel folding in the Plan (`etp`, Megatron-Core's expert_tensor_parallel_size): validated in `problems()`,
written at schema version 4 only when set; runtime.parallel lays out etp 1 and refuses the rest in one line."""

import json

import pytest

from runtime.parallel.mesh import build_mesh
from runtime.parallel.runnable import not_runnable
from runtime.plan import READABLE_VERSIONS, SCHEMA_VERSION, Plan


def test_folding_lets_ep_span_tensor_parallel_ranks():
    plain = Plan(tp=2, dp_shard=4, ep=8)
    assert plain.problems(64) == ["ep=8 must divide the data-parallel ranks dp*cp=4 (or fold the expert mesh over "
                                  "tp*dp*cp=8: set etp, MoE parallel folding)"]
    folded = Plan(tp=2, dp_shard=4, ep=8, etp=1)
    assert folded.problems(64) == [] and folded.folded and folded.expert_tp == 1 and not plain.folded
    assert plain.expert_tp == 2  # unfolded, experts follow the attention's tp
    assert Plan(tp=2, dp_shard=4, ep=4, etp=2).problems(64) == []  # etp 2 x ep 4 = the 8 ranks of the stage
    assert Plan(tp=2, dp_shard=2, cp=2, ep=8, etp=1).problems(64) == []  # cp folds too


@pytest.mark.parametrize("plan, message", [
    (Plan(tp=2, dp_shard=4, ep=16, etp=1), "folded, etp*ep=1*16 must divide the ranks of a pipeline stage tp*dp*cp=8"),
    (Plan(tp=2, dp_shard=4, ep=4, etp=4), "folded, etp*ep=4*4 must divide"),
    (Plan(tp=2, dp_shard=4, ep=8, etp=0), "etp must be at least 1, got 0"),
])
def test_folded_plans_that_do_not_fit_their_stage_are_refused(plan, message):
    assert any(message in p for p in plan.problems())
    assert not_runnable(plan)  # whatever else, never laid out


def test_experts_must_still_divide_by_ep_when_folded():
    assert Plan(tp=2, dp_shard=4, ep=8, etp=1).problems(12) == ["ep=8 must divide the 12 experts"]


def test_runtime_parallel_lays_out_folding_at_etp_1_and_refuses_the_rest_in_one_line():
    """etp 1 runs (tests/runtime/test_tensor_parallel_models.py trains it against one process); expert tensor
    parallelism (etp > 1) and folding under pipeline parallelism are refused, each in one line."""
    assert not not_runnable(Plan(tp=2, dp_shard=4, ep=8, etp=1))
    plan = Plan(tp=2, dp_shard=4, ep=4, etp=2)
    assert not_runnable(plan) == ["expert tensor parallelism (MoE parallel folding with etp=2 > 1: each expert's "
                                  "weights split) is not built in runtime.parallel yet"]
    with pytest.raises(ValueError, match="expert tensor parallelism .* is not built in runtime.parallel yet"):
        build_mesh(plan)
    assert not_runnable(Plan(tp=2, dp_shard=2, pp=2, ep=4, etp=1, grad_accum=2)) == [
        "MoE parallel folding with pipeline parallelism is not built in runtime.parallel yet"]
    assert not not_runnable(Plan(tp=2, dp_shard=4, ep=4))  # the same ranks unfolded


def test_only_a_folded_plan_says_version_4():
    """An unfolded plan is the version-3 document byte for byte (no `etp` key), so bundles and run logs written
    before stay current; a folded one says 4 and round-trips."""
    plain = Plan(tp=2, dp_shard=4, ep=4)
    assert "etp" not in plain.to_dict() and plain.to_dict()["schema_version"] == 3
    folded = Plan(tp=2, dp_shard=4, ep=8, etp=1)
    written = json.loads(folded.to_json())
    assert written["schema_version"] == SCHEMA_VERSION == 4 and written["etp"] == 1
    assert Plan.from_dict(written) == folded
    assert READABLE_VERSIONS == (1, 2, 3, 4)
    assert Plan.from_dict({"schema_version": 3, "ep": 2, "dp_shard": 2}).etp is None
    assert Plan.from_dict({**plain.to_dict(), "etp": None}) == plain


@pytest.mark.parametrize("value", [0, -1, 1.5, "1", True, 2**21])
def test_etp_is_checked_as_a_plan_enters(value):
    with pytest.raises(ValueError, match="etp must be a whole number from 1 to"):
        Plan.from_dict({"tp": 2, "dp_shard": 4, "ep": 8, "etp": value})
