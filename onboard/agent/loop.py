"""The agent's loop over the leftovers of one adapt (see the package docstring).

    agent = Agent(policy, source, rounds=3)
    onboard.bundle.make.adapt(source, out, agent=agent)    # take_on() as decided and once verified, then finish()

`take_on` turns each task into a `GeneratedEntry` of the decision: the first candidate that passes the guard
and the probe (its file written to the bundle's generated/), or, when the budget of rounds runs out, an entry
that stays HuggingFace code with every round's outcome. It runs once on what adapt decided and once more after
verification settled, for what a refused reading left over (a block that fell back to its experts, whose router
is then a task). Verification runs as for any adapt, and refuses a generated module that spoils the whole twin like any other reading; `finish` records what it said and writes
agent.jsonl.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from onboard.adapt.decision import Decision, GeneratedEntry
from onboard.agent import guard
from onboard.agent.endpoint import EndpointError
from onboard.agent.candidate import Candidate
from onboard.agent.record import SCHEMA_VERSION, Recorder, sha256
from onboard.agent.sandbox.judge import Judge
from onboard.agent.sandbox.process import Stopped
from onboard.agent.sandbox.remote import Host
from onboard.agent.sandbox.session import Limits, Sandbox
from onboard.agent.tasks import Task, leftovers
from onboard.errors import OnboardError, one_line
from onboard.inspect.spec import ModelSpec
from onboard.source import ModelSource
from onboard.twin import Twin
from runtime.generated import ModuleState

ROUNDS = 3  # candidates tried per task before it stays HuggingFace code


@dataclass(frozen=True)
class SpeedCheck:
    """How a candidate that passed the probe is timed against the module (`Judge.speed`): at `width` times the
    twin's width and `tokens` tokens, `repeats` samples each, the module in the reference's process and the
    candidate in its own, each by the kernel's count of its CPU time; when three in four of the samples' ratios
    are below `slower_than` times the module's speed it is not swapped in (the round fails, saying so). The margin
    and the quartile keep a replacement doing the same operations as the module from being refused by the noise
    of a shared machine, whose load only widens the spread: such pairs, one millisecond calls in two processes,
    measured medians of 0.74x to 1.28x on a 2-core VM (a candidate doing the module's work nine times measures
    0.15x)."""
    width: int = 8
    tokens: int = 1024
    repeats: int = 9
    slower_than: float = 0.6


SLOWER = ("passed the probe, but ran below {check.slower_than}x the HuggingFace module's speed (forward + backward, "
          "{check.width}x the twin's width, {check.tokens} tokens): not swapped in (--keep-slower swaps it in)")
GENERATED_DIR = "generated"  # below the bundle: the generated files
RECORD = "agent.jsonl"  # in the bundle: the session's record


class Agent:
    def __init__(self, policy, source: ModelSource, *, rounds: int = ROUNDS, limits: Limits = Limits(),
                 session: dict | None = None, speed: SpeedCheck | None = SpeedCheck()):
        """`speed` None swaps in a candidate that passed the probe however fast it runs (--keep-slower)."""
        self.policy, self.source, self.rounds, self.limits, self.speed = policy, source, rounds, limits, speed
        self.recorder = Recorder()
        self.recorder.add("session", schema_version=SCHEMA_VERSION, policy=policy.name, model=source.name,
                          rounds=rounds, **(session or {}))
        self.tasks: list[Task] = []
        self.recorded_speed: dict[tuple[str, int], bool] = {}  # a replay's timing verdicts (ReplayPolicy.speed)
        self.decision_entries: list[GeneratedEntry] = []  # one per task, as the decision holds them
        self._scratch: Path | None = None
        self._sandbox: Sandbox | None = None
        self._judge: Judge | None = None
        self._host: Host | None = None

    def sandbox(self) -> Sandbox:
        """The session's sandbox (started on first use): the reference's process and the candidates'."""
        if self._sandbox is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="onboard-agent-"))
            self._sandbox = Sandbox(self._model_ref(self._scratch), trust_remote_code=self.source.trust_remote_code,
                                    limits=self.limits)
        return self._sandbox

    def warm(self) -> None:
        """Start the sandbox's processes now, so their imports overlap with the caller's inspection."""
        self.sandbox().warm()

    def loader(self):
        """How whole-twin verification loads generated files: into a candidate's process of the sandbox, never
        into this one (`onboard.agent.sandbox.remote`)."""
        if self._host is None:
            self._host = Host(self.sandbox()).__enter__()
        return self._host.load

    def close(self) -> None:
        if self._host is not None:
            self._host.close()
            self._host = None
        if self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None
        self._judge = None
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    def take_on(self, spec: ModelSpec, twin: Twin, decision: Decision, staging: Path) -> bool:
        """Attempt every leftover of `decision` not attempted before (adapt calls this as decided, and again
        once verification has settled, for what its refusals left over); True when a new candidate passed, so
        the bundle must be verified again with it."""
        tried = {task.path for task in self.tasks}
        tasks = [task for task in leftovers(spec, twin.model, decision) if task.path not in tried]
        if not tasks:
            return False
        self.tasks.extend(tasks)
        entries = [self.attempt(task, spec, twin, staging) for task in tasks]
        self.decision_entries.extend(entries)
        decision.generated.extend(entries)
        return any(entry.file for entry in entries)

    def _model_ref(self, scratch: Path) -> str:
        """What the probe's own process resolves to build the same twin."""
        if self.source.kind == "local":  # the probe's process runs elsewhere: a relative directory is not there
            return str(Path(self.source.path).resolve())
        if self.source.kind != "config":
            return self.source.ref
        self.source.config.save_pretrained(scratch / "model")  # an in-memory config (families, tests)
        return str(scratch / "model")

    def attempt(self, task: Task, spec: ModelSpec, twin: Twin, staging: Path) -> GeneratedEntry:
        """One task: the policy proposes through `trial` until one passes or the budget of rounds is spent; the
        entry the decision gets (module docstring)."""
        record = self.recorder.add
        record("task", task=task.path, replaces=task.module_class, layers=list(task.layers), why=task.why)
        module_path = f"{spec.layers_path}.{task.twin_layers[0]}.{task.path}"
        module = twin.model.get_submodule(module_path)
        names = set().union(*(ModuleState.of(twin.model.get_submodule(f"{spec.layers_path}.{i}.{task.path}")).names()
                              for i in task.twin_layers))  # the same module reads other settings in other layers
        sandbox = self.sandbox()
        if self._judge is None:
            self._judge = Judge(sandbox)
        judge = self._judge
        entry = GeneratedEntry(layers=list(task.layers), path=task.path, file="", replaces=task.module_class,
                               policy=self.policy.name, reading="", hypothesis="")
        history: list[dict] = []

        def trial(candidate: Candidate) -> dict:
            """Check, write and probe one candidate; its outcome (`stop`: the task is settled or out of rounds)."""
            if entry.file or len(history) >= self.rounds:
                return {"outcome": "no more rounds: the task is settled or its budget is spent", "stop": True}
            number = len(history) + 1
            record("candidate", task=task.path, round=number, policy=candidate.policy, reading=candidate.reading,
                   hypothesis=candidate.hypothesis, code=candidate.code, sha256=sha256(candidate.code))
            outcome = {"round": number, "reading": candidate.reading, "hypothesis": candidate.hypothesis}
            if problems := guard.check(candidate.code, names):
                record("guard", task=task.path, round=number, problems=problems)
                outcome["outcome"] = "refused before running: " + "; ".join(problems[:3])
            else:
                path = staging / GENERATED_DIR / f"{task.name}.py"
                path.parent.mkdir(exist_ok=True)
                path.write_text(candidate.code)
                digest = sha256(candidate.code)
                try:
                    with sandbox.candidate() as worker:
                        round_ = judge.round(worker)
                        result = judge.probe(round_, module_path=module_path, code=candidate.code, name=path.name,
                                             draw=judge.draw(digest, task.path, str(number)))
                        record("probe", task=task.path, round=number, result=result)
                        slower = result.get("passed") and self._slower(task, spec, candidate.code, path.name, judge,
                                                                       round_, number, digest)
                except Stopped as exc:  # the sandbox could not start a process for it
                    result, slower = {"passed": False, "note": f"its process {exc}"}, ""
                    record("probe", task=task.path, round=number, result=result)
                if slower:
                    path.unlink()
                    outcome["outcome"] = slower
                elif result.get("passed"):
                    outcome["outcome"] = "passed the probe"
                    entry.file, entry.reading, entry.hypothesis = path.name, candidate.reading, candidate.hypothesis
                    entry.policy, entry.probe = candidate.policy, result
                    record("accepted", task=task.path, round=number, file=f"{GENERATED_DIR}/{path.name}")
                else:
                    path.unlink()
                    outcome["outcome"] = "failed the probe: " + (result.get("note") or "no reason given")
            history.append(outcome)
            return {**outcome, "stop": bool(entry.file) or len(history) >= self.rounds}

        declined = self.policy.run(task, module, trial, record) or []
        entry.rounds = history
        if not entry.file:
            entry.refused = (f"no candidate passed in {len(history)} round(s)" if history
                             else f"the {self.policy.name} policy proposed nothing for this module"
                             + "".join(f"; {d}" for d in declined))
            record("left", task=task.path, why=entry.refused)
        return entry

    def _slower(self, task: Task, spec: ModelSpec, code: str, name: str, judge: Judge, round_, number: int,
                digest: str) -> str:
        """Why a candidate that passed the probe is not swapped in for being slower ("" when it is not). Only
        the verdict goes into the record and the bundle (timings differ from run to run; the verdict, away
        from the margin, does not), and a replay takes the recorded verdict rather than timing again."""
        if self.speed is None:
            return ""
        check = self.speed
        recorded = self.recorded_speed.get((task.path, number))
        if recorded is not None:
            verdict = SLOWER.format(check=check) if recorded else ""
        else:
            timed = judge.speed(round_, layers_path=spec.layers_path, layer=task.twin_layers[0], path=task.path,
                                code=code, name=name, width=check.width, tokens=check.tokens, repeats=check.repeats,
                                seed_parts=(digest, task.path, str(number)))
            if "ratio" not in timed:
                verdict = f"passed the probe, but timing it failed: {timed.get('note', 'no reason given')}"
            else:
                # slower only where three samples in four say so: a spread the machine's load widens never
                # turns a candidate as fast as the module into a slower one
                verdict = SLOWER.format(check=check) if timed["upper"] < check.slower_than else ""
        self.recorder.add("speed", task=task.path, round=number, slower=bool(verdict))
        return verdict

    def finish(self, decision: Decision, verification, staging: Path) -> bool:
        """Record what whole-twin verification said of each generated module, take out of the bundle the files
        it did not keep (no unverified code ships), and write agent.jsonl. True when a module still in the
        adapter was taken out (a bundle that failed verification as a whole): the adapter must be rendered
        again."""
        dropped = False
        for entry in decision.generated:
            if not entry.file:
                continue
            kept = entry.takes is not None and verification.passed
            if not kept and entry.takes is not None:
                entry.refused = f"the bundle did not verify with it ({verification.note or 'see verification'})"
                dropped = True
            self.recorder.add("verified", task=entry.path, kept=kept, why=entry.refused or "")
            if not kept:
                (staging / GENERATED_DIR / entry.file).unlink()
                entry.file = ""
        if self.tasks:  # nothing left over: the bundle is exactly what adapt writes
            (staging / RECORD).write_text(self.recorder.text())
        shipped = {p.name for p in (staging / GENERATED_DIR).glob("*")} if (staging / GENERATED_DIR).exists() else set()
        kept = {e.file for e in decision.generated if e.file}
        if shipped != kept:  # an invariant, not a user error: no unverified generated file may ship
            raise AssertionError(f"generated files {sorted(shipped)} differ from the verified ones {sorted(kept)}")
        return dropped


