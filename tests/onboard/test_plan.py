"""onboard.plan and the plan / predict / predictor verbs, on catalogue models inspected for real."""

import json
from pathlib import Path

import pytest

from cli import main
from onboard.errors import OnboardError
from onboard.inspect.accounting import dims_of
from onboard.plan import plan_model, predict_plan
from predictors.published import DATA_DIR
from runtime.parallel.runnable import not_runnable
from runtime.plan import Plan

GB = 1e9


@pytest.fixture(scope="module")
def flagship(inspected):
    return inspected("onboard-flagship-2.8t")[0]


@pytest.fixture(scope="module")
def deepseek(inspected):
    return inspected("deepseek-v3")[0]


def test_flagship_lora_on_128_ascend_910c(flagship):
    report = plan_model(flagship, devices=128, hardware_name="Ascend-910C", mode="lora", seq_len=8192)
    best = report.best
    assert best is not None and best.plan.lora is not None and best.plan.world_size == 128
    assert best.memory_bytes < report.hardware.memory_bytes
    top = report.result.ranked[:10]  # what `onboard plan` prints by default
    assert any(c.plan.dp_shard > 1 and c.plan.ep > 1 for c in top), "FSDP2 + EP among the top plans"
    assert all(not c.plan.problems(896) for c in report.result.ranked)
    slow_ends = [c.high_s / c.plan.tokens_per_step for c in report.result.ranked]  # conservative: by the slow end
    assert slow_ends == sorted(slow_ends) and all(c.low_s <= c.step_time_s <= c.high_s for c in report.result.ranked)
    assert set(best.plan.predicted) >= {"step_time_s", "tokens_per_s", "memory_per_device_bytes"}


def test_deepseek_v3_full_on_2048_h800_fits(deepseek):
    report = plan_model(deepseek, devices=2048, hardware_name="H800", mode="full", seq_len=4096)
    best = report.best
    assert best is not None and best.plan.lora is None
    assert best.memory_bytes < 80 * GB
    assert best.plan.ep > 1 and 256 % best.plan.ep == 0


def test_nothing_fits_says_what_would(deepseek):
    report = plan_model(deepseek, devices=8, hardware_name="H100", mode="full", seq_len=4096)
    assert report.best is None
    text = " ".join(report.suggestions)
    assert "needs" in text and "devices would fit" in text
    more = int(next(s for s in report.suggestions if "devices would fit" in s).split()[0])
    assert plan_model(deepseek, devices=more, hardware_name="H100", seq_len=4096).best is not None


def test_dims_come_from_the_spec(deepseek):
    d = dims_of(deepseek)
    assert d.params_total == deepseek.params_total and d.params_active == deepseek.params_active
    assert d.experts == 256 and d.top_k == 8 and d.moe_layers == 58
    assert [(m.kind, m.layers, m.heads, m.head_dim, m.v_head_dim) for m in d.mixers] == [("mla", 61, 128, 192, 128)]


