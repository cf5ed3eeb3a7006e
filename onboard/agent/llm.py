"""The `llm` policy: a LangChain agent on any OpenAI-compatible endpoint, with tools and no shell.

    policy = LLMPolicy(chat_model(base_url, model, key_env))      # needs the `agent` extra
    policy.run(task, module, trial, record)

Rules first: the `rules` policy's readings are tried, and only a task they do not settle goes to the model.
For such a task the model gets the task and these tools (`langchain_core.tools`), built around the task:
`show_module` (the HuggingFace class's source, the module's parameters, buffers, settings and forward
signature), `show_runtime_api` (what generated code may import and call), `render_template` (a reading of
templates/generated/ filled with the model's fields, to start from), and `submit_candidate` (hypothesis and
code: the loop's `trial`, so the guard, the sandboxed probe and the budget are the loop's, not the prompt's;
the session ends as soon as a candidate passes or the rounds are spent).
The agent is `langchain.agents.create_agent` with `ModelCallLimitMiddleware` ending the run after `calls`
model calls. Every request and reply goes into the record as a `chat` event (roles, text, tool calls; no run
ids or times), which is what `ScriptedChat` replays: a recorded session reproduces its bundle with no endpoint.
"""

from __future__ import annotations

import inspect
import json
import os

from torch import nn

from onboard.adapt.codegen import environment
from onboard.agent.candidate import Candidate
from onboard.agent.tasks import Task
from onboard.errors import OnboardError
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


def _tools(task: Task, module: nn.Module, trial):
    from langchain_core.tools import StructuredTool

    def show_module() -> str:
        """The HuggingFace module to replace: its class source, parameters, buffers, settings, forward signature."""
        return module_brief(module)

    def show_runtime_api() -> str:
        """The runtime ops generated code may import and call, with their signatures and docs."""
        return runtime_api()

    def render_template(reading: str, fields_json: str) -> str:
        """Fill templates/generated/<reading>.py.j2 (hyper_connection, residual_affine_sum, short_conv_residual)
        with the JSON object fields_json; returns the code (it is not submitted)."""
        fields = json.loads(fields_json)
        return environment().get_template(f"generated/{reading}.py.j2").render(
            policy=POLICY, path=task.path, replaces=task.module_class, hypothesis=fields.pop("hypothesis", ""),
            **fields)

    def submit_candidate(hypothesis: str, code: str) -> str:
        """Submit a candidate file (hypothesis: what the module computes, in words). Returns the probe's verdict."""
        result = trial(Candidate(POLICY, hypothesis, code, POLICY))
        if result["stop"]:  # passed, or out of rounds: the session ends here, whatever the model would say next
            raise _Settled(result["outcome"])
        return result["outcome"]

    return [StructuredTool.from_function(f, handle_tool_error=True)
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

        def on_chat_model_start(self, serialized, messages, **kwargs):
            new = messages[0][self.seen:]
            self.seen = len(messages[0])
            record("chat", task=task.path, request=[_message(m) for m in new])

        def on_llm_end(self, response, **kwargs):
            self.seen += 1  # the reply is the next request's last message but one
            record("chat", task=task.path, reply=_message(response.generations[0][0].message))

    return Recording()


class LLMPolicy:
    """A LangChain agent per task on `chat` (a LangChain chat model: `chat_model(...)`, or `ScriptedChat`)."""

    name = POLICY

    def __init__(self, chat, *, calls: int = CALLS, endpoint: str = ""):
        self.chat, self.calls, self.endpoint = chat, calls, endpoint

    def run(self, task: Task, module: nn.Module, trial, record) -> None:
        """Rules first; the model only where the rules' readings did not settle the task."""
        from onboard.agent.rules import RulesPolicy

        last: dict = {}

        def remembered(candidate):
            last.update(trial(candidate))
            return last

        RulesPolicy().run(task, module, remembered, record)
        if not last.get("stop"):
            self._ask(task, module, trial, record)

    def _ask(self, task: Task, module: nn.Module, trial, record) -> None:
        from langchain.agents import create_agent
        from langchain.agents.middleware import ModelCallLimitMiddleware
        from langchain_core.messages import HumanMessage

        agent = create_agent(self.chat, _tools(task, module, trial), system_prompt=SYSTEM_PROMPT,
                             middleware=[ModelCallLimitMiddleware(run_limit=self.calls, exit_behavior="end")])
        prompt = (f"Module `{task.path}` ({task.module_class}) of every listed layer of the model stays "
                  f"HuggingFace code: {task.why}. Read it with show_module, then submit a replacement.")
        try:
            agent.invoke({"messages": [HumanMessage(prompt)]},
                         config={"callbacks": [_recording_handler(record, task)],
                                 "recursion_limit": 4 * self.calls + 4})
        except _Settled:
            return
        except Exception as exc:  # the endpoint's failure (connection, auth, protocol): one line, not a traceback
            if not _from_endpoint(exc):
                raise
            raise OnboardError(f"the model endpoint {self.endpoint} failed: {type(exc).__name__}: "
                               f"{(str(exc).splitlines() or [''])[0]}") from None


def _from_endpoint(exc: BaseException) -> bool:
    """Whether an error came from talking to the model endpoint (langchain's model errors, openai, httpx)."""
    from langchain_core.exceptions import ModelError

    return isinstance(exc, ModelError) or any(
        cls.__module__.split(".")[0] in ("openai", "httpx", "httpcore") for cls in type(exc).__mro__)


def chat_model(base_url: str, model: str, key_env: str = "OPENAI_API_KEY", *, timeout: float = 120.0,
               streaming: bool = False):
    """`langchain_openai.ChatOpenAI` on an OpenAI-compatible endpoint, its key from the environment."""
    try:
        from langchain_openai import ChatOpenAI
    except ImportError:
        raise OnboardError("the llm policy needs the agent extra: pip install -e \".[agent]\"") from None
    key = os.environ.get(key_env)
    if not key:
        raise OnboardError(f"the llm policy reads the endpoint's key from ${key_env}, which is not set")
    return ChatOpenAI(base_url=base_url, model=model, api_key=key, timeout=timeout, max_retries=0, temperature=0,
                      streaming=streaming)


def scripted_chat(replies: list[dict]):
    """A chat model that answers with `replies` (recorded `_message` dicts) in order, then ends the run: the
    replay of a recorded session, and the scripted sessions of the tests."""
    from langchain_core.language_models.chat_models import BaseChatModel
    from langchain_core.messages import AIMessage
    from langchain_core.outputs import ChatGeneration, ChatResult
    from pydantic import PrivateAttr

    class ScriptedChat(BaseChatModel):
        replies: list
        _next: int = PrivateAttr(default=0)

        @property
        def _llm_type(self) -> str:
            return "scripted"

        def bind_tools(self, tools, **kwargs):
            return self

        def _generate(self, messages, stop=None, run_manager=None, **kwargs):
            if self._next < len(self.replies):
                reply = self.replies[self._next]
                self._next += 1
            else:
                reply = {"content": "done"}
            calls = [{"name": c["name"], "args": c["args"], "id": c.get("id"), "type": "tool_call"}
                     for c in reply.get("tool_calls", [])]
            message = AIMessage(content=reply.get("content", ""), tool_calls=calls)
            return ChatResult(generations=[ChatGeneration(message=message)])

    return ScriptedChat(replies=replies)
