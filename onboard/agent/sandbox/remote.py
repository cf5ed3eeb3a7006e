"""Generated modules in the `onboard` process as stand-ins: whole-twin verification runs the adapted twin here,
and each generated module's forward and backward run in a candidate's process.

    with Host(sandbox) as host:
        adapter.adapt(model, load_generated=host.load)   # each generated file: sent as text, never imported here
        verify(...)                                       # the stand-ins call out; gradients come back through autograd

`Host.load(path)` reads a generated file as text, has the candidate's process compile it, and returns a class
that, like `runtime.generated.Generated`, holds the original module's parameters, buffers and settings at their
own names (so the model's state_dict and every gradient are where verification looks for them), and whose
forward sends the module's state and its inputs to that process: an autograd function whose backward sends the
cotangents and receives the gradients of the inputs and parameters. Each call has the candidate's wall-clock
limit: a generated module that hangs fails verification, and does not hang the command.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from onboard.agent.sandbox import wire
from onboard.agent.sandbox.process import Stopped
from runtime.generated import Generated, ModuleState

_HOSTS: dict[int, Host] = {}  # stand-ins hold a host's number: deep copies of a model share its host
_numbers = itertools.count(1)


class RemoteFailed(RuntimeError):
    """A generated module that failed in its process (its error, or why the process stopped)."""


def _state(module: Generated) -> tuple[dict, dict]:
    state = ModuleState.of(module)
    tensors = {f"p:{n}": p.detach() for n, p in state.parameters.items()}
    tensors.update({f"b:{n}": b.detach() for n, b in state.buffers.items()})
    header = {"settings": state.settings, "parameters": sorted(state.parameters), "buffers": sorted(state.buffers),
              "persistent": sorted(state.persistent), "replaces": state.replaces}
    return header, tensors


class Host:
    def __init__(self, sandbox):
        self.sandbox = sandbox
        self.number = next(_numbers)
        self.worker = None
        self.calls = itertools.count(1)
        self.loaded: dict[str, str] = {}  # file name -> code
        self.names: dict[str, set[str]] = {}  # file name -> state names of the modules it stands in for
        self.checked: dict[str, list[str]] = {}  # file name -> the guard's problems
        self.failed: dict[str, str] = {}  # file name -> why its process was stopped: it is not run again

    def __enter__(self) -> Host:
        _HOSTS[self.number] = self
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        _HOSTS.pop(self.number, None)
        if self.worker is not None:
            self.sandbox.release(self.worker, spare=False)
            self.worker = None

    def _request(self, header: dict, tensors: dict | None = None) -> tuple[dict, dict]:
        if self.worker is None or self.worker.dead:
            self.worker = self.sandbox.acquire()
            for name, code in self.loaded.items():  # a fresh process after one was stopped: load again
                self._checked({"op": "load", "key": name, "name": name, "code": code})
        return self._checked(header, tensors)

    def _checked(self, header: dict, tensors: dict | None = None) -> tuple[dict, dict]:
        try:
            reply, got = self.worker.request(header, tensors, seconds=self.sandbox.limits.call_seconds,
                                             cpu_seconds=self.sandbox.limits.cpu_seconds)
        except Stopped as exc:
            why = f"the generated module's process {exc}"
            if header.get("key"):  # a module that hung or crashed once fails at once from then on
                self.failed[header["key"]] = why
            raise RemoteFailed(why) from None
        if self.worker.refusals:
            raise RemoteFailed(f"refused by the sandbox: {'; '.join(self.worker.refusals[:3])}")
        if "error" in reply:
            raise RemoteFailed(f"the generated module failed: {reply['error']}")
        return reply, got

    def load(self, path: Path | str) -> type[Generated]:
        """The stand-in class for the generated file at `path` (read here as text; compiled over there)."""
        path = Path(path)
        code = path.read_text()
        if self.loaded.get(path.name, code) != code:  # another file of that name: judged afresh
            self.failed.pop(path.name, None)
        self.loaded[path.name] = code
        self._request({"op": "load", "key": path.name, "name": path.name, "code": code})
        return type(f"Remote_{path.stem}", (Remote,), {"host": self.number, "key": path.name})

    def admit(self, key: str, names: set[str]) -> None:
        """Note the state names of a module a loaded file stands in for (the guard checks the file against those
        of all of them, on the first call: the same module reads other settings in other layers)."""
        self.names.setdefault(key, set()).update(names)
        self.checked.pop(key, None)

    def _guard(self, key: str) -> None:
        """A bundle's generated file is hostile input too: checked as a candidate is before it runs."""
        from onboard.agent.guard import check

        if key not in self.checked:
            self.checked[key] = check(self.loaded.get(key, ""), self.names.get(key, set()))
        if self.checked[key]:
            raise RemoteFailed(f"generated/{key} is refused by the guard: {self.checked[key][0]}")

    def call(self, module: Remote, args, kwargs):
        self._guard(module.key)
        if module.key in self.failed:
            raise RemoteFailed(self.failed[module.key])
        state, tensors = _state(module)
        a, _ = wire.pack(args, tensors, prefix="a")
        k, _ = wire.pack(kwargs, tensors, prefix="k")
        inputs = wire.leaves((args, kwargs))
        differentiable = [t for t in inputs if t.is_floating_point() and t.requires_grad]
        params = [p for _, p in sorted(module.named_parameters()) if p.requires_grad]
        grad = torch.is_grad_enabled() and bool(differentiable or params)
        number = next(self.calls)
        header = {"op": "call", "id": number, "key": module.key, "state": state, "args": a, "kwargs": k,
                  "training": module.training, "grad": grad, "rng": None, "cotangents": None}
        if not grad:
            reply, got = self._request(header, tensors)
            return wire.unpack(reply["outputs"], got)
        box: dict = {}
        floats = _Call.apply(box, self, header, tensors, module, inputs, *differentiable, *params)
        return _rebuild(box["structure"], box["tensors"], floats)

    def backward(self, number: int, key: str, cotangents: list[torch.Tensor]) -> dict:
        if key in self.failed:
            raise RemoteFailed(self.failed[key])
        structure, tensors = wire.pack(cotangents, prefix="c")
        _, got = self._request({"op": "backward", "id": number, "key": key, "cotangents": structure}, tensors)
        return got