def test_plan_and_predict_verbs_round_trip(tmp_path, deepseek, capsys):
    spec = tmp_path / "spec.json"
    spec.write_text(deepseek.to_json())
    out = tmp_path / "plan.json"
    assert main(["plan", str(spec), "--devices", "256", "--hardware", "H100", "--top", "3", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    ranked = table.split("best runnable:")[0]  # the runnable plan follows the top three when it is not among them
    assert "tokens/s" in table and len([line for line in ranked.splitlines() if line.strip()[:1].isdigit()]) == 3
    plan = Plan.load(out)
    assert plan.world_size == 256 and plan.predicted["hardware"] == "H100"
    assert main(["predict", str(spec), "--plan", str(out), "--hardware", "H100", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["step_time_s"] == pytest.approx(plan.predicted["step_time_s"], rel=1e-4)
    assert got["memory_per_device_bytes"] == plan.predicted["memory_per_device_bytes"]
    direct = predict_plan(deepseek, out, hardware_name="H100")
    assert direct["tokens_per_s"] == pytest.approx(got["tokens_per_s"])


def test_bad_input_is_one_line(tmp_path, deepseek, capsys):
    spec = tmp_path / "spec.json"
    spec.write_text(deepseek.to_json())
    assert main(["plan", str(spec), "--devices", "16", "--hardware", "TPU-v9"]) == 1
    assert capsys.readouterr().err.count("\n") == 1
    bad = tmp_path / "plan.json"
    bad.write_text('{"tp": 2, "warp": 9}')
    assert main(["predict", str(spec), "--plan", str(bad), "--hardware", "H100"]) == 1
    assert "unknown plan field" in capsys.readouterr().err
    bad.write_text(Plan(ep=3, dp_shard=3).to_json())
    with pytest.raises(OnboardError, match="ep=3 must divide the 256 experts"):
        predict_plan(deepseek, bad, hardware_name="H100")


def test_plot_or_a_clear_error(tmp_path, deepseek, capsys):
    spec = tmp_path / "spec.json"
    spec.write_text(deepseek.to_json())
    png = tmp_path / "frontier.png"
    rc = main(["plan", str(spec), "--devices", "256", "--hardware", "H100", "--out", str(tmp_path / "p.json"),
               "--plot", str(png)])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert rc == 1 and "matplotlib" in capsys.readouterr().err
    else:
        assert rc == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_predictor_verbs(tmp_path, capsys):
    lines = (DATA_DIR / "published_runs.jsonl").read_text().splitlines()[:120]
    logs = tmp_path / "logs.jsonl"
    logs.write_text("\n".join(lines) + "\n{truncated\n")
    models = tmp_path / "models"
    assert main(["predictor", "train", "--logs", str(logs), "--only", "--out", str(models)]) == 0
    out = capsys.readouterr().out
    assert "throughput-v1: 60 runs" in out and "1 skipped" in out and "not valid JSON" in out
    assert main(["predictor", "train", "--logs", str(logs), "--only", "--out", str(models)]) == 0
    assert sorted(p.name for p in models.iterdir()) == [
        "throughput-v1.joblib", "throughput-v1.json", "throughput-v1.reach.npz", "throughput-v1.trees.npz",
        "throughput-v2.joblib", "throughput-v2.json", "throughput-v2.reach.npz", "throughput-v2.trees.npz"]
    capsys.readouterr()
    assert main(["predictor", "eval", "--logs", str(logs)]) == 0
    table = capsys.readouterr().out
    assert "cost median" in table and "learned median" in table and table.rstrip().splitlines()[-1].startswith("all")
    assert main(["predictor", "train", "--logs", str(tmp_path / "missing.jsonl")]) == 1
    assert main(["predictor", "train", "--logs", str(tmp_path / "missing.jsonl"), "--only"]) == 1
    assert main(["predictor", "train", "--only"]) == 1 and main(["predictor", "train", "--make-default"]) == 1
    capsys.readouterr()
    assert main(["predictor", "list", "--out", str(models)]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[1].startswith("throughput-v1 ") and listed[2].startswith("throughput-v2 (default)")
    assert Path(models / "throughput-v1.joblib").exists()


ACCEPTS = """
import json, sys
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from runtime.parallel import build_mesh
from runtime.parallel.runnable import not_runnable
from runtime.plan import Plan
plans = [Plan.from_dict(d) for d in json.loads(sys.stdin.read())]
world = plans[0].world_size
dist.init_process_group("fake", rank=world - 1, world_size=world, store=FakeStore())
for plan in plans:
    mesh = build_mesh(plan)
    assert mesh.world_size == world and (mesh.ep_group is not None) == (plan.ep > 1)
    assert (mesh.tp is not None) == (plan.tp > 1) and (mesh.cp_group is not None) == (plan.cp > 1)
print("accepted", len(plans))
"""


@pytest.mark.parametrize("model, devices, hardware, mode", [
    ("onboard-flagship-2.8t", 128, "Ascend-910C", "lora"), ("deepseek-v3", 256, "H800", "full"),
    ("qwen3-30b-a3b", 16, "H100", "full")])
def test_the_planner_keeps_its_word(inspected, model, devices, hardware, mode):
    """Issue 18: every plan among the top ten is one the runtime lays out (runtime.parallel.build_mesh on a fake
    process group of the plan's world size accepts it) or says why not; plan.json gets the fastest runnable."""
    import subprocess
    import sys

    spec = inspected(model)[0]
    report = plan_model(spec, devices=devices, hardware_name=hardware, mode=mode, seq_len=8192)
    top = report.result.ranked[:10]
    runnable = [c for c in top if not c.not_runnable]
    assert all(any("not built" in r or "does not divide" in r for r in c.not_runnable) for c in top
               if c not in runnable)
    best = report.best
    assert best is not None and not best.not_runnable
    assert best is next(c for c in report.result.ranked if not c.not_runnable)
    plans = [c.plan for c in runnable if c.plan.world_size == devices] + [best.plan]
    done = subprocess.run([sys.executable, "-c", ACCEPTS], input=json.dumps([p.to_dict() for p in plans]),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and f"accepted {len(plans)}" in done.stdout, done.stderr[-2000:]


def test_plan_prints_which_plans_run_and_writes_a_runnable_one(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "onboard-flagship-2.8t", "--devices", "128", "--hardware", "Ascend-910C", "--mode", "lora",
                 "--seq-len", "8192", "--trust-remote-code", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "runs" in text.splitlines()[1]
    # issue 38: context parallelism runs over KDA and DSA, and tensor parallelism splits both: the plan written is
    # the first of all the ranked plans, not only of the runnable ones, and it splits each sequence
    rows = [line.split() for line in text.splitlines()[2:12]]
    assert rows[0][-1] == "yes"
    plan = Plan.from_dict(json.loads(out.read_text()))
    assert [plan.tp, plan.pp, plan.cp, plan.dp_shard, plan.ep] == [int(v) for v in rows[0][:4] + rows[0][5:6]]
    assert plan.cp > 1 and plan.world_size == 128 and not not_runnable(plan)


def test_predictor_eval_reports_moe_runs_and_coverage_held_out_by_source(tmp_path, capsys):
    """Issue 37: the MoE runs by model and together, and the 90 % interval's coverage, held out by source."""
    moe = (DATA_DIR / "published_moe_runs.jsonl").read_text().splitlines()
    dense = (DATA_DIR / "published_runs.jsonl").read_text().splitlines()[:60]
    logs = tmp_path / "logs.jsonl"
    logs.write_text("\n".join(moe + dense) + "\n")
    assert main(["predictor", "eval", "--logs", str(logs), "--hold-out", "source", "--measured-only"]) == 0
    table = capsys.readouterr().out
    assert "90% covers" in table and "MoE runs by model:" in table and "\nMoE runs " in table
    assert "qwen3-30b-a3b" in table and table.rstrip().splitlines()[-1].startswith("all runs")


def test_tensor_parallelism_is_runnable_over_the_attention_kinds_the_runtime_splits():
    """`not_runnable` (what the planner marks `runs no`) refuses tp over the attention kinds runtime.parallel.tensor
    does not split, by name, and accepts the hybrids whose every kind it splits (KDA with DSA, Gated DeltaNet with
    softmax)."""
    from runtime.dims import Dims

    def dims(*kinds):
        return Dims.from_record({"name": "m", "layers": len(kinds), "hidden": 1024, "heads": 8, "kv_heads": 4,
                                 "mixers": [{"kind": k, "layers": 1, "heads": 8, "head_dim": 128} for k in kinds]})

    plan = Plan(tp=2, dp_shard=4)
    assert not not_runnable(plan, dims("linear:kda", "sparse:dsa"))
    assert not not_runnable(plan, dims("linear:gated_deltanet", "softmax"))
    assert any("tensor parallelism over linear:lightning attention is not built" in r
               for r in not_runnable(plan, dims("linear:lightning", "softmax")))
