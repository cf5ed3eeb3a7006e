"""Run candidate code only in a child process with limits: CPU time per probe, address space, wall clock per
probe, a scratch working directory, one thread, no secrets in its environment, no network (`probe` refuses
connections before it imports any candidate).

    with Sandbox(Limits()) as sandbox:
        result = sandbox.probe(request)     # the probe's JSON result, or a failed one saying why

One probe process serves a session (it builds each twin once); a candidate that stalls it, exhausts its CPU
time or memory, or crashes the interpreter fails its round, and the next probe gets a fresh process. The
agent's own process never imports candidate code.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import resource
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    cpu_seconds: int = 300  # per probe
    memory_bytes: int = 16 << 30  # address space: torch alone maps a few GiB
    wall_seconds: int = 600  # per probe


def _limit(limits: Limits):
    def apply() -> None:
        # the probe lowers the soft CPU limit to (time used + cpu_seconds) before each request
        resource.setrlimit(resource.RLIMIT_CPU, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    return apply


def _environment() -> dict:
    env = {key: value for key, value in os.environ.items()
           if not key.endswith(("_API_KEY", "_TOKEN", "_SECRET")) and "PROXY" not in key.upper()}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return env


class Sandbox:
    def __init__(self, limits: Limits = Limits()):
        self.limits = limits
        self._proc: subprocess.Popen | None = None
        self._lines: queue.Queue = queue.Queue()
        self._errors: collections.deque = collections.deque()
        self._scratch = tempfile.TemporaryDirectory(prefix="onboard-probe-")

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stop()
        self._scratch.cleanup()

    def _start(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "onboard.agent.probe"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      cwd=self._scratch.name, env=_environment(), preexec_fn=_limit(self.limits))
        self._lines = queue.Queue()
        self._errors = collections.deque(maxlen=20)  # stderr is drained as it comes: a full pipe would stall it
        stdout, stderr = self._proc.stdout, self._proc.stderr
        threading.Thread(target=lambda: [self._lines.put(line) for line in stdout] + [self._lines.put(None)],
                         daemon=True).start()
        self._drain = threading.Thread(target=lambda: self._errors.extend(stderr), daemon=True)
        self._drain.start()

    def _stop(self) -> str:
        """End the probe process; the last line it wrote to stderr."""
        proc, self._proc = self._proc, None
        if proc is None:
            return ""
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdin.close()
        self._drain.join(timeout=10)  # the pipe ends with the process: what it wrote last is read
        return next((line.strip() for line in reversed(self._errors) if line.strip()), "no output")

    def probe(self, request: dict) -> dict:
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        try:
            self._proc.stdin.write(json.dumps({**request, "cpu_seconds": self.limits.cpu_seconds}) + "\n")
            self._proc.stdin.flush()
            line = self._lines.get(timeout=self.limits.wall_seconds)
        except queue.Empty:
            self._stop()
            return {"passed": False, "note": f"the probe ran past {self.limits.wall_seconds} s and was stopped"}
        except BrokenPipeError:
            line = None
        if line is None:
            code = self._proc.wait()
            return {"passed": False, "note": f"the probe process ended with code {code}: {self._stop()[:300]}"}
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            self._stop()
            return {"passed": False, "note": f"the probe printed no result: {line.strip()[:300]}"}
