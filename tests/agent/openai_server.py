"""A local OpenAI-protocol chat endpoint for the agent's tests: 127.0.0.1 only, scripted replies, bounded.

    with ScriptedEndpoint(replies, max_requests=20) as endpoint:    # endpoint.url, endpoint.requests
        ChatOpenAI(base_url=endpoint.url, model="scripted", api_key="test")

It speaks POST /v1/chat/completions as OpenAI does, non-streaming (one chat.completion) and streaming (server-sent
chat.completion.chunk events, tool-call arguments split over several chunks, then [DONE]). Replies are dicts
{"content": str, "tool_calls": [{"name", "args", "id"}]}, answered in order; past the script, or past
`max_requests`, it answers "done" / 429. It stops when the `with` block ends. It stands in for a real endpoint,
which this machine cannot reach; the client side (ChatOpenAI, LangChain) is the real one.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ScriptedEndpoint:
    """`reject_null`: answer 500 to a request holding an assistant message with null content, as llama-cpp-python
    does; `delay`: seconds to wait before each answer. A reply {"empty": True} is a stream with no chunk (or a
    whole reply with no choice), {"malformed": True} a body that is not JSON."""

    def __init__(self, replies: list[dict], max_requests: int = 40, *, reject_null: bool = False,
                 delay: float = 0.0):
        self.replies, self.max_requests = list(replies), max_requests
        self.reject_null, self.delay = reject_null, delay
        self.requests: list[dict] = []
        self._lock = threading.Lock()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                try:
                    self._answer()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (its timeout): nothing to answer

            def _answer(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with endpoint._lock:
                    endpoint.requests.append({"path": self.path, "auth": self.headers.get("Authorization"),
                                              "body": body})
                    over = len(endpoint.requests) > endpoint.max_requests
                    reply = endpoint.replies.pop(0) if endpoint.replies else {"content": "done"}
                if self.path != "/v1/chat/completions" or over:
                    self.send_response(404 if not over else 429)
                    self.end_headers()
                    return
                if endpoint.delay:
                    time.sleep(endpoint.delay)
                if endpoint.reject_null and any(m.get("role") == "assistant" and m.get("content") is None
                                                for m in body.get("messages", [])):
                    with endpoint._lock:
                        endpoint.replies.insert(0, reply)  # not answered: the next request gets it
                    self._send(500, b'{"error": {"message": "Value is not a string: content", "code": 500}}')
                    return
                if reply.get("malformed"):
                    self._send(200, b"{this is not json")
                    return
                if body.get("stream"):
                    self._stream(reply, body["model"])
                else:
                    self._whole(reply, body["model"])

            def _send(self, status, data):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _calls(self, reply):
                return [{"id": c["id"], "type": "function",
                         "function": {"name": c["name"], "arguments": json.dumps(c["args"])}}
                        for c in reply.get("tool_calls", [])]

            def _whole(self, reply, model):
                message = {"role": "assistant", "content": reply.get("content", "")}
                if reply.get("tool_calls"):
                    message["tool_calls"] = self._calls(reply)
                data = json.dumps({"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": model,
                                   "choices": [{"index": 0, "message": message,
                                                "finish_reason": "tool_calls" if reply.get("tool_calls") else "stop"}],
                                   "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _stream(self, reply, model):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()

                def send(delta, finish=None):
                    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": model,
                             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())

                if reply.get("empty"):
                    self.wfile.write(b"data: [DONE]\n\n")
                    return
                send({"role": "assistant", "content": ""})
                if reply.get("content"):
                    send({"content": reply["content"]})
                for i, call in enumerate(self._calls(reply)):
                    args = call["function"]["arguments"]
                    half = len(args) // 2
                    send({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                          "function": {"name": call["function"]["name"], "arguments": args[:half]}}]})
                    send({"tool_calls": [{"index": i, "function": {"arguments": args[half:]}}]})
                send({}, "tool_calls" if reply.get("tool_calls") else "stop")
                self.wfile.write(b"data: [DONE]\n\n")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)
