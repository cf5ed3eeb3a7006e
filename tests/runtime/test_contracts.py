"""The plan and run-log contracts shared by the planner, the training loop and the predictor."""

import json

import pytest

from runtime.plan import SCHEMA_VERSION, UNFOLDED_VERSION, LoRA, Plan
from runtime.runlog import RunLogWriter, model_record, read_runs


def test_plan_round_trip_and_derived_sizes(tmp_path):
    plan = Plan(dp_shard=8, ep=4, micro_batch=2, grad_accum=3, seq_len=1024, lora=LoRA(rank=8))
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    again = Plan.load(path)
    assert again == plan
    assert again.world_size == 8 and again.global_batch == 48 and again.tokens_per_step == 48 * 1024
    assert again.problems(num_experts=16) == []


@pytest.mark.parametrize("change, expected", [
    ({"ep": 3}, "must divide the data-parallel ranks"),
    ({"ep": 8, "dp_shard": 8}, "must divide the 12 experts"),
    ({"recompute": "some"}, "recompute must be one of"),
    ({"micro_batch": 0}, "micro_batch must be at least 1"),
])
def test_plan_problems_say_why(change, expected):
    plan = Plan(**{"dp_shard": 4, **change})
    assert any(expected in p for p in plan.problems(num_experts=12))


@pytest.mark.parametrize("text, message", [
    ("{", "not valid JSON"),
    ('{"tp": 2, "colour": 1}', "unknown plan field"),
    ('{"schema_version": 99}', "schema version 99"),
    ("[1]", "JSON object"),
])
def test_bad_plan_files_give_one_line_errors(tmp_path, text, message):
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        Plan.load(path)


def test_plans_written_before_the_offload_rename_still_load():
    """Version-1 plans (the shipped CPU sweep's run logs) call `offload` `swap`: they load, and are written with
    `offload` at the lowest version that holds them (3 for a plan that is not MoE-folded; runtime.plan)."""
    old = {"schema_version": 1, "dp_shard": 2, "swap": "moe"}
    plan = Plan.from_dict(old)
    assert plan.offload == "moe" and plan.dp_shard == 2
    written = plan.to_dict()
    assert written["offload"] == "moe" and "swap" not in written and "etp" not in written
    assert written["schema_version"] == UNFOLDED_VERSION == 3 and SCHEMA_VERSION == 4
    assert Plan.from_dict(written) == plan
    assert Plan.from_dict({"swap": "all"}).offload == "all"  # a hand-written plan in the old spelling
    with pytest.raises(ValueError, match="both 'offload' and its old name 'swap'") as err:
        Plan.from_dict({"swap": "moe", "offload": "moe"})
    assert "\n" not in str(err.value)


def test_run_log_round_trip_and_skips_bad_lines(tmp_path):
    spec = {"name": "m", "model_type": "x", "num_layers": 2, "hidden_size": 8, "vocab_size": 32,
            "params_total": 100, "params_active": 50,
            "layers": [{"attention": {"kind": "softmax", "num_heads": 2, "num_kv_heads": 1, "head_dim": 4},
                        "mlp": {"kind": "moe", "num_experts": 4, "top_k": 2, "expert_ffn": 16, "num_shared_experts": 1}},
                       {"attention": {"kind": "linear:kda"}, "mlp": {"kind": "dense", "ffn": 32}}]}
    model = model_record(spec)
    assert (model["experts"], model["top_k"], model["moe_layers"], model["linear_attention_layers"], model["ffn"]) \
        == (4, 2, 1, 1, 32)
    path = tmp_path / "run.jsonl"
    with RunLogWriter(path, model=model, plan=Plan().to_dict(), hardware={"name": "cpu", "devices": 1},
                      precision="fp32", run_id="r1") as log:
        for step, t in enumerate([5.0, 1.0, 1.2, 1.1]):
            log.step(step, step_time_s=t, tokens_per_s=100 / t, loss=2.0 - step * 0.1, expert_tokens=[[3, 1, 0, 4]])
    with open(path, "ab") as f:
        f.write(b"\xff\xfe torn bytes\n")  # not UTF-8: that line is lost, not the file
    with open(path, "a") as f:
        f.write("{not json\n")
        f.write(json.dumps({"kind": "step", "run_id": "r1", "step": 9, "step_time_s": -1}) + "\n")
        f.write(json.dumps({"kind": "step", "run_id": "ghost", "step": 0, "step_time_s": 1.0}) + "\n")
        f.write(json.dumps({"kind": "run", "schema_version": 1, "run_id": "empty", "model": {}, "plan": {},
                            "hardware": {}}) + "\n")
        f.write('{"kind": "run", "schema_version": 1, "run_id": "half", "mod')  # a run killed mid-line
    runs, skipped = read_runs([tmp_path])
    assert len(runs) == 1 and len(runs[0].steps) == 4
    assert runs[0].model["mixers"] == [
        {"kind": "softmax", "layers": 1, "heads": 2, "head_dim": 4, "v_head_dim": None, "window": None,
         "index_topk": None, "index_heads": None, "index_head_dim": None, "state_size": None},
        {"kind": "linear:kda", "layers": 1, "heads": None, "head_dim": None, "v_head_dim": None, "window": None,
         "index_topk": None, "index_heads": None, "index_head_dim": None, "state_size": None}]
    assert runs[0].step_time_s() == pytest.approx(1.1)  # warm-up step left out
    reasons = " | ".join(s.reason for s in skipped)
    assert len(skipped) == 6, reasons
    for expected in ("not valid JSON", "positive finite number", "no header", "no valid step lines"):
        assert expected in reasons
