"""The llm policy's model endpoint: any OpenAI-compatible server, hosted or local, and what to do when it is odd.

    endpoint = Endpoint("http://127.0.0.1:8000/v1", "SmolLM2-135M-Instruct", max_tokens=512, timeout=600)
    chat = endpoint.chat()                      # langchain_openai.ChatOpenAI, its key from $key_env
    guard = EndpointGuard(endpoint, chat, record)   # a create_agent middleware around every model call

What servers differ in, and what the agent does about it:

- Length and time. A reply is capped at `max_tokens` (a server's own default may be 1024 tokens or the whole
  context, minutes on a CPU), and each request at `timeout` seconds. Both are recorded in agent.jsonl's session.
- `tool_choice`. Some local servers (llama-cpp-python with a function-calling chat format) call tools only when
  it is sent: it is sent on every request, `auto` unless the user asks for `required` or `none`.
- An assistant message that only calls tools. The OpenAI protocol allows its `content` to be null, and
  langchain_openai sends null; some servers refuse that (llama-cpp-python answers 500). When a request that
  carried such a message fails with an HTTP error, it is sent once more with `""` in place of null; if that
  answers, every later request sends `""`, and an `interop` event records the switch.
- Any failure of the call itself (timeout, connection, HTTP error, an empty stream, a body that is not the
  protocol's JSON) is an `EndpointError`: one line naming the endpoint, never a traceback. What the tools do
  is not the endpoint's: a tool's error goes back to the model as the tool's answer (`onboard.agent.llm`).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from onboard.errors import OnboardError, one_line

TOOL_CHOICES = ("auto", "required", "none")
MAX_TOKENS = 2048  # per reply: room for a module's code and a few lines of reasoning
TIMEOUT = 300.0  # seconds per request: a small model on a CPU server takes minutes for a long reply


class EndpointError(OnboardError):
    """The model endpoint failed to answer a request (one line, naming it)."""


@dataclass(frozen=True)
class Endpoint:
    base_url: str
    model: str
    key_env: str = "OPENAI_API_KEY"
    max_tokens: int = MAX_TOKENS
    timeout: float = TIMEOUT
    tool_choice: str = "auto"
    streaming: bool = False

    def __post_init__(self):
        if self.tool_choice not in TOOL_CHOICES:
            raise OnboardError(f"--tool-choice {self.tool_choice!r}: choose from {', '.join(TOOL_CHOICES)}")
        if self.max_tokens < 1 or not self.timeout > 0:
            raise OnboardError("--max-tokens and --timeout must be positive")

    def session(self) -> dict:
        """What agent.jsonl's session line records of the endpoint (never the key)."""
        fields = asdict(self)
        return {"endpoint": fields.pop("base_url"), "model_name": fields.pop("model"),
                **{k: v for k, v in fields.items() if k != "key_env"}}

    def chat(self):
        """`langchain_openai.ChatOpenAI` on this endpoint (no retries: a retry is this module's decision)."""
        try:
            from langchain_openai import ChatOpenAI
        except ImportError:
            raise OnboardError("the llm policy needs the agent extra: pip install -e \".[agent]\"") from None
        key = os.environ.get(self.key_env)
        if not key:
            raise OnboardError(f"the llm policy reads the endpoint's key from ${self.key_env}, which is not set "
                               f"(a local server takes any value)")

        class Chat(ChatOpenAI):
            empty_content: bool = False  # send "" where langchain_openai sends a null assistant content

            def _get_request_payload(self, input_, *, stop=None, **kwargs):
                payload = super()._get_request_payload(input_, stop=stop, **kwargs)
                if self.empty_content:
                    for message in payload.get("messages", []):
                        if message.get("role") == "assistant" and message.get("content") is None:
                            message["content"] = ""
                return payload

        return Chat(base_url=self.base_url, model=self.model, api_key=key, timeout=self.timeout, max_retries=0,
                    temperature=0, streaming=self.streaming, max_tokens=self.max_tokens)

    def error(self, exc: BaseException) -> EndpointError:
        return EndpointError(f"the model endpoint {self.base_url} failed: {one_line(exc, 200)}")


def _null_content(messages) -> bool:
    """Whether a request carries an assistant message that only calls tools (sent with null content)."""
    return any(getattr(m, "type", "") == "ai" and getattr(m, "tool_calls", None) and not m.content for m in messages)


def _http_error(exc: BaseException) -> bool:
    return any(cls.__name__ == "APIStatusError" and cls.__module__.startswith("openai") for cls in type(exc).__mro__)


def guard_middleware(endpoint: Endpoint, chat, record, task: str):
    """The middleware every model call of a task goes through: `tool_choice` set, one retry with "" for null
    contents where the server refuses them, and every failure of the call an `EndpointError`."""
    from langchain.agents.middleware import AgentMiddleware

    class EndpointGuard(AgentMiddleware):
        def wrap_model_call(self, request, handler):
            if request.tools:
                request = request.override(tool_choice=endpoint.tool_choice)
            try:
                return handler(request)
            except Exception as exc:  # noqa: BLE001 - whatever the client raised, said in one line below
                switchable = not getattr(chat, "empty_content", True)  # our Chat, still sending null
                if not (switchable and _http_error(exc) and _null_content(request.messages)):
                    raise endpoint.error(exc) from None
                chat.empty_content = True
                record("interop", task=task, why=one_line(exc, 200),
                       change="assistant messages that only call tools are sent with content \"\" instead of null")
                try:
                    return handler(request)
                except Exception as again:  # noqa: BLE001
                    raise endpoint.error(again) from None

    return EndpointGuard()
