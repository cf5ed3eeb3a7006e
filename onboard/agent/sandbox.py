"""Run candidate code only in a child process with limits: CPU time per probe, address space, wall clock per
probe, a scratch working directory, one thread, no secrets in its environment, no network (`probe` refuses
connections before it imports any candidate).

    with Sandbox(Limits()) as sandbox:
        result = sandbox.probe(request)     # the probe's JSON result, or a failed one saying why

One probe process serves a session (it builds each twin once); a candidate that stalls it, exhausts its CPU
time or memory, or crashes the interpreter fails its round, and the next probe gets a fresh process. The
agent's own process never imports candidate code. Probe processes are forked by a zygote
(`onboard.agent.zygote`) that imported torch and transformers once; `warm()` starts one early, so those imports
run while the agent's process inspects the model.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass

from onboard.agent.zygote import ENDED


@dataclass(frozen=True)
class Limits:
    cpu_seconds: int = 300  # per probe
    memory_bytes: int = 16 << 30  # address space: torch alone maps a few GiB
    wall_seconds: int = 600  # per probe


def _environment() -> dict:
    env = {key: value for key, value in os.environ.items()
           if not key.endswith(("_API_KEY", "_TOKEN", "_SECRET")) and "PROXY" not in key.upper()}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return env


class _Zygote:
    """A zygote process (`onboard.agent.zygote`) and the threads that drain its pipes: its stdout lines (the
    zygote's answers and the results of the probe process it forked, which shares its pipes) into `lines`, the
    last lines of its stderr into `errors`."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-m", "onboard.agent.zygote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     cwd=tempfile.gettempdir(), env=_environment())
        self.lines: queue.Queue = queue.Queue()
        self.errors: collections.deque = collections.deque(maxlen=20)  # drained as it comes: a full pipe stalls
        self.ended = threading.Event()  # set when the zygote's stderr says a probe process has ended
        stdout, stderr = self.proc.stdout, self.proc.stderr
        threading.Thread(target=lambda: [self.lines.put(line) for line in stdout] + [self.lines.put(None)],
                         daemon=True).start()
        threading.Thread(target=self._drain, args=(stderr,), daemon=True).start()

    def _drain(self, stderr) -> None:
        for line in stderr:
            if line.strip() == ENDED:
                self.ended.set()
            else:
                self.errors.append(line)
        self.ended.set()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, message: dict) -> bool:
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError, ValueError):
            return False

    def last_error(self) -> str:
        """The last line on stderr (of the probe process that just ended, once `ended_error` has waited)."""
        return next((line.strip() for line in reversed(self.errors) if line.strip()), "no output")

    def ended_error(self) -> str:
        """The last line a probe process that has ended wrote to stderr (read up to the zygote's mark)."""
        self.ended.wait(timeout=10)
        self.ended.clear()
        return self.last_error()

    def close(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()


_idle: list[_Zygote] = []  # zygotes no sandbox holds
_lock = threading.Lock()


def warm() -> None:
    """Start a zygote now (when none is idle), so its imports overlap with the caller's own work."""
    with _lock:
        if not any(z.alive() for z in _idle):
            _idle.append(_Zygote())


def _take() -> _Zygote:
    with _lock:
        while _idle:
            zygote = _idle.pop()
            if zygote.alive():
                return zygote
            zygote.close()
    return _Zygote()


def _give_back(zygote: _Zygote) -> None:
    with _lock:
        _idle.append(zygote)


@atexit.register
def _close_idle() -> None:
    with _lock:
        while _idle:
            _idle.pop().close()


class Sandbox:
    def __init__(self, limits: Limits = Limits()):
        self.limits = limits
        self._zygote: _Zygote | None = None
        self._pid: int | None = None  # the session's probe process
        self._scratch = tempfile.TemporaryDirectory(prefix="onboard-probe-")

    @property
    def pid(self) -> int | None:
        """The session's probe process, once a probe has started it."""
        return self._pid

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._pid is not None:
            self._end(kill=not self._zygote.send({"op": "end"}))
        if self._zygote is not None:
            if self._zygote.alive():
                _give_back(self._zygote)
            else:
                self._zygote.close()
            self._zygote = None
        self._scratch.cleanup()

    def _start(self) -> str:
        """Fork this session's probe process; "" or why it could not be started."""
        for _ in range(2):  # a zygote that died since it was last used is replaced once
            if self._zygote is None or not self._zygote.alive():
                if self._zygote is not None:
                    self._zygote.close()
                self._zygote = _take()
            self._zygote.errors.clear()
            if self._zygote.send({"op": "session", "cwd": self._scratch.name,
                                  "memory_bytes": self.limits.memory_bytes}):
                try:
                    line = self._zygote.lines.get(timeout=self.limits.wall_seconds)
                except queue.Empty:
                    line = None
                if line is not None:
                    self._pid = json.loads(line)["session"]
                    return ""
            why = self._zygote.last_error()
            self._zygote.close()
            self._zygote = None
        return f"the probe process could not be started: {why[:300]}"

    def _end(self, *, kill: bool) -> None:
        """End the session's probe process (`kill`: at once) and wait for the zygote to say it has ended."""
        pid, self._pid, zygote = self._pid, None, self._zygote
        if kill:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        while True:  # a result the process wrote before it was killed is passed over
            try:
                line = zygote.lines.get(timeout=30)
            except queue.Empty:
                line = None
            if line is None:  # the zygote itself is gone or stuck: the next session gets another
                zygote.close()
                return
            if line.startswith('{"ended"'):
                zygote.ended_error()
                return

    def probe(self, request: dict) -> dict:
        if self._pid is None and (why := self._start()):
            return {"passed": False, "note": why}
        zygote = self._zygote
        line = None
        if zygote.send({**request, "cpu_seconds": self.limits.cpu_seconds}):
            try:
                line = zygote.lines.get(timeout=self.limits.wall_seconds)
            except queue.Empty:
                self._end(kill=True)
                return {"passed": False, "note": f"the probe ran past {self.limits.wall_seconds} s and was stopped"}
        if line is None:  # the zygote ended with its probe process
            self._pid = None
            return {"passed": False, "note": f"the probe process ended: {zygote.last_error()[:300]}"}
        try:
            message = json.loads(line)
        except json.JSONDecodeError:
            self._end(kill=True)
            return {"passed": False, "note": f"the probe printed no result: {line.strip()[:300]}"}
        if isinstance(message, dict) and set(message) == {"ended"}:  # crashed, killed for CPU time or memory
            self._pid = None
            return {"passed": False, "note": f"the probe process ended with code {message['ended']}: "
                                             f"{zygote.ended_error()[:300]}"}
        return message
