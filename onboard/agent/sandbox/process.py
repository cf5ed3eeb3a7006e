"""A worker process of the agent's sandbox, seen from the `onboard` process: started from an allow-listed
environment in a scratch directory, spoken to in frames (`wire`) over a pipe of its own, stopped when it runs
past its time.

    worker = Worker("onboard.agent.sandbox.candidate_worker", scratch, memory_bytes=8 << 30)
    header, tensors = worker.request({"op": "call", ...}, tensors, seconds=60)   # Stopped: why it failed
    worker.cpu_seconds()                       # CPU time it has used (the kernel's count: it cannot lie about it)
    worker.close()

No variable of the caller's environment reaches a candidate's process (`environment`): a key in the user's
shell is not there to read. The worker raises its own walls (`confine`); this side bounds what it may cost:
every request has a deadline on the wall clock, after which the process (and its session, `start_new_session`)
is killed; CPU time is capped from outside (`resource.prlimit`) so it cannot raise its own; a reply is read
by a thread of this side within size limits, and what the worker writes to stderr is drained as it comes
(its last lines, and every line the audit hook wrote, are kept for the reason a round failed).
"""

from __future__ import annotations

import collections
import os
import queue
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from onboard.agent.sandbox import jail, wire
from onboard.agent.sandbox.confine import REFUSED

# what the reference process may see of the user's environment: where HuggingFace keeps its files
REFERENCE_ENV = ("HOME", "HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE", "XDG_CACHE_HOME")


OUTPUT_CAP = 8 << 20  # bytes a worker may write to stderr while starting, or in one request
LINE_BYTES = 2000  # of a line on stderr, what is kept


class Stopped(Exception):
    """A worker that failed to answer: it ran past its time, died, or wrote something that is not a frame."""


def environment(scratch: Path, *, passed: tuple[str, ...] = ()) -> dict:
    """A worker's whole environment, made here: one thread, offline, its home and temporary files in its scratch
    directory, the interpreter's import path; of the caller's own variables only the names in `passed`."""
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(scratch), "TMPDIR": str(scratch),
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONHASHSEED": "0", "THP_MEM_ALLOC_ENABLE": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    env.update({k: os.environ[k] for k in passed if k in os.environ})
    return env


_launches: queue.Queue = queue.Queue()
_launcher_lock = threading.Lock()
_launcher: threading.Thread | None = None


