"""The llm policy (issue 15) offline: the real LangChain agent and the real `ChatOpenAI` client against a local
OpenAI-protocol endpoint (`tests.agent.openai_server`, 127.0.0.1, scripted, bounded, stopped by the test),
non-streaming and streaming, with tool calls; and scripted chat sessions (`llm.scripted_chat`). No model is
asked anything: the replies are written here, as a model's would be; the tools, the guard, the sandboxed probe
and the budget they meet are the real ones."""

from __future__ import annotations

import json

import pytest

from onboard.agent.endpoint import Endpoint
from onboard.agent.llm import LLMPolicy, scripted_chat
from onboard.agent.loop import RECORD, run
from tests.agent.common import (FALLBACK_LONGCAT, RIGHT_LONGCAT, WRONG_LONGCAT, bundle_files_are_verified,
                                take_on)
from tests.agent.openai_server import ScriptedEndpoint

pytest.importorskip("langchain_openai")
pytestmark = pytest.mark.slow  # probes build twins in child processes: about a minute in all
# The speed check (`SpeedCheck`, tested in test_agent.py) is off here: LongCat-Flash's MLP written by hand runs the
# module's own operations, and a timing verdict near 1.0x on a loaded machine is not what these tests are about.

TOOLS = ("show_module", "show_runtime_api", "render_template", "submit_candidate")


def _call(name: str, args: dict, call_id: str) -> dict:
    return {"content": "", "tool_calls": [{"name": name, "args": args, "id": call_id}]}


def _submit(code: str, call_id: str) -> dict:
    return _call("submit_candidate", {"hypothesis": "a gated MLP: down(silu(gate(x)) * up(x))", "code": code},
                 call_id)


WRONG_THEN_RIGHT = [_call("show_module", {}, "c1"), _submit(WRONG_LONGCAT, "c2"), _submit(RIGHT_LONGCAT, "c3")]


