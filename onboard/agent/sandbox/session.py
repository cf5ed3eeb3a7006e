"""An agent session's sandbox: the reference's process, and a fresh candidate's process for every candidate, forked
from the sandbox's zygote in a jail of the kernel's (`jail`, `zygote`).

    with Sandbox(model_ref, trust_remote_code=False, limits=Limits()) as sandbox:
        reference = sandbox.reference()      # one per session: it builds the twin once
        with sandbox.candidate() as worker:  # a process no candidate has run in; ended with the round
            ...

Both kinds of process start ahead of need (`warm`, and a spare candidate process forked whenever a round ends), so
their imports overlap with the caller's work: a candidate's round does not wait for torch to load. The zygote
imports torch once per sandbox; a fork of it is ready in tens of milliseconds, where a new interpreter took 1.5 s
of CPU.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from onboard.agent.sandbox import jail
from onboard.agent.sandbox.process import REFERENCE_ENV, Stopped, Worker
from onboard.agent.sandbox.zygote import Forked, Retired, Zygote
from onboard.errors import OnboardError

CANDIDATE = "onboard.agent.sandbox.candidate_worker"
REFERENCE = "onboard.agent.sandbox.reference_worker"


@dataclass(frozen=True)
class Limits:
    wall_seconds: int = 60  # a candidate's round on the wall clock: the probe and its timing
    start_seconds: int = 180  # a candidate's process starting (imports, before any candidate code): the machine's cost
    call_seconds: int = 10  # one call of a candidate (on the twin they take milliseconds): a hang costs this
    cpu_seconds: int = 120  # CPU time of a candidate's process per request
    memory_bytes: int = 8 << 30  # address space: torch alone maps a few GiB
    reply_bytes: int = 512 << 20  # the most a candidate's reply may carry (the twin's take kilobytes to megabytes)
    reference_seconds: int = 600  # the reference's requests (the model's own code, at lengths it may run slowly)


class _Starting:
    """A worker being started in a thread."""

    def __init__(self, module: str, scratch: Path, limits: Limits, passed_env: tuple[str, ...] = (), zygote=None):
        """`zygote`: a callable that gives the sandbox's zygote (a candidate's process is a fork of it)."""
        self.worker: Worker | None = None
        self.error: BaseException | None = None
        self.proc = None  # the process, as soon as it exists
        candidate = module == CANDIDATE

        def start():
            for _ in range(2):  # a second time where the zygote retired: the sandbox starts another
                try:
                    extra = {"max_reply": limits.reply_bytes, "zygote": zygote()} if candidate else {}
                    self.worker = Worker(module, scratch, memory_bytes=limits.memory_bytes, passed_env=passed_env,
                                         jailed=candidate, started=lambda proc: setattr(self, "proc", proc),
                                         **extra)
                    return
                except Retired as exc:
                    self.error = exc
                except BaseException as exc:  # noqa: BLE001 - handed to whoever takes it
                    self.error = exc
                    return

        self.thread = threading.Thread(target=start, daemon=True)
        self.thread.start()

    def abandon(self) -> None:
        """Stop a worker nobody will take: killed where it is still starting (its imports are CPU spent for
        nothing once the session ends), closed where it is ready."""
        if self.worker is None and self.proc is not None and self.proc.poll() is None:
            if isinstance(self.proc, Forked):
                self.proc.kill()
            else:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        self.thread.join(30)
        if self.worker is not None:
            self.worker.close()

    def take(self, seconds: float) -> Worker:
        self.thread.join(seconds)
        if self.worker is None:
            raise Stopped(f"could not start: {self.error or f'not ready after {seconds:.0f} s'}")
        return self.worker


_OPEN: set = set()  # sandboxes not closed yet: closed at exit, so no process outlives the command


@atexit.register
def _close_all() -> None:
    for sandbox in list(_OPEN):
        sandbox.close()


class Sandbox:
    def __init__(self, model_ref: str = "", *, trust_remote_code: bool = False, limits: Limits = Limits()):
        """OnboardError, one line saying what to install, where a candidate's jail cannot be made here: there is no
        weaker sandbox to fall back to."""
        why = jail.why_not()
        if why:
            raise OnboardError(f"no sandbox for candidate code: {why}")
        self.model_ref, self.trust_remote_code, self.limits = model_ref, trust_remote_code, limits
        _OPEN.add(self)
        self._scratch = Path(tempfile.mkdtemp(prefix="onboard-sandbox-"))
        self._count = 0
        self._reference: _Starting | None = None
        self._spare: _Starting | None = None
        self._workers: list[Worker] = []
        self._zygote: Zygote | None = None
        self._retired: list[Zygote] = []
        self._zygote_lock = threading.Lock()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def zygote(self) -> Zygote:
        """The process every candidate's process of this sandbox is forked from (started on first need, and again
        where it died or retired: a retired one is kept until the sandbox closes, its forks still running)."""
        with self._zygote_lock:
            old = self._zygote
            if old is None or old.dead or old.retired:
                if old is not None and old.dead:
                    old.close()
                elif old is not None:
                    self._retired.append(old)
                self._zygote = Zygote(self._folder("zygote"), start_seconds=self.limits.start_seconds)
            return self._zygote

    def _candidate(self) -> _Starting:
        return _Starting(CANDIDATE, self._folder("candidate"), self.limits, zygote=self.zygote)

    def _folder(self, kind: str) -> Path:
        self._count += 1
        return self._scratch / f"{kind}-{self._count}"

    def warm(self) -> None:
        """Start the reference's process and a candidate's process now."""
        if self._reference is None:
            self._reference = _Starting(REFERENCE, self._folder("reference"), self.limits, REFERENCE_ENV)
        if self._spare is None:
            self._spare = self._candidate()

    def reference(self) -> Worker:
        if self._reference is None or (self._reference.worker is not None and self._reference.worker.dead):
            self._reference = _Starting(REFERENCE, self._folder("reference"), self.limits, REFERENCE_ENV)
        worker = self._reference.take(self.limits.reference_seconds)
        if worker not in self._workers:
            self._workers.append(worker)
        return worker

    def acquire(self) -> Worker:
        """A fresh candidate's process; `release` it when done (which starts the next one: a process importing
        torch beside a round would slow the round's timing run)."""
        starting = self._spare or self._candidate()
        self._spare = None
        worker = starting.take(self.limits.start_seconds)
        self._workers.append(worker)
        return worker

    def release(self, worker: Worker, *, spare: bool = True) -> None:
        worker.close()
        if worker in self._workers:
            self._workers.remove(worker)
        shutil.rmtree(worker.scratch, ignore_errors=True)
        if spare and self._spare is None:
            self._spare = self._candidate()

    @contextlib.contextmanager
    def candidate(self):
        """A fresh candidate's process for one round (closed, or killed, when the round ends)."""
        worker = self.acquire()
        try:
            yield worker
        finally:
            self.release(worker)

    def close(self) -> None:
        if self._spare is not None:  # a candidate's process started ahead of a round that will not come
            self._spare.abandon()
        if self._reference is not None:  # killed where still starting, as the spare is
            self._reference.abandon()
            if self._reference.worker in self._workers:
                self._workers.remove(self._reference.worker)
        self._spare = self._reference = None
        for worker in self._workers:
            worker.close()
        self._workers.clear()
        with self._zygote_lock:
            for zygote in [*self._retired, *([self._zygote] if self._zygote is not None else [])]:
                zygote.close()
            self._zygote, self._retired = None, []
        shutil.rmtree(self._scratch, ignore_errors=True)
        _OPEN.discard(self)
