"""Gloo worlds for the tests, started as forks of one process per test worker that imported the torch stack once.

    worlds = Zygote.shared()                     # started on first use, one per pytest process
    world = worlds.start(2, ["-m", "runtime.train", "--job", job], env=env, logs=tmp_path / "ranks")
    world.rank_pids()                            # {rank: pid}, for a test that kills one
    codes = world.wait(timeout=300)              # {rank: exit code}; minus the signal's number if one killed it

Each rank is a process of its own with torchrun's environment contract (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR / MASTER_PORT for env rendezvous), running `python -m module args` or
`python script args` as `__main__`, its output in `<logs>/rank<N>.log`. As under torchrun, the first rank to fail
ends its world: the others get SIGTERM, and SIGKILL ten seconds later. What changes is only who pays for the
imports: a fresh rank spends about 6 s of CPU importing torch, transformers and the runtime before its first
collective; a fork pays nothing, and the zygote pays once for the whole session.

The zygote never runs a tensor operation or starts a thread (imports start none), so every fork begins as a copy
of one thread with its locks free. A world is a session of its own (its leader calls setsid), so a test that gives
up on it kills the leader's process group and nothing of it is left. `onboard train`'s own torchrun command, and
one layout of the killed-rank test, still run through the real torchrun (tests/runtime/test_train.py).

Protocol, one JSON object a line: the client writes a request; the zygote answers {"leader": pid} at once and
{"code": n} when the world's leader has ended; the leader leaves `pids.json` and `codes.json` in the log folder.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# what the ranks import: the torch stack, the runtime's training and parallel code, transformers' model base (a
# model's own module is small beside it), the model factory of `onboard train`'s jobs, and the tests' bundle reader
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.tensor",
           "torch.distributed.fsdp", "transformers", "transformers.modeling_utils", "transformers.masking_utils",
           "runtime.train", "runtime.train.loop", "runtime.parallel", "runtime.parallel.pipeline", "runtime.lora",
           "onboard.source", "onboard.bundle.files", "onboard.train.model", "onboard.twin",
           "onboard.review.families")
GRACE = 10.0  # seconds between SIGTERM and SIGKILL for the ranks of a world one of whose ranks failed


# ---- the zygote's side ------------------------------------------------------------------------------------------

def serve() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    out = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)  # what an import prints later must not pass for a reply
    out.write("ready\n")
    while line := sys.stdin.readline():
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.dup2(devnull, 0)
            os.close(out.fileno())  # the replies are the zygote's alone
            _lead(request)  # never returns
        out.write(json.dumps({"leader": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        out.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")


def _lead(request: dict) -> None:
    """The world's leader: a session of its own, one fork per rank, torchrun's ending when a rank fails."""
    code = 1
    try:
        os.setsid()
        logs, world = Path(request["logs"]), int(request["world"])
        ranks = {}
        for rank in range(world):
            pid = os.fork()
            if pid == 0:
                _rank(rank, request)  # never returns
            ranks[pid] = rank
        (logs / "pids.json").write_text(json.dumps({rank: pid for pid, rank in ranks.items()}))
        codes, deadline = {}, None
        while ranks:
            pid, status = os.waitpid(-1, os.WNOHANG) if deadline is not None else os.wait()
            if pid == 0:  # ranks left after a failure: wait for them, then kill them
                if time.monotonic() > deadline:
                    _signal(ranks, signal.SIGKILL)
                time.sleep(0.05)
                continue
            codes[ranks.pop(pid)] = os.waitstatus_to_exitcode(status)
            if deadline is None and ranks and any(codes.values()):
                _signal(ranks, signal.SIGTERM)
                deadline = time.monotonic() + GRACE
        (logs / "codes.json").write_text(json.dumps(codes))
        code = 0
    except BaseException:  # noqa: BLE001 - shown in the leader's log
        traceback.print_exc()
    finally:
        os._exit(code)


def _signal(ranks: dict, number: int) -> None:
    for pid in ranks:
        try:
            os.kill(pid, number)
        except ProcessLookupError:
            pass


def _rank(rank: int, request: dict) -> None:
    code = 1
    try:
        world = int(request["world"])
        out = os.open(Path(request["logs"]) / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                          GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(world),
                          TORCHELASTIC_RESTART_COUNT="0")
        os.chdir(request["cwd"])
        argv = list(request["argv"])
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = request["cwd"]  # as `python -m` has it
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            sys.path[0] = str(Path(argv[0]).resolve().parent)  # as `python script` has it
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001 - the rank's failure, for the test to show
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed by the program
                pass
        os._exit(code)


# ---- the tests' side ----------------------------------------------------------------------------------------------

def rank_env() -> dict:
    """What a test's gloo ranks find in their environment besides torchrun's variables: this process's, a free port
    on the loopback for env rendezvous, one thread each."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    if Path("/sys/class/net/lo").exists():  # gloo otherwise binds to whatever the host name resolves to
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