def test_through_chatopenai_a_wrong_candidate_then_a_right_one_and_the_replay_is_byte_for_byte(
        longcat, tmp_path, monkeypatch):
    """`onboard agent --policy llm` end to end on LongCat-Flash, whose second MLP no rules reading takes: the
    endpoint's model reads the module, submits a wrong candidate (gate and up swapped), is shown the probe's
    failure, and submits the right one, which ends the session. Replaying agent.jsonl, with no endpoint,
    writes the same bundle byte for byte."""
    source = longcat[0]
    monkeypatch.setenv("TEST_ENDPOINT_KEY", "sk-test")
    with ScriptedEndpoint(WRONG_THEN_RIGHT, max_requests=10) as endpoint:
        spec, verification, agent = run(source, tmp_path / "bundle", policy="llm", base_url=endpoint.url,
                                        llm_model="scripted-model", key_env="TEST_ENDPOINT_KEY", keep_slower=True)
    assert len(endpoint.requests) == 3 and all(r["auth"] == "Bearer sk-test" for r in endpoint.requests)
    first = endpoint.requests[0]["body"]
    assert first["model"] == "scripted-model" and not first.get("stream")
    assert sorted(t["function"]["name"] for t in first["tools"]) == sorted(TOOLS)
    shown = [m for m in endpoint.requests[1]["body"]["messages"] if m["role"] == "tool"]
    assert "class LongcatFlashMLP" in shown[0]["content"]  # show_module's answer reached the model
    failed = [m for m in endpoint.requests[2]["body"]["messages"] if m["role"] == "tool"][-1]["content"]
    assert failed.startswith("failed the probe: wrong: ") and "output error" in failed
    assert verification.passed, verification.note
    (entry,) = agent.decision_entries
    assert entry.path == "mlps.1" and entry.takes and entry.policy == "llm"
    assert [r["round"] for r in entry.rounds] == [1, 2]
    review = (tmp_path / "bundle" / "REVIEW.md").read_text()
    assert "round 1 (llm): failed the probe" in review and "round 2 (llm): passed the probe" in review
    bundle_files_are_verified(tmp_path / "bundle")
    events = [json.loads(line) for line in (tmp_path / "bundle" / RECORD).read_text().splitlines()]
    assert events[0]["endpoint"] == endpoint.url and events[0]["model_name"] == "scripted-model"
    assert sum(1 for e in events if e["event"] == "chat" and "reply" in e) == 3

    run(source, tmp_path / "again", replay=tmp_path / "bundle" / RECORD, keep_slower=True)
    files = sorted(p.relative_to(tmp_path / "bundle") for p in (tmp_path / "bundle").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "again") for p in (tmp_path / "again").rglob("*") if p.is_file())
    for name in files:
        assert (tmp_path / "bundle" / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name


def test_streaming_chat_completions_with_tool_calls(longcat, tmp_path, monkeypatch):
    """The same client streaming: tool-call arguments arrive split over chunks and are put back together."""
    monkeypatch.setenv("TEST_ENDPOINT_KEY", "sk-test")
    script = [_call("render_template", {"reading": "residual_affine_sum", "fields_json": json.dumps({
        "hypothesis": "an affine residual sum", "args": ["hidden_states", "residual"],
        "scale_a": "hidden_states_scale", "bias_a": "hidden_states_bias", "scale_b": "residual_scale",
        "bias_b": "residual_bias"})}, "s1"), _submit(RIGHT_LONGCAT, "s2")]
    with ScriptedEndpoint(script, max_requests=6) as endpoint:
        chosen = Endpoint(endpoint.url, "scripted-model", "TEST_ENDPOINT_KEY", streaming=True)
        entry, agent, _ = take_on(longcat, LLMPolicy(chosen.chat(), endpoint=chosen), tmp_path, speed=None)
    assert all(r["body"].get("stream") for r in endpoint.requests) and len(endpoint.requests) == 2
    rendered = [m for m in endpoint.requests[1]["body"]["messages"] if m["role"] == "tool"][-1]["content"]
    assert "class Replacement(Generated)" in rendered and "affine_sum(hidden_states, residual" in rendered
    assert entry.takes and entry.rounds[0]["outcome"] == "passed the probe"


def test_cheats_are_refused_before_anything_runs(longcat, tmp_path):
    """A fallback to the HuggingFace forward, a try/except, a forbidden import, writing a file, touching a
    tolerance: each refused by the guard (no probe runs), each refusal shown to the model; then a right one."""
    body = "        return F.linear("
    cheats = [FALLBACK_LONGCAT,
              RIGHT_LONGCAT.replace(body, "        try:\n            pass\n        except Exception:\n            pass\n" + body),
              "import os\n" + RIGHT_LONGCAT,
              RIGHT_LONGCAT.replace(body, "        open('x', 'w')\n" + body),
              "import onboard.agent.probe as probe\nprobe.TOLERANCE = 1.0\n" + RIGHT_LONGCAT]
    script = [_submit(code, f"x{i}") for i, code in enumerate(cheats)] + [_submit(RIGHT_LONGCAT, "ok")]
    entry, agent, _ = take_on(longcat, LLMPolicy(scripted_chat(script)), tmp_path, rounds=6, speed=None)
    outcomes = [r["outcome"] for r in entry.rounds]
    assert all(o.startswith("refused before running") for o in outcomes[:5]), outcomes
    for what, outcome in zip(("reach-through: import of transformers", "fallback: try/except",
                              "reach-through: import of os", "reach-through: open is not on the allow-list",
                              "reach-through: import of onboard.agent.probe"), outcomes):
        assert what in outcome
    assert outcomes[5] == "passed the probe" and entry.takes
    events = [e["event"] for e in agent.recorder.events]
    assert events.count("guard") == 5 and events.count("probe") == 1


def test_endless_failure_stops_at_the_budget_and_the_module_stays_huggingface_code(longcat, tmp_path):
    script = [_submit(WRONG_LONGCAT, f"w{i}") for i in range(10)]
    entry, agent, staging = take_on(longcat, LLMPolicy(scripted_chat(script), calls=12), tmp_path, rounds=2)
    assert entry.takes is None and "no candidate passed in 2 round(s)" in entry.refused
    replies = [e for e in agent.recorder.events if e["event"] == "chat" and "reply" in e]
    assert len(replies) == 2  # the second failure spends the rounds: the session ends, the model is not asked again
    assert not list((staging / "generated").glob("*.py"))


def test_the_model_call_budget_ends_a_session_that_never_submits(longcat, tmp_path):
    script = [_call("show_runtime_api", {}, f"a{i}") for i in range(10)]
    entry, agent, _ = take_on(longcat, LLMPolicy(scripted_chat(script), calls=3), tmp_path)
    replies = [e for e in agent.recorder.events if e["event"] == "chat" and "reply" in e]
    assert len(replies) == 3 and entry.takes is None and entry.rounds == []


def test_an_endpoint_failure_is_one_line_and_keeps_the_session_so_far_beside_the_bundle(longcat, tmp_path,
                                                                                      monkeypatch):
    """The server answers the first request, then sends a body that is not JSON: `onboard agent` ends with one
    line naming the endpoint, no bundle is left, and the record of the session so far is kept beside where the
    bundle would have gone (under a name no file held), readable as an agent record."""
    from onboard.agent.endpoint import EndpointError
    from onboard.agent.record import read_record

    monkeypatch.setenv("TEST_ENDPOINT_KEY", "sk-test")
    (tmp_path / "bundle.agent.jsonl").write_text("the user's own file\n")
    with ScriptedEndpoint([_call("show_module", {}, "c1"), {"malformed": True}], max_requests=4) as endpoint:
        with pytest.raises(EndpointError) as failed:
            run(longcat[0], tmp_path / "bundle", policy="llm", base_url=endpoint.url, llm_model="scripted-model",
                key_env="TEST_ENDPOINT_KEY", timeout=30.0, keep_slower=True)
    message = str(failed.value)
    assert len(message.splitlines()) == 1 and f"the model endpoint {endpoint.url} failed" in message
    kept = tmp_path / "bundle.1.agent.jsonl"
    assert f"(the session so far: {kept})" in message and not (tmp_path / "bundle").exists()
    assert (tmp_path / "bundle.agent.jsonl").read_text() == "the user's own file\n"
    events = read_record(kept)
    assert events[0]["timeout"] == 30.0 and events[0]["max_tokens"] == 2048
    assert [e["event"] for e in events if e["event"] == "chat"] == ["chat"] * 3  # request, reply, the failed request
