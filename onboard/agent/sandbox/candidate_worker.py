"""The candidate's process: the only place model-written code runs (started by `onboard.agent.sandbox.process`).

    python -m onboard.agent.sandbox.candidate_worker READ_FD WRITE_FD PARENT_PID MEMORY_BYTES
    python -m onboard.agent.sandbox.candidate_worker --zygote CONTROL_FD     # forks such processes (`zygote`)

It runs in the kernel's jail (`jail`: PARENT_PID 0), raises its own walls first (`confine.early`: limits),
imports torch and the runtime API and nothing of transformers or of the judge, warms torch up, loads its seccomp
allow-list (`confine.seccomp`) and the audit hook (`confine.audit`), and only then reads requests, one frame each (`wire`), on its own pipe (its stdout is its
stderr, so nothing a candidate prints is a reply):

    load      {key, name, code}                   compile a candidate's file as a module of its own
    call      {id, key, state, args, kwargs, training, grad, rng, cotangents, keep}
              the candidate built on `state` (settings; parameters and buffers as tensors: the module's class is
              never here), run on the inputs; with cotangents also backward. Replies with the outputs, the
              gradients of every floating input and parameter, and the parameters and buffers after the call
    backward  {id, cotangents}                    backward of a call kept for it (a remote module's backward)
    repeat    {id, times}                         run a call again `times` times (the judge times it from outside)
    end

It answers with tensors and an error text at most: what they mean, and whether they pass, is decided in the
`onboard` process (`judge`), which never imports candidate code.
"""

from __future__ import annotations

import collections
import os
import sys
import types

KEEP = 512  # calls kept for a later backward or repeat


