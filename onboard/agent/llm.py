"""The `llm` policy: a LangChain agent on any OpenAI-compatible endpoint, with tools and no shell.

    endpoint = Endpoint(base_url, model, key_env)                  # onboard.agent.endpoint
    policy = LLMPolicy(endpoint.chat(), endpoint=endpoint)          # needs the `agent` extra
    policy.run(task, module, trial, record)

Rules first: the `rules` policy's readings are tried, and only a task they do not settle goes to the model.
For such a task the model gets the task and these tools (`langchain_core.tools`), built around the task:
`show_module` (the HuggingFace class's source, the module's parameters, buffers, settings and forward
signature), `show_runtime_api` (what generated code may import and call), `render_template` (a reading of
templates/generated/ filled with the model's fields, to start from), and `submit_candidate` (hypothesis and
code: the loop's `trial`, so the guard, the sandboxed probe and the budget are the loop's, not the prompt's;
the session ends as soon as a candidate passes or the rounds are spent).
A tool never ends the run by failing: its error, malformed arguments included, is its answer to the model;
`render_template` renders only the readings that folder holds, in Jinja's sandbox. A reply that calls no tool
is answered by a request naming the tools and how to submit (`nudge`), within the same budget.
The agent is `langchain.agents.create_agent` with `ModelCallLimitMiddleware` ending the run after `calls`
model calls, behind the endpoint's guard (`onboard.agent.endpoint`: tool_choice, null contents, one-line
failures). Every request and reply goes into the record as a `chat` event (roles, text, tool calls; no run
ids or times), which is what `ScriptedChat` replays: a recorded session reproduces its bundle with no endpoint.
"""

from __future__ import annotations

import functools
import inspect
import json
from importlib import resources

import jinja2
from torch import nn

from onboard.adapt.codegen import environment
from onboard.agent.candidate import Candidate
from onboard.agent.tasks import Task
from onboard.errors import one_line
from runtime.generated import settings

POLICY = "llm"
CALLS = 12  # model calls per task

SYSTEM_PROMPT = """You adapt one PyTorch module of a HuggingFace model to a training runtime.
Write a Python file that defines `class Replacement(Generated)` (from runtime.generated) with a `forward` taking
the same arguments as the module's forward and returning the same outputs, computed with torch and the runtime's
ops. Generated builds the module from the original's state: `self.<name>` is each parameter, buffer and plain
setting of the original under its own dotted name. The file holds imports, constants and the class only; helpers
are methods of the class; no __init__ or other underscore methods, no decorators. Use only what show_runtime_api
lists: tensor methods, the listed torch / torch.nn.functional functions, math, the runtime ops and a few builtins.
No try/except, no context manager but torch.enable_grad, no assignment to attributes (self.x = ...), no other
modules, classes or files: such code is refused before it runs. It then runs in a sandbox of its own. Submit with
submit_candidate(hypothesis, code): it is probed against the live module on inputs you are not shown, forward and
backward, in evaluation and training mode, and you get the result. Repair from the failure you are shown. Stop
when a candidate passes."""


def runtime_api() -> str:
    """What generated code may call: each runtime op's signature and the first paragraph of its docstring, and
    the rest of the allow-list (`onboard.agent.capabilities`)."""
    import importlib

    from onboard.agent.capabilities import RUNTIME_API, describe

    lines = [f"Allowed: {describe()}."]
    for module_name, names in RUNTIME_API.items():
        module = importlib.import_module(module_name)
        for name in names:
            obj = getattr(module, name)
            doc = (inspect.getdoc(obj) or "").split("\n\n")[0]
            signature = "" if inspect.isclass(obj) else str(inspect.signature(obj))
            lines.append(f"from {module_name} import {name}\n    {name}{signature}\n    {doc}")
    return "\n\n".join(lines)


def module_brief(module: nn.Module) -> str:
    """The module's class source, parameters, buffers, settings and forward signature, as the model reads them."""
    try:
        source = inspect.getsource(type(module))
    except (OSError, TypeError):
        source = "(no source available)"
    state = {"parameters": {k: list(p.shape) for k, p in module.named_parameters()},
             "buffers": {k: list(b.shape) for k, b in module.named_buffers()},
             "settings": settings(module),
             "forward": f"forward{inspect.signature(module.forward)}"}
    return f"{source}\n\nstate: {json.dumps(state, default=str)}"


def generated_templates() -> list[str]:
    """The readings of templates/generated/ that `render_template` fills: the names of its `.py.j2` files."""
    folder = resources.files("onboard.templates").joinpath("generated")
    return sorted(p.name.removesuffix(".py.j2") for p in folder.iterdir() if p.name.endswith(".py.j2"))