def _launch_forever() -> None:
    while True:
        args, kwargs, done, started = _launches.get()
        try:
            done.append(subprocess.Popen(args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            done.append(exc)
        started.set()


def popen(args: list[str], **kwargs) -> subprocess.Popen:
    """Popen from one thread that lives as long as this process: bubblewrap's --die-with-parent is the kernel's
    parent-death signal, which follows the *thread* that started a process, and the sandbox starts workers from
    threads that end."""
    global _launcher
    with _launcher_lock:
        if _launcher is None or not _launcher.is_alive():
            _launcher = threading.Thread(target=_launch_forever, name="onboard-jail-launcher", daemon=True)
            _launcher.start()
    done: list = []
    started = threading.Event()
    _launches.put((args, kwargs, done, started))
    started.wait()
    if isinstance(done[0], BaseException):
        raise done[0]
    return done[0]


def deepest_child(pid: int) -> int:
    """The deepest process below `pid` along first children: a jailed worker under bubblewrap's two processes."""
    while True:
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            return pid
        if not children:
            return pid
        pid = int(children[0])


class Worker:
    def __init__(self, module: str, scratch: Path, *, memory_bytes: int, passed_env: tuple[str, ...] = (),
                 max_reply: int = wire.MAX_PAYLOAD, start_seconds: float = 120.0, jailed: bool = False,
                 output_cap: int = OUTPUT_CAP, started=None, zygote=None):
        """`started(proc)`, where given, is told of the process as soon as it exists (before it is ready). With a
        `zygote` (`zygote.Zygote`) the process is a fork of it, in its jail, rather than a new interpreter."""
        self.scratch = Path(scratch)
        self.scratch.mkdir(parents=True, exist_ok=True)
        to_child, from_parent = os.pipe()[::-1]  # (write end here, read end there)
        from_child, to_parent = os.pipe()
        argv = [sys.executable, "-m", module, str(from_parent), str(to_parent), str(0 if jailed else os.getpid()),
                str(memory_bytes)]
        env = environment(self.scratch, passed=passed_env)
        self.forked = zygote is not None
        if self.forked:
            from_stderr, to_stderr = os.pipe()
            try:
                self.proc = zygote.start((from_parent, to_parent, to_stderr), memory_bytes, from_stderr,
                                         seconds=start_seconds)
            except BaseException:
                for fd in (from_stderr, to_child, from_child):
                    os.close(fd)
                raise
            finally:
                for fd in (from_parent, to_parent, to_stderr):
                    os.close(fd)
        else:
            if jailed:  # its walls are the kernel's (`jail`): no pid of ours to watch, bubblewrap ends it with us
                argv = jail.command(argv)  # (its PYTHONPATH, HOME and TMPDIR are the jail's)
            self.proc = (popen if jailed else subprocess.Popen)(
                argv, pass_fds=(from_parent, to_parent), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE, cwd=self.scratch, env=env, start_new_session=True)
            os.close(from_parent)
            os.close(to_parent)
        if started is not None:
            started(self.proc)
        self.pid = self.proc.pid  # the worker's own pid once it is ready (under bubblewrap: two levels down)
        self.errors: collections.deque = collections.deque(maxlen=30)
        self.refusals: list[str] = []
        self.output_bytes, self.output_cap, self.flooded = 0, output_cap, False
        self.replies: queue.Queue = queue.Queue()
        self.dead = ""  # why the worker can no longer answer
        self._writer = os.fdopen(to_child, "wb")
        self._reader = os.fdopen(from_child, "rb")
        self._max_reply = max_reply
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._drain, daemon=True).start()
        self.ready = self._reply(start_seconds, "starting")[0]
        if jailed and not self.forked:
            self.pid = deepest_child(self.proc.pid)

    def _read(self) -> None:
        try:
            while True:
                self.replies.put(wire.read(self._reader, max_payload=self._max_reply))
        except EOFError:
            self.replies.put(None)
        except (wire.WireError, OSError, ValueError, RecursionError, MemoryError) as exc:
            self.replies.put(exc if not isinstance(exc, RecursionError) else wire.WireError("a header nested too deep"))

    def _drain(self) -> None:
        """Read the worker's stderr in chunks as it comes, keeping at most a line's head: however much it writes,
        with or without newlines, this side holds a few kilobytes of it. Past `output_cap` bytes since the last
        request began, the worker is killed (a process that floods its output is not computing an answer)."""
        fd, partial = self.proc.stderr.fileno(), b""
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:
                return
            if not chunk:
                break
            self.output_bytes += len(chunk)
            if self.output_bytes > self.output_cap and not self.flooded:
                self.flooded = True
                self.kill()
            lines = (partial + chunk).split(b"\n")
            partial = lines.pop()[:LINE_BYTES]  # an unfinished line: its head only
            for raw in lines:
                self._line(raw[:LINE_BYTES])
        if partial:
            self._line(partial)

    def _line(self, raw: bytes) -> None:
        line = raw.decode(errors="replace").rstrip()
        if line.startswith(REFUSED):
            if len(self.refusals) < 50:
                self.refusals.append(line[len(REFUSED):].strip()[:300])
        elif line.strip():
            self.errors.append(line[:500])

    def last_error(self) -> str:
        return self.errors[-1] if self.errors else "no output"

    def _reply(self, seconds: float, doing: str) -> tuple[dict, dict]:
        try:
            got = self.replies.get(timeout=max(0.0, seconds))
        except queue.Empty:
            self.kill()
            self.dead = f"ran past its {seconds:.0f} s while {doing} and was stopped"
            raise Stopped(self.dead) from None
        if isinstance(got, tuple):
            return got
        self.kill()
        code = self.proc.wait()
        if self.flooded:
            self.dead = f"wrote more than {self.output_cap >> 20} MiB of output while {doing} and was stopped"
        elif got is None:
            ended = "ended" if self.forked else f"ended with code {code}"  # (a fork's status is its zygote's)
            self.dead = f"{ended} while {doing}: {self.last_error()[:300]}"
        else:
            self.dead = f"wrote something that is not a reply while {doing} ({got})"
        raise Stopped(self.dead)

    def request(self, header: dict, tensors: dict | None = None, *, seconds: float,
                cpu_seconds: float | None = None) -> tuple[dict, dict]:
        """Send one request and wait at most `seconds` for its reply (its CPU time capped at `cpu_seconds`
        more than it has used); Stopped when it does not come."""
        if self.dead:
            raise Stopped(self.dead)
        if self.forked and self.proc.poll() is not None:  # ended: its pid may be another process's by now
            self.dead = "ended before the request"
            raise Stopped(self.dead)
        if cpu_seconds is not None:
            self.limit_cpu(cpu_seconds)
        self.output_bytes = 0
        failed: list = []

        def send():
            try:
                wire.write(self._writer, header, tensors)
            except (OSError, ValueError) as exc:  # the worker is gone or killed mid-write
                failed.append(exc)

        sender = threading.Thread(target=send, daemon=True)  # a worker that stops reading cannot stall us
        sender.start()
        return self._reply(seconds, f"answering {header.get('op', 'a request')}")

    def limit_cpu(self, seconds: float) -> None:
        used = int(self.cpu_seconds()) + 1
        try:
            limit = used + max(1, int(seconds))
            # hard = soft where we may raise a hard limit later (root); else a soft limit its seccomp keeps it from raising
            hard = limit if os.geteuid() == 0 else resource.RLIM_INFINITY
            resource.prlimit(self.pid, resource.RLIMIT_CPU, (limit, hard))
        except (OSError, ValueError):
            pass  # the wall clock still bounds it

    def cpu_seconds(self) -> float:
        """CPU time the process has used, all its threads, from the kernel: the larger of its live threads' own
        counts (nanoseconds, schedstat) and the process's total (clock ticks, which keep the time of threads that have
        ended). A candidate that works on a second thread is timed with it (held-out attack: schedstat of the main
        thread alone read 0.0 s for 0.5 s of work)."""
        nanoseconds = 0
        try:
            for task in Path(f"/proc/{self.pid}/task").iterdir():
                try:
                    nanoseconds += int((task / "schedstat").read_text().split()[0])
                except (OSError, ValueError, IndexError):
                    continue
        except OSError:
            pass
        ticks = 0.0
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rpartition(")")[2].split()
            ticks = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            pass
        return max(nanoseconds / 1e9, ticks)

    def kill(self) -> None:
        if self.proc.poll() is None:
            if self.forked:  # one process, by its pidfd: it cannot fork, so it leaves nothing behind
                self.proc.kill()
                return
            if self.pid != self.proc.pid:  # the jailed worker first (bubblewrap's own death would end it too)
                try:
                    os.kill(self.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()

    def close(self) -> None:
        if self.proc.poll() is None and not self.dead:
            try:
                wire.write(self._writer, {"op": "end"})
            except (OSError, ValueError):
                pass
            deadline = time.monotonic() + 5
            while self.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
        self.kill()
        self.proc.wait()
        if self.forked:
            self.proc.release()
        for stream in (self._writer, self._reader):
            try:
                stream.close()
            except OSError:
                pass
