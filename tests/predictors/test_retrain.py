"""Retraining from run logs (issue 19): the CPU sweep's runs of one model held back, a predictor trained without
them prices them worse than one retrained with them, and a version retrained on logs that contradict the shipped
runs is written but not made the default."""

import json
from pathlib import Path

import pytest

from cli import main
from predictors import learned
from predictors.retrain import retrain

DATA = Path(learned.__file__).parent / "data"
HELD = "olmoe-1b-7b (trained config)"


def _runs(path: Path) -> list[list[str]]:
    """The lines of each run of a run-log file (a `run` line and the lines after it)."""
    runs: list[list[str]] = []
    for line in path.read_text().splitlines():
        if json.loads(line).get("kind") == "run":
            runs.append([])
        runs[-1].append(line)
    return runs


def _write(path: Path, runs: list[list[str]]) -> Path:
    path.write_text("".join(line + "\n" for run in runs for line in run))
    return path


def _slower(run: list[str], factor: float) -> list[str]:
    out = []
    for line in run:
        record = json.loads(line)
        if record.get("kind") == "step":
            record["step_time_s"] *= factor
            record["tokens_per_s"] /= factor
        out.append(json.dumps(record))
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A shipped set without one model's CPU runs (published runs cut short for speed), the held-back runs, and a
    default trained on the shipped set."""
    folder = tmp_path_factory.mktemp("retrain")
    cpu = _runs(DATA / "runlogs" / "cpu_sweep.jsonl")
    held = [r for r in cpu if json.loads(r[0])["model"]["name"] == HELD]
    kept = [r for r in cpu if json.loads(r[0])["model"]["name"] != HELD]
    assert held and kept
    published = (DATA / "published_runs.jsonl").read_text().splitlines()[:400]
    (folder / "published.jsonl").write_text("\n".join(published) + "\n")
    shipped = [folder / "published.jsonl", _write(folder / "cpu_kept.jsonl", kept)]
    models = folder / "models"
    learned.train(shipped, models)
    return {"folder": folder, "shipped": shipped, "held": _write(folder / "held.jsonl", held), "kept": kept,
            "models": models}


@pytest.mark.slow
def test_retraining_with_a_models_runs_prices_them_better_and_becomes_the_default(world, capsys):
    result = retrain([world["held"]], out=world["models"], shipped=world["shipped"])
    (cpu,) = result.new_runs
    assert cpu.runs == 28 and cpu.after < cpu.before  # the held-back model's runs, priced better once seen
    assert result.previous == "throughput-v1" and result.predictor.label == "throughput-v2"
    assert result.default and not result.regressed
    assert learned.latest(world["models"]).name == "throughput-v2.joblib"


@pytest.mark.slow
def test_logs_that_contradict_the_shipped_runs_do_not_replace_the_default(world, capsys):
    before = learned.latest(world["models"]).name
    contradicting = _write(world["folder"] / "bad.jsonl", [_slower(run, 30.0) for run in world["kept"]])
    assert main(["predictor", "train", "--logs", str(contradicting), "--out", str(world["models"])]) == 0
    out = capsys.readouterr().out
    assert "is written but not the default" in out and "runtime" in out.splitlines()[-1]
    assert learned.latest(world["models"]).name == before  # still the previous default
    newest = learned.versions(world["models"])[-1]
    assert newest[2]["default"] is False and newest[1].exists()  # written, held back
    assert main(["predictor", "list", "--out", str(world["models"])]) == 0
    assert "(held back)" in capsys.readouterr().out