def sandboxed_environment():
    """Jinja's SandboxedEnvironment over onboard's templates: a template cannot reach Python objects' internals
    (attributes starting with an underscore, functions' globals), whatever a model asks it to render with."""
    from jinja2.sandbox import SandboxedEnvironment

    plain = environment()
    sandboxed = SandboxedEnvironment(loader=plain.loader, keep_trailing_newline=True, undefined=jinja2.StrictUndefined)
    sandboxed.filters["tojson"], sandboxed.globals["ranges"] = plain.filters["tojson"], plain.globals["ranges"]
    return sandboxed


def _answering_errors(tool):
    """`tool` with any exception it raises (except the session's end) turned into its answer to the model: a
    tool's own error is the model's to repair, never the end of the run."""
    @functools.wraps(tool)
    def answered(*args, **kwargs):
        try:
            return tool(*args, **kwargs)
        except _Settled:
            raise
        except Exception as exc:  # noqa: BLE001 - reported to the model, which called the tool
            return f"error: {type(exc).__name__}: {one_line(exc, 300)}"
    return answered


def _tools(task: Task, module: nn.Module, trial):
    from langchain_core.tools import StructuredTool

    readings = generated_templates()

    def show_module() -> str:
        """The HuggingFace module to replace: its class source, parameters, buffers, settings, forward signature."""
        return module_brief(module)

    def show_runtime_api() -> str:
        """The runtime ops generated code may import and call, with their signatures and docs."""
        return runtime_api()

    def render_template(reading: str, fields_json: str) -> str:
        """Fill templates/generated/<reading>.py.j2 (one of the readings listed in the error when the name is not
        one) with the JSON object fields_json; returns the code (it is not submitted)."""
        if reading not in readings:
            return f"error: no template {reading!r}; the readings are {', '.join(readings)}"
        try:
            fields = json.loads(fields_json)
        except ValueError as exc:
            return f"error: fields_json is not JSON ({exc}); give a JSON object of the template's fields"
        if not isinstance(fields, dict):
            return f"error: fields_json is a JSON {type(fields).__name__}; give a JSON object of the template's fields"
        fields = {k: v for k, v in fields.items() if k not in ("policy", "path", "replaces")}
        return sandboxed_environment().get_template(f"generated/{reading}.py.j2").render(
            policy=POLICY, path=task.path, replaces=task.module_class, hypothesis=fields.pop("hypothesis", ""),
            **fields)

    def submit_candidate(hypothesis: str, code: str) -> str:
        """Submit a candidate file (hypothesis: what the module computes, in words). Returns the probe's verdict."""
        result = trial(Candidate(POLICY, hypothesis, code, POLICY))
        if result["stop"]:  # passed, or out of rounds: the session ends here, whatever the model would say next
            raise _Settled(result["outcome"])
        return result["outcome"]

    # arguments that do not fit a tool's schema go back to the model as its answer, saying which and why
    def misfit(exc) -> str:
        return f"error: the arguments do not fit the tool's schema: {one_line(exc, 300)}"

    return [StructuredTool.from_function(_answering_errors(f), handle_tool_error=True, handle_validation_error=misfit)
            for f in (show_module, show_runtime_api, render_template, submit_candidate)]


class _Settled(Exception):
    """Raised by submit_candidate to end the session: the task passed or its rounds are spent."""


def _message(m) -> dict:
    """A chat message as the record keeps it: its role, text and tool calls (name, arguments, id)."""
    out = {"role": m.type, "content": m.content if isinstance(m.content, str) else json.dumps(m.content)}
    calls = getattr(m, "tool_calls", None)
    if calls:
        out["tool_calls"] = [{"name": c["name"], "args": c["args"], "id": c.get("id")} for c in calls]
    if getattr(m, "tool_call_id", None):
        out["tool_call_id"] = m.tool_call_id
    return out


def _recording_handler(record, task: Task):
    """Records each model request (the messages it has not seen recorded yet) and each reply."""
    from langchain_core.callbacks import BaseCallbackHandler

    class Recording(BaseCallbackHandler):
        seen = 0
        replies = 0  # model calls answered in this task

        def on_chat_model_start(self, serialized, messages, **kwargs):
            new = messages[0][self.seen:]
            self.seen = len(messages[0])
            if new:  # a request sent again (the endpoint guard's one retry) is recorded once
                record("chat", task=task.path, request=[_message(m) for m in new])

        def on_llm_end(self, response, **kwargs):
            self.seen += 1  # the reply is the next request's last message but one
            self.replies += 1
            record("chat", task=task.path, reply=_message(response.generations[0][0].message))

    return Recording()