POLICIES = ("rules", "llm")


def policy_named(name: str, *, base_url: str | None = None, llm_model: str | None = None,
                 key_env: str = "OPENAI_API_KEY", calls: int | None = None, **endpoint):
    """The policy `onboard agent --policy NAME` runs, and the fields its session line records; `endpoint`: the
    llm policy's max_tokens, timeout, tool_choice, streaming (`onboard.agent.endpoint.Endpoint`)."""
    from onboard.agent.rules import RulesPolicy

    if name == "rules":
        return RulesPolicy(), {}
    if name == "llm":
        from onboard.agent.endpoint import Endpoint
        from onboard.agent.llm import CALLS, LLMPolicy

        if not base_url or not llm_model:
            raise OnboardError("the llm policy needs --base-url (an OpenAI-compatible endpoint) and --llm-model")
        calls = calls or CALLS
        chosen = Endpoint(base_url, llm_model, key_env, **{k: v for k, v in endpoint.items() if v is not None})
        return LLMPolicy(chosen.chat(), calls=calls, endpoint=chosen), {**chosen.session(), "calls": calls}
    raise OnboardError(f"unknown agent policy {name!r}: choose from {', '.join(POLICIES)}")


# what a replay's session line keeps of the session it replays (the policy, model and rounds it records itself)
SESSION_FIELDS = ("endpoint", "model_name", "calls", "keep_slower", "max_tokens", "timeout", "tool_choice",
                  "streaming")


