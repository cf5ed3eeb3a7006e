"""A sandbox's candidates' processes, forked in the jail from one that imported torch once.

    zygote = Zygote(scratch)                     # a jailed process: torch imported, warmed up, walls not closed
    worker = Worker(CANDIDATE, scratch, memory_bytes=8 << 30, zygote=zygote)   # a fork of it (`start`)
    zygote.close()                               # it, and every process forked from it

Starting a candidate's process costs a second and a half of CPU, nearly all of it torch's import; a sandbox
starts one for every round. The zygote pays it once per sandbox: it is started in the jail as a worker is
(`jail.command`), and each fork closes its own walls (seccomp, audit hook, memory limit) before it reads a request.
What the zygote does to keep the children from it and from each other is in
`candidate_worker.zygote`. This side finds a child's pid in its own pid namespace from the zygote's children
(their NSpid), and holds a pidfd to it: a pid number that is reused cannot be signalled by mistake.
"""

from __future__ import annotations

import collections
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from onboard.agent.sandbox import jail
from onboard.agent.sandbox.process import LINE_BYTES, Stopped, deepest_child, environment, popen

CANDIDATE = "onboard.agent.sandbox.candidate_worker"
REPLY_BYTES = 4096


def _readable(fd: int, seconds: float | None) -> bool:
    """Whether `fd` is readable (a pidfd: its process has ended) within `seconds` (None: however long it takes).
    poll, not select: a long-lived process may hold descriptors past select's 1,024."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if seconds is None else max(0, int(seconds * 1000))))


class Zygote:
    def __init__(self, scratch: Path, *, start_seconds: float = 180.0, program: list[str] | None = None):
        """`program`: the interpreter's arguments (default: the candidate worker's zygote); its control socket's
        descriptor number is added last."""
        self.scratch = Path(scratch)
        self.scratch.mkdir(parents=True, exist_ok=True)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._socket = ours
        argv = jail.command([sys.executable, *(program or ["-m", CANDIDATE, "--zygote"]), str(theirs.fileno())])
        self.proc = popen(argv, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, cwd=self.scratch, env=environment(self.scratch),
                           start_new_session=True)
        theirs.close()
        self.errors: collections.deque = collections.deque(maxlen=30)
        threading.Thread(target=self._drain, daemon=True).start()
        self._lock = threading.Lock()
        self.dead = self.retired = ""
        try:
            self._ask(None, (), start_seconds, "starting")
        except Stopped:
            self.close()
            raise
        self.pid = deepest_child(self.proc.pid)  # the zygote itself, under bubblewrap

    def _drain(self) -> None:
        for raw in self.proc.stderr:
            line = raw[:LINE_BYTES].decode(errors="replace").rstrip()
            if line.strip():
                self.errors.append(line[:500])

    def _ask(self, request: dict | None, fds: tuple[int, ...], seconds: float, doing: str) -> dict:
        if self.dead:
            raise Stopped(self.dead)
        try:
            if request is not None:
                socket.send_fds(self._socket, [json.dumps(request).encode()], list(fds))
            data = self._socket.recv(REPLY_BYTES) if self._answered(seconds) else None
        except OSError as exc:
            data, doing = b"", f"{doing} ({exc})"
        if not data:
            ended = data == b"" or self.proc.poll() is not None
            self.kill()
            last = self.errors[-1] if self.errors else "no output"
            self.dead = (f"the candidates' zygote ended while {doing}: {last[:300]}" if ended else
                         f"the candidates' zygote ran past its {seconds:.0f} s while {doing}")
            raise Stopped(self.dead)
        return json.loads(data)

    def _answered(self, seconds: float) -> bool:
        """Whether a reply (or the end of the socket) came within `seconds`; False at once where bubblewrap, and so
        the zygote, has ended (its socket may stay open a while in a fork that had not closed it yet)."""
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if _readable(self._socket.fileno(), min(0.25, max(0.0, left))):
                return True
            if left <= 0 or self.proc.poll() is not None:
                return False

    def start(self, fds: tuple[int, int, int], memory_bytes: int, stderr: int, seconds: float = 30.0) -> Forked:
        """A new candidate's process reading requests on fds[0], replying on fds[1], writing its stderr to fds[2]
        (read here on `stderr`, which the process returned owns)."""
        pid, pidfd = self._fork(fds, memory_bytes, seconds)
        return Forked(pid, pidfd, os.fdopen(stderr, "rb"))

    def _fork(self, fds: tuple[int, int, int], memory_bytes: int, seconds: float) -> tuple[int, int]:
        with self._lock:
            if self.retired:
                raise Retired(self.retired)
            reply = self._ask({"memory": int(memory_bytes)}, fds, seconds, "forking")
            if "retire" in reply:
                self.retire(str(reply["retire"])[:300])
                raise Retired(self.retired)
            inside = reply.get("pid")
            if not isinstance(inside, int):
                raise Stopped(f"the candidates' zygote could not fork: {reply.get('error', reply)}")
            pid = self._child(inside)
            pidfd = os.pidfd_open(pid)
            if self._child(inside) != pid:  # ended and its number reused between the two reads
                os.close(pidfd)
                raise Stopped("a candidate's process ended as it started")
        return pid, pidfd

    def _child(self, inside: int) -> int:
        """The pid here of the zygote's child whose pid in the jail is `inside` (0 when it has none)."""
        try:
            children = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text().split()
        except OSError:
            return 0
        for child in children:
            try:
                status = Path(f"/proc/{child}/status").read_text()
            except OSError:
                continue
            nspid = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
            if nspid and nspid[-1] == str(inside):
                return int(child)
        return 0

    def retire(self, why: str) -> None:
        """Fork no more: the zygote ends once the processes forked from it have (a verification worker may still
        be serving), and its tmpfs with it."""
        self.retired = why or "retired"
        try:
            self._socket.close()
        except OSError:
            pass

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # bubblewrap and the zygote: its children end with it
            except (ProcessLookupError, PermissionError):
                self.proc.kill()

    def close(self) -> None:
        try:
            self._socket.close()  # the zygote reads the end of its requests and exits
        except OSError:
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self.kill()
        self.proc.wait()
        self.dead = self.dead or "closed"


class Retired(Stopped):
    """The zygote forks no more (what ended candidates left in its tmpfs): the sandbox starts another."""


class Forked:
    """A zygote's child, as `subprocess.Popen` is seen by `process.Worker`: poll, wait, kill, its stderr."""

    def __init__(self, pid: int, pidfd: int, stderr):
        self.pid, self.pidfd, self.stderr = pid, pidfd, stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and _readable(self.pidfd, 0):
            self.returncode = -1  # ended (the zygote reaps it: its status is not ours to read)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not _readable(self.pidfd, timeout):
                raise subprocess.TimeoutExpired("candidate", timeout)
            self.returncode = -1
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except (ProcessLookupError, OSError):
                pass

    def release(self) -> None:
        try:
            os.close(self.pidfd)
        except OSError:
            pass