def _rebuild(structure, tensors: dict, floats: tuple):
    """The call's output with its floating tensors replaced by the autograd function's outputs, in order."""
    keyed = [k for k in _keys(structure) if tensors[k].is_floating_point()]
    replaced = dict(tensors)
    replaced.update(zip(keyed, floats))
    return wire.unpack(structure, replaced)


def _keys(structure) -> list[str]:
    (kind, body), = structure.items()
    if kind == "t":
        return [body]
    if kind in ("tuple", "list"):
        return [k for item in body for k in _keys(item)]
    if kind == "dict":
        return [k for _, item in body for k in _keys(item)]
    return []


class _Call(torch.autograd.Function):
    @staticmethod
    def forward(ctx, box, host, header, tensors, module, inputs, *differentiable):
        reply, got = host._request(header, tensors)
        outputs = wire.unpack(reply["outputs"], got)
        box["structure"], box["tensors"] = reply["outputs"], {k: v for k, v in got.items() if k.startswith("o")}
        ctx.host, ctx.number, ctx.key = host, header["id"], header["key"]
        ctx.inputs = [i for i, t in enumerate(inputs) if t.is_floating_point() and t.requires_grad]
        ctx.params = [n for n, p in sorted(module.named_parameters()) if p.requires_grad]
        floats = [t for t in wire.leaves(outputs) if t.is_floating_point()]
        ctx.shapes = [(t.shape, t.dtype) for t in floats]
        return tuple(floats)

    @staticmethod
    def backward(ctx, *grads):
        cotangents = [g if g is not None else torch.zeros(shape, dtype=dtype)
                      for g, (shape, dtype) in zip(grads, ctx.shapes)]
        got = ctx.host.backward(ctx.number, ctx.key, cotangents)
        out = [got.get(f"g:input {i}") for i in ctx.inputs] + [got.get(f"g:{n}") for n in ctx.params]
        return (None, None, None, None, None, None, *out)


class Remote(Generated):
    """A generated module whose computation runs in a candidate's process (module docstring)."""

    host: int = 0
    key: str = ""

    def __init__(self, original):
        names = ModuleState.of(original).names() if isinstance(original, torch.nn.Module) else original.names()
        host = _HOSTS.get(self.host)
        if host is None:
            raise RemoteFailed("the candidates' process this module runs in has been closed")
        host.admit(self.key, names)
        super().__init__(original)

    def forward(self, *args, **kwargs):
        host = _HOSTS.get(self.host)
        if host is None:
            raise RemoteFailed("the candidates' process this module ran in has been closed")
        return host.call(self, args, kwargs)