def kept_beside(out: Path, text: str) -> Path:
    """Write a failed session's record beside the bundle it was for, under a name no file holds yet."""
    from onboard.outputs import write_atomically

    for n in range(1000):
        path = out.parent / (f"{out.name}.{RECORD}" if n == 0 else f"{out.name}.{n}.{RECORD}")
        if not path.exists() and not path.is_symlink():
            write_atomically(path, text)
            return path
    raise OnboardError(f"{out.parent}: a thousand agent records are kept beside {out.name} already")


def run(source: ModelSource, out: Path, *, policy: str = "rules", replay: Path | None = None, rounds: int = ROUNDS,
        force: bool = False, notes: list[str] | None = None, keep_slower: bool = False, **llm):
    """`onboard agent`: adapt `source` into `out` with the agent taking on the leftovers (`llm`: base_url,
    llm_model, key_env, calls, max_tokens, timeout, tool_choice, streaming for the llm policy). Where the model
    endpoint fails, the session's record so far is kept beside `out` (`kept_beside`) and the error says where.
    A replay proposes what the record proposed, with the record's own budget. Returns (spec, verification,
    agent)."""
    from onboard.agent.record import ReplayPolicy, read_record
    from onboard.bundle.make import adapt

    if replay is not None:
        chosen = ReplayPolicy(read_record(replay))
        if chosen.session.get("model") != source.name:
            raise OnboardError(f"{replay} records a session on {chosen.session.get('model')!r}, not {source.name!r}")
        rounds = chosen.session.get("rounds", rounds)
        keep_slower = chosen.session.get("keep_slower", keep_slower)
        for field in ("rounds", "calls"):
            value = chosen.session.get(field, 1)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise OnboardError(f"{replay}: the session line's '{field}' is {value!r}: a replay needs a whole "
                                   f"number of at least 1")
        if not isinstance(keep_slower, bool):
            raise OnboardError(f"{replay}: the session line's 'keep_slower' is {keep_slower!r}: true or false")
        session = {k: v for k, v in chosen.session.items() if k in SESSION_FIELDS}
    else:
        chosen, session = policy_named(policy, **llm)
        if keep_slower:  # a replay swaps in what this session swapped in
            session["keep_slower"] = True
    agent = Agent(chosen, source, rounds=rounds, session=session, speed=None if keep_slower else SpeedCheck())
    agent.recorded_speed = getattr(chosen, "speed", {})
    agent.warm()  # the sandbox's imports run while this process inspects the model
    try:
        spec, verification = adapt(source, out, force=force, notes=notes, agent=agent)
    except EndpointError as exc:  # the session so far, to read and to replay up to the failure
        try:
            kept = f"the session so far: {kept_beside(Path(out), agent.recorder.text())}"
        except (OSError, OnboardError) as why:
            kept = f"the session so far could not be kept: {one_line(why, 120)}"
        raise EndpointError(f"{exc} ({kept})") from None
    finally:
        agent.close()
    return spec, verification, agent
