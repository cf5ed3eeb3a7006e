"""The onboarding agent end to end (issue 15): the rules policy turns DeepSeek-V4's hyper-connections into
verified runtime code; a recorded session replays into the same bundle byte for byte; scripted sessions (a
wrong candidate then a right one, cheats, endless failure) go through the real guard, sandbox and probe on
ZAYA's residual scaling. Models are tiny twins of transformers' own default configs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from onboard.agent.candidate import Candidate, propose_in_order
from onboard.agent.loop import RECORD, Agent, run
from onboard.agent.sandbox import Limits
from onboard.agent.tasks import leftovers
from onboard.capture import capture
from onboard.errors import OnboardError
from onboard.families import default_config
from onboard.inspection import build_spec
from onboard.source import from_config, resolve
from onboard.twin import build_twin

pytestmark = pytest.mark.slow  # each probe builds a twin in a child process: about a minute in all

RIGHT_ZAYA = '''from runtime.generated import Generated
from runtime.residual import affine_sum


class Replacement(Generated):
    def forward(self, hidden_states, residual):
        return affine_sum(hidden_states, residual, self.hidden_states_scale, self.hidden_states_bias,
                          self.residual_scale, self.residual_bias)
'''
WRONG_ZAYA = RIGHT_ZAYA.replace("self.hidden_states_scale, self.hidden_states_bias",
                                "self.hidden_states_bias, self.hidden_states_scale")  # scale and bias swapped
FALLBACK = '''from runtime.generated import Generated
from transformers.models.zaya.modeling_zaya import ZayaResidualScaling


class Replacement(Generated):
    def forward(self, hidden_states, residual):
        return ZayaResidualScaling.forward(self, hidden_states, residual)
'''
LOOPS = RIGHT_ZAYA.replace("        return affine_sum(", "        while True:\n            pass\n        return affine_sum(")


class Scripted:
    """A policy that proposes fixed code, round by round (what a model's replies would be)."""

    name = "scripted"

    def __init__(self, *codes: str):
        self.codes = codes

    def run(self, task, module, trial):
        propose_in_order([Candidate(f"scripted {i + 1}", "a residual sum with an affine map per side", code, self.name)
                          for i, code in enumerate(self.codes)], trial)


def bundle_files_are_verified(bundle: Path) -> None:
    """Every generated file in a bundle has a decision entry that takes it and the bundle verified."""
    decision = json.loads((bundle / "decision.json").read_text())
    verification = json.loads((bundle / "verification.json").read_text())
    taken = {e["file"] for e in decision["generated"] if e["takes"]}
    files = {p.name for p in (bundle / "generated").glob("*")} if (bundle / "generated").exists() else set()
    assert files == taken
    assert not files or verification["passed"]


@pytest.fixture(scope="module")
def deepseek_v4_bundle(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dsv4")
    default_config("deepseek_v4").save_pretrained(folder / "model")
    source = resolve(str(folder / "model"))
    spec, verification, agent = run(source, folder / "bundle")
    return folder, source, spec, verification, agent


def test_rules_policy_replaces_deepseek_v4_hyper_connections(deepseek_v4_bundle):
    folder, _, _, verification, agent = deepseek_v4_bundle
    bundle = folder / "bundle"
    assert verification.passed, verification.note
    assert [t.path for t in agent.tasks] == ["attn_hc", "ffn_hc"]
    assert verification.swaps["generated"] == {"expected": 10, "made": 10}  # 2 per layer of the 5-layer twin
    assert all(r.original_calls == 0 and r.truth == "fp64" for r in verification.seeds)
    assert len(verification.seeds) == 3
    assert sorted(p.name for p in (bundle / "generated").iterdir()) == ["attn_hc.py", "ffn_hc.py"]
    bundle_files_are_verified(bundle)
    review = (bundle / "REVIEW.md").read_text()
    assert "## Generated code to review" in review and "replaced by `generated/attn_hc.py`" in review
    assert "model.layers.0.attn_hc" not in review.split("## Generated code")[0]  # no longer listed as staying
    events = [json.loads(line) for line in (bundle / RECORD).read_text().splitlines()]
    assert [e["event"] for e in events if e["event"] != "probe"] == [
        "session", "task", "candidate", "accepted", "task", "candidate", "accepted", "verified", "verified"]


def test_a_replayed_session_writes_the_same_bundle_byte_for_byte(deepseek_v4_bundle):
    folder, source, _, _, _ = deepseek_v4_bundle
    run(source, folder / "again", replay=folder / "bundle" / RECORD)
    first, second = folder / "bundle", folder / "again"
    names = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(second) for p in second.rglob("*") if p.is_file())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_replay_refuses_a_record_of_another_model_and_keeps_the_bundle(deepseek_v4_bundle, tmp_path):
    folder, _, _, _, _ = deepseek_v4_bundle
    other = from_config(default_config("zaya"))
    with pytest.raises(OnboardError, match="records a session on"):
        run(other, folder / "bundle", replay=folder / "bundle" / RECORD, force=True)
    assert (folder / "bundle" / "adapter.py").exists()
    (tmp_path / "bad.jsonl").write_text('{"event": "session", "schema_version": 1}\n{"event": "candidate"}\n')
    with pytest.raises(OnboardError, match="has no"):
        run(other, tmp_path / "out", replay=tmp_path / "bad.jsonl")
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def zaya(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zaya")
    default_config("zaya").save_pretrained(folder)
    source = resolve(str(folder))
    twin = build_twin(source)
    spec = build_spec(source, twin, capture(twin))
    return source, twin, spec


def _take_on(zaya, policy, tmp_path, rounds=3, limits=Limits()):
    source, twin, spec = zaya
    agent = Agent(policy, source, rounds=rounds, limits=limits)
    task = leftovers(spec, twin.model)[0]  # post_attention_residual_scale: one task is enough here
    staging = tmp_path / "staging"
    staging.mkdir()
    return agent.attempt(task, spec, twin, staging, source.ref), agent, staging


def test_a_wrong_candidate_then_a_right_one(zaya, tmp_path):
    entry, agent, staging = _take_on(zaya, Scripted(WRONG_ZAYA, RIGHT_ZAYA), tmp_path)
    assert entry.takes and entry.file == "post_attention_residual_scale.py"
    assert [r["round"] for r in entry.rounds] == [1, 2]
    assert entry.rounds[0]["outcome"].startswith("failed the probe: seed 0")
    assert entry.rounds[1]["outcome"] == "passed the probe"
    assert (staging / "generated" / entry.file).read_text() == RIGHT_ZAYA


def test_cheats_are_refused_before_anything_runs_and_endless_failure_stops_at_the_budget(zaya, tmp_path):
    entry, agent, staging = _take_on(zaya, Scripted(FALLBACK, WRONG_ZAYA, WRONG_ZAYA, RIGHT_ZAYA), tmp_path,
                                     rounds=3)
    assert entry.takes is None and entry.file == "" and "no candidate passed in 3 round(s)" in entry.refused
    assert entry.rounds[0]["outcome"].startswith("refused before running: line 2: import of transformers")
    assert all(r["outcome"].startswith("failed the probe") for r in entry.rounds[1:])
    events = [e["event"] for e in agent.recorder.events]
    assert events.count("probe") == 2 and events.count("guard") == 1 and events[-1] == "left"
    assert not list((staging / "generated").glob("*.py"))  # nothing unverified is left behind


def test_a_candidate_that_never_returns_is_stopped_by_the_sandbox(zaya, tmp_path):
    entry, _, _ = _take_on(zaya, Scripted(LOOPS), tmp_path, rounds=1, limits=Limits(cpu_seconds=8, wall_seconds=60))
    assert entry.takes is None and "the probe process ended with code" in entry.rounds[0]["outcome"]


def test_the_probe_process_has_no_network():
    code = ("from onboard.agent.probe import _no_network; _no_network(); import socket\n"
            "try:\n    socket.create_connection(('192.0.2.1', 80), timeout=1)\n"
            "except OSError as exc:\n    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "has no network (tried 192.0.2.1)" in done.stdout