def nudge(tools: list) -> str:
    """What the next request says after a reply that called no tool."""
    listed = "; ".join(f"{t.name}({', '.join(t.args)})" for t in tools)
    return (f"Your reply called no tool, so nothing was submitted. The tools are: {listed}. Read the module with "
            f"show_module if you have not, then call submit_candidate(hypothesis, code) with the whole file.")


class LLMPolicy:
    """A LangChain agent per task on `chat` (a LangChain chat model: `Endpoint.chat()`, or `scripted_chat`);
    `endpoint` (`onboard.agent.endpoint.Endpoint`) where the chat model talks to one."""

    name = POLICY

    def __init__(self, chat, *, calls: int = CALLS, endpoint=None):
        self.chat, self.calls, self.endpoint = chat, calls, endpoint

    def run(self, task: Task, module: nn.Module, trial, record) -> list[str]:
        """Rules first; the model only where the rules' readings did not settle the task. What the rules' readings
        that declined said."""
        from onboard.agent.rules import RulesPolicy

        last: dict = {}

        def remembered(candidate):
            last.update(trial(candidate))
            return last

        declined = RulesPolicy().run(task, module, remembered, record)
        if not last.get("stop"):
            self._ask(task, module, trial, record)
        return declined

    def _ask(self, task: Task, module: nn.Module, trial, record) -> None:
        """The agent on the task, within `calls` model calls; a reply that calls no tool is answered by a request
        that says which tools there are and how to submit (`nudge`), while calls are left."""
        from langchain.agents import create_agent
        from langchain.agents.middleware import ModelCallLimitMiddleware
        from langchain_core.messages import HumanMessage

        from onboard.agent.endpoint import guard_middleware

        tools = _tools(task, module, trial)
        recording = _recording_handler(record, task)
        if hasattr(self.chat, "attach"):  # a replay records again what its session recorded beside the replies
            self.chat.attach(record)
        guard = [guard_middleware(self.endpoint, self.chat, record, task.path)] if self.endpoint is not None else []
        messages = [HumanMessage(f"Module `{task.path}` ({task.module_class}) of every listed layer of the model "
                                 f"stays HuggingFace code: {task.why}. Read it with show_module, then submit a "
                                 f"replacement.")]
        while recording.replies < self.calls:
            limit = ModelCallLimitMiddleware(run_limit=self.calls - recording.replies, exit_behavior="end")
            agent = create_agent(self.chat, tools, system_prompt=SYSTEM_PROMPT, middleware=[*guard, limit])
            try:
                state = agent.invoke({"messages": messages}, config={"callbacks": [recording],
                                                                     "recursion_limit": 4 * self.calls + 4})
            except _Settled:
                return
            messages = state["messages"]
            last = messages[-1] if messages else None
            answered_in_text = getattr(last, "type", "") == "ai" and not getattr(last, "tool_calls", None)
            if not answered_in_text or getattr(self.chat, "exhausted", False):
                return  # the call limit ended the run, or a replay's script did
            messages = [*messages, HumanMessage(nudge(tools))]


def scripted_chat(replies: list[dict], events: dict[int, list[dict]] | None = None):
    """A chat model that answers with `replies` (recorded `_message` dicts) in order, then ends the run: the
    replay of a recorded session, and the scripted sessions of the tests. `events`: {reply index: the events the
    session recorded while that reply was asked for (the endpoint guard's `interop`)}, recorded again at the same
    place through `attach(record)`, so a replay writes the session's record byte for byte."""
    from langchain_core.language_models.chat_models import BaseChatModel
    from langchain_core.messages import AIMessage
    from langchain_core.outputs import ChatGeneration, ChatResult
    from pydantic import PrivateAttr

    class ScriptedChat(BaseChatModel):
        replies: list
        events: dict = {}
        _next: int = PrivateAttr(default=0)
        _record: object = PrivateAttr(default=None)

        def attach(self, record) -> None:
            self._record = record

        @property
        def _llm_type(self) -> str:
            return "scripted"

        @property
        def exhausted(self) -> bool:
            """The script is spent: a replay asks nothing past what the session recorded."""
            return self._next >= len(self.replies)

        def bind_tools(self, tools, **kwargs):
            return self

        def _generate(self, messages, stop=None, run_manager=None, **kwargs):
            if self._next < len(self.replies):
                for event in self.events.get(self._next, []) if self._record is not None else []:
                    self._record(event["event"], **{k: v for k, v in event.items() if k != "event"})
                reply = self.replies[self._next]
                self._next += 1
            else:
                reply = {"content": "done"}
            calls = [{"name": c["name"], "args": c["args"], "id": c.get("id"), "type": "tool_call"}
                     for c in reply.get("tool_calls", [])]
            message = AIMessage(content=reply.get("content", ""), tool_calls=calls)
            return ChatResult(generations=[ChatGeneration(message=message)])

    return ScriptedChat(replies=replies, events=events or {})