class ZygoteError(RuntimeError):
    pass


class World:
    def __init__(self, zygote: Zygote, leader: int, logs: Path):
        self.zygote, self.leader, self.logs = zygote, leader, logs
        self.codes: dict[int, int] | None = None

    def rank_pids(self) -> dict[int, int]:
        try:
            return {int(r): p for r, p in json.loads((self.logs / "pids.json").read_text()).items()}
        except (OSError, ValueError):
            return {}

    def poll(self) -> dict[int, int] | None:
        if self.codes is None and self.zygote._answered(0):
            self._collect()
        return self.codes

    def wait(self, timeout: float) -> dict[int, int]:
        """Each rank's exit code; a world still running after `timeout` seconds is killed and ZygoteError raised."""
        if self.codes is None:
            if not self.zygote._answered(timeout):
                self.kill()
                self.zygote._answered(60)
                self.zygote._reply()
                self.zygote.busy = False
                raise ZygoteError(f"the world ran past its {timeout:.0f} s and was killed")
            self._collect()
        return self.codes

    def kill(self) -> None:
        try:
            os.killpg(self.leader, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def _collect(self) -> None:
        reply = self.zygote._reply()
        self.zygote.busy = False
        if reply.get("code") != 0:
            raise ZygoteError(f"the world's leader ended with {reply}: {self.log('leader')}")
        self.codes = {int(r): c for r, c in json.loads((self.logs / "codes.json").read_text()).items()}

    def log(self, rank, chars: int = 3000) -> str:
        try:
            return (self.logs / f"rank{rank}.log").read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"


class Zygote:
    _shared: Zygote | None = None

    @classmethod
    def shared(cls) -> Zygote:
        """This process's zygote, started on first use (and again if it died)."""
        if cls._shared is None or cls._shared.proc.poll() is not None:
            cls._shared = cls()
            atexit.register(cls._shared.close)
        return cls._shared

    def __init__(self, start_seconds: float = 180):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, cwd=ROOT, text=True, start_new_session=True)
        self.busy = False
        self._pending = b""  # read from the zygote, not yet taken as replies
        if not self._answered(start_seconds) or self._line() != b"ready":
            self.close()
            raise ZygoteError(f"the zygote did not start within {start_seconds:.0f} s")

    def start(self, world: int, argv: list[str], *, env: dict, logs: Path, cwd: Path = ROOT) -> World:
        """Start `world` ranks of `python *argv` (argv[0] a script, or "-m" and a module) with `env` as their whole
        environment (MASTER_ADDR and MASTER_PORT in it)."""
        if self.busy:
            raise ZygoteError("one world at a time: the last one was not waited for")
        from tests import budget

        argv = [str(a) for a in argv]
        budget.note_launch(["zygote", *argv], {**env, "RANK": "0", "WORLD_SIZE": str(world)})  # counted at its site
        logs = Path(logs)
        logs.mkdir(parents=True, exist_ok=True)
        for old in ("pids.json", "codes.json"):
            (logs / old).unlink(missing_ok=True)
        request = {"world": world, "argv": argv, "env": {k: str(v) for k, v in env.items()},
                   "logs": str(logs), "cwd": str(cwd)}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        self.busy = True
        if not self._answered(60):
            self.close()
            raise ZygoteError("the zygote did not answer")
        return World(self, int(self._reply()["leader"]), logs)

    def _answered(self, timeout: float) -> bool:
        """Whether a whole line from the zygote is at hand within `timeout` seconds (its end counts as one)."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            if not select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
                return False
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                return True
            self._pending += chunk
        return True

    def _line(self) -> bytes:
        line, _, self._pending = self._pending.partition(b"\n")
        return line.strip()

    def _reply(self) -> dict:
        line = self._line() if b"\n" in self._pending else b""
        if not line:
            raise ZygoteError(f"the zygote ended (code {self.proc.poll()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()


if __name__ == "__main__":
    serve()
