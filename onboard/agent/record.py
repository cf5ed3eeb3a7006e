"""agent.jsonl: every proposal, check, probe and verdict of an agent session, one JSON object per line.

    recorder.add("candidate", task="attn_hc", round=1, code=..., ...)
    (bundle / "agent.jsonl").write_text(recorder.text())
    candidates = replayed(read_record(path))     # {task path: [Candidate, ...]} for `onboard agent --replay`

Events: `session` (schema version, policy, model name; for a model endpoint its URL and model name), `task`,
`candidate` (reading, hypothesis, the code and its sha256), `guard` (what the static check refused), `probe`
(the sandboxed probe's result), `chat` (a model request and reply), `accepted`, `left` (why the module stays
HuggingFace code), `verified` (what whole-twin verification said of the generated modules). Nothing in it
depends on where or when it ran, so a replay on the same model writes the same file byte for byte.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from onboard.agent.candidate import Candidate, propose_in_order
from onboard.agent.rules import Declined
from onboard.errors import OnboardError
from runtime import bounded

SCHEMA_VERSION = 1


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class Recorder:
    def __init__(self):
        self.events: list[dict] = []

    def add(self, event: str, **fields) -> None:
        self.events.append({"event": event, **fields})

    def text(self) -> str:
        return "".join(json.dumps(e, sort_keys=True) + "\n" for e in self.events)


def read_record(path: Path) -> list[dict]:
    """The events of an agent.jsonl; OnboardError (one line) for a file that is not one."""
    try:
        lines = bounded.read_text(path, "agent record").splitlines()
    except bounded.Refused as exc:
        raise OnboardError(str(exc)) from None
    events = []
    for number, line in enumerate(lines, 1):
        try:
            event = bounded.loads(line, f"{path}:{number}", "agent record")
        except bounded.Refused as exc:
            raise OnboardError(f"{exc} (not a JSON line of an agent record)") from None
        if not isinstance(event, dict) or not isinstance(event.get("event"), str):
            raise OnboardError(f"{path}:{number}: an agent record line is an object with an 'event'")
        events.append(event)
    if not events or events[0]["event"] != "session" or events[0].get("schema_version") != SCHEMA_VERSION:
        raise OnboardError(f"{path}: not an agent record (no session line of schema version {SCHEMA_VERSION})")
    return events


def replayed(events: list[dict]) -> dict[str, list[Candidate]]:
    """The candidates each task was given, in order (their code checked against its recorded sha256)."""
    out: dict[str, list[Candidate]] = {}
    for event in events:
        if event["event"] != "candidate":
            continue
        try:
            candidate = Candidate(event["reading"], event["hypothesis"], event["code"], event["policy"])
            task, digest = event["task"], event["sha256"]
        except KeyError as exc:
            raise OnboardError(f"a candidate line of the agent record has no {exc}") from None
        if sha256(candidate.code) != digest:
            raise OnboardError(f"the recorded code for {task} does not match its sha256: the record was edited")
        out.setdefault(task, []).append(candidate)
    return out


class ReplayPolicy:
    """What a recorded session proposed, task by task: its candidates in the same order, or, for a session with
    a model (`llm`), the model's recorded replies to a LangChain agent run again (`llm.scripted_chat`), so the
    tools, the guard and the probe all run again and no endpoint is needed."""

    def __init__(self, events: list[dict]):
        self.session = events[0]
        self.name = self.session.get("policy", "replay")
        self.candidates = replayed(events)
        self.replies: dict[str, list[dict]] = {}
        self.interop: dict[str, dict[int, list[dict]]] = {}  # task -> {index of the reply it preceded: events}
        self.speed: dict[tuple[str, int], bool] = {}  # (task, round) -> slower: the session's timing verdicts
        self.declined: dict[str, list[Declined]] = {}  # task -> the rules' readings that declined, and why
        for event in events:
            if event["event"] == "declined" and "task" in event:
                self.declined.setdefault(event["task"], []).append(Declined(event.get("reading"), event.get("why")))
            if event["event"] == "chat" and "reply" in event:
                self.replies.setdefault(event.get("task", ""), []).append(event["reply"])
            elif event["event"] == "interop":
                before = len(self.replies.get(event.get("task", ""), []))
                self.interop.setdefault(event.get("task", ""), {}).setdefault(before, []).append(event)
            elif event["event"] == "speed" and "task" in event and "round" in event:
                self.speed[(event["task"], event["round"])] = bool(event.get("slower"))

    def run(self, task, module, trial, record) -> list[str]:
        if self.name != "llm":
            said = [d.said(task.path, record) for d in self.declined.get(task.path, [])]
            propose_in_order(self.candidates.get(task.path, []), trial)
            return said
        from onboard.agent.llm import LLMPolicy, scripted_chat

        policy = LLMPolicy(scripted_chat(self.replies.get(task.path, []), self.interop.get(task.path)),
                           calls=self.session.get("calls", 12))
        return policy.run(task, module, trial, record)
