"""The llm policy against servers that behave as real ones do (issue 35), fast: the real `ChatOpenAI` client and
the real LangChain agent, a local OpenAI-protocol server (`tests.agent.openai_server`, 127.0.0.1, scripted,
bounded) that refuses null contents, streams nothing, answers slowly or not in JSON, and a model that answers in
text or calls its tools wrongly. No twin and no sandbox: the module is a small one no rules reading takes, and the
trial stands in for the loop's guard and probe (their own tests are test_agent.py and test_cheats.py); each
session's record is replayed with no server and must come out the same bytes."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from onboard.agent.endpoint import Endpoint, EndpointError
from onboard.agent.llm import LLMPolicy, sandboxed_environment, generated_templates
from onboard.agent.record import Recorder, ReplayPolicy
from onboard.agent.tasks import Task
from tests.agent.openai_server import ScriptedEndpoint

pytest.importorskip("langchain_openai")

RIGHT = "class Replacement(Generated):\n    def forward(self, x):\n        return x * self.weight\n"
TASK = Task("scale", "Scale", (0,), (0, 1), "no pattern recognises this module")


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.weight


def _call(name: str, args: dict, call_id: str) -> dict:
    return {"content": "", "tool_calls": [{"name": name, "args": args, "id": call_id}]}


SUBMIT = _call("submit_candidate", {"hypothesis": "a per-channel scale", "code": RIGHT}, "ok")


def _session(script: list[dict], monkeypatch, **options):
    """Run the llm policy on TASK against a scripted server; (server requests, recorder, trials, error)."""
    monkeypatch.setenv("TEST_ENDPOINT_KEY", "sk-test")
    server_options = {k: options.pop(k) for k in ("reject_null", "delay") if k in options}
    recorder, trials = Recorder(), []

    def trial(candidate):
        trials.append(candidate)
        passed = candidate.code == RIGHT
        return {"stop": passed, "outcome": "passed the probe" if passed else "failed the probe: wrong outputs"}

    error = None
    with ScriptedEndpoint(script, max_requests=12, **server_options) as server:
        endpoint = Endpoint(server.url, "scripted-model", "TEST_ENDPOINT_KEY", **options)
        recorder.add("session", policy="llm", calls=6, **endpoint.session())
        try:
            LLMPolicy(endpoint.chat(), calls=6, endpoint=endpoint).run(TASK, Scale(), trial, recorder.add)
        except EndpointError as exc:
            error = exc
    return server.requests, recorder, trials, error


def _replayed(recorder: Recorder) -> str:
    """The record a replay of `recorder`'s session writes (no server): the same tools, trial and budget."""
    again = Recorder()
    again.events.append(recorder.events[0])
    ReplayPolicy(recorder.events).run(TASK, Scale(), lambda c: {"stop": c.code == RIGHT, "outcome": (
        "passed the probe" if c.code == RIGHT else "failed the probe: wrong outputs")}, again.add)
    return again.text()


def _tool_answers(request: dict) -> list[str]:
    return [m["content"] for m in request["body"]["messages"] if m["role"] == "tool"]


def test_requests_carry_max_tokens_and_tool_choice(monkeypatch):
    requests, recorder, trials, error = _session([SUBMIT], monkeypatch, max_tokens=256, tool_choice="required")
    assert error is None and [c.code for c in trials] == [RIGHT]
    body = requests[0]["body"]
    assert body["max_completion_tokens"] == 256 and body["tool_choice"] == "required" and not body.get("stream")
    session = recorder.events[0]
    assert (session["max_tokens"], session["timeout"], session["tool_choice"], session["streaming"]) == (
        256, 300.0, "required", False)


def test_malformed_tool_arguments_are_answered_to_the_model_and_the_session_goes_on(monkeypatch):
    """fields_json that is not JSON, a JSON list, a missing argument, a tool that does not exist: each is the
    tool's answer to the model, which then submits; nothing ends the run."""
    script = [_call("render_template", {"reading": "residual_affine_sum", "fields_json": "{not json"}, "a"),
              _call("render_template", {"reading": "residual_affine_sum", "fields_json": "[]"}, "b"),
              _call("render_template", {"reading": "residual_affine_sum"}, "c"),
              _call("no_such_tool", {}, "d"),
              _call("render_template", {"reading": "residual_affine_sum", "fields_json": "{}"}, "e"), SUBMIT]
    requests, recorder, trials, error = _session(script, monkeypatch)
    assert error is None and [c.code for c in trials] == [RIGHT]
    answers = _tool_answers(requests[-1])
    assert answers[0].startswith("error: fields_json is not JSON")
    assert answers[1].startswith("error: fields_json is a JSON list")
    assert "fields_json" in answers[2] and "required" in answers[2].lower()  # the schema's violation, told
    assert "no_such_tool" in answers[3]
    assert answers[4].startswith("error: UndefinedError")  # the template's own field missing: told, not raised
    assert _replayed(recorder) == recorder.text()