def _warm() -> None:
    """Run the common ops forward and backward once, so torch's lazy imports happen before the audit hook."""
    import torch
    import torch.nn.functional as F

    x = torch.randn(2, 5, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    y = F.silu(F.linear(x, w)) * torch.sigmoid(x) + F.gelu(x) + torch.tanh(x) + F.softplus(x)
    y = F.rms_norm(y, (8,)) + F.layer_norm(y, (8,)) + torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
    p = torch.softmax(torch.einsum("bsh,gh->bsg", y, w), -1)
    top = torch.topk(p, 2, dim=-1)
    z = p.gather(-1, top.indices).sum() + torch.cumsum(y, 1).sum() + torch.logsumexp(y, -1).sum()
    z = z + F.conv1d(y.transpose(1, 2), torch.randn(8, 1, 3), groups=8, padding=2).sum() + F.pad(y, (1, 1)).sum()
    z = z + torch.where(y > 0, y, -y).masked_fill(y < -1, 0).sum() + y.float().double().float().sum()
    z.backward(retain_graph=True)
    torch.autograd.backward([y], [torch.ones_like(y)])  # the worker's own backward: imports symbolic shapes
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the judge's autocast case
        F.linear(x, w).sum().backward()
    torch.default_generator.manual_seed(0)
    torch.rand(3).bernoulli()
    torch.multinomial(torch.ones(4), 2)


ONCE_CALLED = [0]  # calls of a runtime op differentiable once since the last reset (`call`'s second derivatives)


def _count_once_differentiable() -> None:
    """Each runtime op differentiable once, replaced in its module by one that counts its calls (before the
    candidate imports it): its second derivatives go uncompared only where such an op really ran."""
    import functools

    from onboard.agent.capabilities import ONCE_DIFFERENTIABLE

    for full in ONCE_DIFFERENTIABLE:
        module_name, _, name = full.rpartition(".")
        module = sys.modules[module_name]
        op = getattr(module, name)

        @functools.wraps(op)
        def counted(*args, _op=op, **kwargs):
            ONCE_CALLED[0] += 1
            return _op(*args, **kwargs)

        setattr(module, name, counted)


class Server:
    def __init__(self, reader, writer):
        from onboard.agent.sandbox import wire

        self.wire, self.reader, self.writer = wire, reader, writer
        self.classes: dict[str, type] = {}
        self.calls: collections.OrderedDict = collections.OrderedDict()

    def reply(self, header: dict, tensors: dict | None = None) -> None:
        self.wire.write(self.writer, header, tensors)

    def serve(self) -> None:
        while True:
            try:
                header, tensors = self.wire.read(self.reader)
            except EOFError:
                return
            op = header.get("op")
            if op == "end":
                return
            try:
                handler = {"load": self.load, "call": self.call, "backward": self.backward,
                           "repeat": self.repeat, "sequence": self.sequence}[op]
                handler(header, tensors)
            except BaseException as exc:  # noqa: BLE001 - the candidate's failure is its reply
                if isinstance(exc, KeyboardInterrupt | SystemExit | MemoryError):
                    raise
                text = (str(exc).splitlines() or [""])[0][:400]
                # the audit hook's refusal (candidate code cannot name PermissionError, nor catch anything)
                refused = isinstance(exc, PermissionError) and text.startswith("the sandbox refused")
                self.reply({"error": f"{type(exc).__name__}: {text}", "refused": refused})

    def load(self, header: dict, _tensors: dict) -> None:
        from runtime.generated import Generated

        key, name = str(header["key"]), str(header.get("name", "candidate.py"))
        module = types.ModuleType(f"onboard_candidate_{len(self.classes)}")
        # dont_inherit: compiled with the file's own __future__ imports only, as an import of it in training compiles it
        # (this file's `annotations` would otherwise leave a candidate's annotations unevaluated here alone)
        code = compile(header["code"], name, "exec", dont_inherit=True)
        exec(code, module.__dict__)  # noqa: S102 - what this process is for
        cls = module.__dict__.get("Replacement")
        if not (isinstance(cls, type) and issubclass(cls, Generated)):
            raise TypeError(f"{name} defines no Replacement(runtime.generated.Generated)")
        self.classes[key] = cls
        self.reply({"loaded": key})

    def _module(self, header: dict, tensors: dict, training: bool):
        """A fresh instance of the loaded class `header["key"]` on the state the judge sent."""
        from torch import nn

        from runtime.generated import ModuleState

        state = header["state"]
        params = {n: nn.Parameter(tensors[f"p:{n}"].clone(), requires_grad=True) for n in state["parameters"]}
        buffers = {n: tensors[f"b:{n}"].clone() for n in state["buffers"]}
        module = self.classes[str(header["key"])](ModuleState(
            dict(state["settings"]), params, buffers, set(state.get("persistent", ())), training,
            str(state.get("replaces", ""))))
        module.train(training)
        return module

    def sequence(self, header: dict, tensors: dict) -> None:
        from onboard.agent.sandbox.calls import sequence

        module = self._module(header, tensors, True)
        batches = [(self.wire.unpack(b["args"], tensors), self.wire.unpack(b["kwargs"], tensors))
                   for b in header["batches"]]
        self.reply({"sequence": True}, sequence(module, batches, seed=int(header["seed"]), rng=int(header["rng"])))

    def call(self, header: dict, tensors: dict) -> None:
        from onboard.agent.sandbox.calls import Call

        training = bool(header["training"])
        module = self._module(header, tensors, training)
        cotangents = header.get("cotangents")
        cotangents = None if cotangents is None else self.wire.unpack(cotangents, tensors)
        second = header.get("second")  # a seed: second derivatives instead of first
        call = Call(module, self.wire.unpack(header["args"], tensors), self.wire.unpack(header["kwargs"], tensors),
                    grad=bool(header.get("grad", True)), rng=header.get("rng"),
                    inference=bool(header.get("inference")), frozen=header.get("frozen") is True,
                    autocast=header.get("autocast") is True, cotangents=cotangents if second is None else None)
        ONCE_CALLED[0] = 0
        out = call.run()
        structure, sent = self.wire.pack(out, prefix="o")
        once = ONCE_CALLED[0] > 0  # read before anything else of the candidate's runs
        if second is not None:
            sent.update(call.second(cotangents, int(second)))
        sent.update(call.grads())
        sent.update(call.state())
        self.calls[int(header["id"])] = call
        while len(self.calls) > KEEP:
            self.calls.popitem(last=False)
        self.reply({"outputs": structure, "drew": call.drew, "stream": call.stream, "once": once,
                    "written": call.written}, sent)

    def backward(self, header: dict, tensors: dict) -> None:
        call = self.calls.pop(int(header["id"]))
        call.backward(self.wire.unpack(header["cotangents"], tensors))
        self.reply({"backward": header["id"]}, call.grads())

    def repeat(self, header: dict, _tensors: dict) -> None:
        call = self.calls[int(header["id"])]
        for _ in range(max(0, int(header.get("times", 1)))):
            call.run()
        self.reply({"repeated": header["id"]})


def _prepare() -> None:
    """Everything before the walls close: torch, the runtime API the candidate may import, the warm-up."""
    import torch

    import runtime.generated  # noqa: F401 - the runtime API, imported before the walls close
    from onboard.agent.capabilities import RUNTIME_API
    from onboard.agent.sandbox import calls, wire  # noqa: F401

    for name in RUNTIME_API:
        __import__(name)
    _count_once_differentiable()
    torch.set_num_threads(1)
    _warm()


def _serve(read_fd: int, write_fd: int, jailed: bool, network: str) -> None:
    """Close the walls (in the jail: the kernel's allow-list of calls; then the audit hook), say ready, serve."""
    from onboard.agent.sandbox import confine

    reader, writer = os.fdopen(read_fd, "rb"), os.fdopen(write_fd, "wb")
    if jailed:
        confine.seccomp()
    confine.audit(os.getcwd())
    server = Server(reader, writer)
    server.reply({"ready": os.getpid(), "network": network or "a network namespace of its own",
                  "transformers": any(m.split(".")[0] == "transformers" for m in sys.modules)})
    server.serve()


PR_SET_DUMPABLE = 4
DUMPABLE = 0  # what the zygote sets its dumpable flag to (its children inherit it): not dumpable


def zygote(control_fd: int, serve=None) -> None:
    """The jail's first process when a sandbox forks its candidates' processes (`onboard.agent.sandbox.zygote`):
    it imports and warms up once, then on each request on `control_fd` (a Unix socket to `onboard`; the request
    carries the new process's two pipe ends and its stderr) forks a candidate's process, which closes the walls
    and serves as a started worker does. It never runs candidate code itself, and nothing a candidate can reach
    reaches it:

    - it is not dumpable, nor are its children: /proc/PID/mem, fd, environ and ptrace of it, or of a sibling, need
      CAP_SYS_PTRACE, which nothing in the jail has (a candidate alone in its pid namespace needed no such wall);
    - a child closes the control socket before anything else, so no candidate can ask for, or take, another's pipes;
    - after its imports it imports nothing, and the scratch folder is off its path: nothing a candidate writes is
      read by it, or by a later candidate's process;
    - each child works in a folder of its own under the scratch tmpfs (a name it cannot guess), removed when it
      ends; where anything is left after that (a tree deeper than the zygote's open-file limit lets it remove,
      a file outside the folder), it forks no more, and the sandbox starts another zygote, in a new tmpfs;
    - a request that fails is answered with its error: the zygote lives as long as the sandbox wants it, so the
      long-lived processes forked from it (whole-twin verification's) do not die with it;
    - signals go only to a child itself (`confine.seccomp`), and it cannot fork, so killing it ends all it is."""
    import ctypes
    import json
    import shutil
    import signal
    import socket
    import tempfile

    from onboard.agent.sandbox import confine

    serve = serve or _serve
    sock = socket.socket(fileno=control_fd)
    here = os.path.realpath(os.getcwd())
    sys.path[:] = [p for p in sys.path if p and os.path.realpath(p) != here]
    _prepare()
    # the allow-list's bindings find libseccomp by running ldconfig: once here, not in every fork before its walls
    confine.seccomp_available()
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, DUMPABLE, 0, 0, 0) != 0:
        os._exit(1)
    ended: list[int] = []

    def reap(*_):
        while True:
            try:
                pid, _status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            ended.append(pid)

    signal.signal(signal.SIGCHLD, reap)
    folders: dict[int, str] = {}  # a live child -> its folder
    own = _contents(here)  # what its own imports left (a cache folder torch makes), before any candidate ran
    sock.sendall(json.dumps({"ready": os.getpid()}).encode())
    while True:
        data, fds, _flags, _address = socket.recv_fds(sock, 4096, 3)
        if not data:
            break
        try:
            reap()  # (as well as on SIGCHLD: a child that has ended is swept before this request, whenever it ended)
            while ended:
                pid = ended.pop()
                shutil.rmtree(folders.pop(pid, ""), ignore_errors=True)
            left = _leftovers(here, own | set(folders.values()))
            if left:  # an ended candidate's files: no later candidate starts beside them
                sock.sendall(json.dumps({"retire": left}).encode())
                continue
            if len(fds) != 3:
                raise ValueError("three file descriptors expected")
            memory = int(json.loads(data)["memory"])
            folder = tempfile.mkdtemp(prefix="candidate-", dir=here)  # a name no other candidate can guess
            pid = os.fork()
            if pid == 0:
                _child(sock, fds, folder, memory, serve)
            folders[pid] = folder
            sock.sendall(json.dumps({"pid": pid}).encode())
        except Exception as exc:  # noqa: BLE001 - a request that fails ends that request, never the zygote
            sock.sendall(json.dumps({"error": f"{type(exc).__name__}: {str(exc)[:200]}"}).encode())
        finally:
            for fd in fds:
                os.close(fd)
    # asked to stop: the candidates' processes still running go on until they end (or are killed)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    while True:
        try:
            os.wait()
        except ChildProcessError:
            os._exit(0)


def _contents(here: str) -> set[str]:
    """The paths in the scratch tmpfs's top folder and in /dev/shm (the two places a jailed process may write)."""
    found = set()
    for folder in (here, "/dev/shm"):
        try:
            found |= {os.path.join(folder, name) for name in os.listdir(folder)}
        except OSError:
            pass
    return found


def _leftovers(here: str, kept: set[str]) -> str:
    """What the scratch tmpfs and /dev/shm hold besides `kept` (the zygote's own, the live candidates' folders):
    "" when nothing."""
    found = sorted(_contents(here) - kept)
    return f"{len(found)} things left by candidates that ended, such as {found[0]}" if found else ""


def _child(sock, fds: list[int], folder: str, memory: int, serve) -> None:
    """In the fork: drop what belongs to the zygote, take its own descriptors and folder, serve; never returns."""
    import signal

    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock.close()
        read_fd, write_fd, err_fd = fds
        os.dup2(err_fd, 2)
        os.dup2(2, 1)
        os.close(err_fd)
        low, high = sorted((read_fd, write_fd))
        os.closerange(3, low)
        os.closerange(low + 1, high)
        os.closerange(high + 1, 1 << 16)
        os.chdir(folder)
        os.environ["HOME"] = os.environ["TMPDIR"] = folder
        from onboard.agent.sandbox import confine

        confine.memory(memory)
        serve(read_fd, write_fd, True, "")
    except BaseException:  # noqa: BLE001 - a child never returns into the zygote's loop
        os._exit(1)
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str]) -> None:
    from onboard.agent.sandbox import confine

    if argv[1] == "--zygote":
        confine.early(0)
        zygote(int(argv[2]))
        return
    read_fd, write_fd, parent, memory = (int(a) for a in argv[1:5])
    network = confine.early(parent)
    confine.memory(memory)
    _prepare()
    _serve(read_fd, write_fd, parent == 0, network)


if __name__ == "__main__":
    main(sys.argv)
    # ended as asked: nothing here to save, and tearing down an interpreter that imported torch takes a
    # second that every round and every sandbox close would wait for
    sys.stderr.flush()
    os._exit(0)