def test_a_template_name_outside_the_folder_is_refused_and_templates_render_sandboxed(monkeypatch):
    script = [_call("render_template", {"reading": "../../../templates/adapter", "fields_json": "{}"}, "a"),
              _call("render_template", {"reading": "../REVIEW.md", "fields_json": "{}"}, "b"), SUBMIT]
    requests, _, trials, error = _session(script, monkeypatch)
    answers = _tool_answers(requests[-1])
    assert error is None and all(a.startswith("error: no template") for a in answers), answers
    assert "residual_affine_sum" in answers[0] and set(generated_templates()) >= {"residual_affine_sum"}
    from jinja2.exceptions import SecurityError

    with pytest.raises(SecurityError):
        sandboxed_environment().from_string("{{ f.__globals__ }}").render(f=test_requests_carry_max_tokens_and_tool_choice)


def test_a_text_reply_is_answered_with_the_tools_and_how_to_submit(monkeypatch):
    script = [{"content": "The module multiplies its input by a weight."}, SUBMIT]
    requests, recorder, trials, error = _session(script, monkeypatch)
    assert error is None and [c.code for c in trials] == [RIGHT] and len(requests) == 2
    users = [m["content"] for m in requests[1]["body"]["messages"] if m["role"] == "user"]
    assert "called no tool" in users[-1] and "submit_candidate(hypothesis, code)" in users[-1], users
    assert _replayed(recorder) == recorder.text()


def test_a_server_that_refuses_null_content_gets_empty_strings_after_one_retry(monkeypatch):
    """llama-cpp-python answers 500 to an assistant message whose content is null (a tool call with no text):
    the request is sent once more with "" there, recorded as an interop event, and every later request sends
    ""; a replay records the event at the same place."""
    script = [_call("show_module", {}, "a"), _call("show_runtime_api", {}, "b"), SUBMIT]
    requests, recorder, trials, error = _session(script, monkeypatch, reject_null=True)
    assert error is None and [c.code for c in trials] == [RIGHT]
    assistant = [m for r in requests for m in r["body"]["messages"] if m["role"] == "assistant"]
    assert [m["content"] for m in assistant].count(None) == 1  # the refused request, once
    assert all(m["content"] == "" for m in requests[-1]["body"]["messages"] if m["role"] == "assistant")
    (interop,) = [e for e in recorder.events if e["event"] == "interop"]
    assert "content" in interop["change"] and "500" in interop["why"]
    assert _replayed(recorder) == recorder.text()


@pytest.mark.parametrize("options, what", [
    ({"streaming": True}, "No generations found in stream"),
    ({}, "APIResponseValidationError|JSONDecodeError|APIError"),
])
def test_an_empty_or_malformed_reply_is_one_line_naming_the_endpoint(monkeypatch, options, what):
    reply = {"empty": True} if options.get("streaming") else {"malformed": True}
    requests, recorder, _, error = _session([reply], monkeypatch, **options)
    assert isinstance(error, EndpointError) and len(str(error).splitlines()) == 1, error
    assert "the model endpoint http://127.0.0.1:" in str(error)
    import re

    assert re.search(what, str(error)), error
    assert [e["event"] for e in recorder.events] == ["session", "chat"]  # the request that failed, recorded


def test_a_request_past_the_timeout_is_one_line(monkeypatch):
    _, _, _, error = _session([SUBMIT], monkeypatch, delay=2.0, timeout=0.5)
    assert isinstance(error, EndpointError) and "Timeout" in str(error) and len(str(error).splitlines()) == 1


def test_bad_endpoint_settings_are_one_line():
    from onboard.errors import OnboardError

    for bad in ({"tool_choice": "always"}, {"max_tokens": 0}, {"timeout": -1.0}):
        with pytest.raises(OnboardError):
            Endpoint("http://127.0.0.1:1/v1", "m", **bad)
    assert json.dumps(Endpoint("http://127.0.0.1:1/v1", "m").session())  # no key in it, all JSON
