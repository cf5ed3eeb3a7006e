"""The kernel's boundary around candidate code (issue 54): seen from inside a jailed process, with the worker's own
seccomp allow-list loaded and no audit hook (what is tested here is the layer beneath it), and from outside.

Inside, the process finds only its own pid namespace in /proc; no home directory, no judge key, no transformers,
no judge or agent code of onboard; `execve`, `fork`, signals to any other process, sockets and writes outside its
scratch directory all fail; its only network interface is a loopback. Outside, a candidate's worker starts in the
jail, a sandbox refuses in one line where the jail cannot be made, and a worker that floods its output is stopped
with this process's memory kept small."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from onboard.agent.sandbox import jail
from onboard.errors import OnboardError

ROOT = Path(__file__).resolve().parents[2]

PROBE = textwrap.dedent('''
    import errno, json, os, signal, socket, sys
    from onboard.agent.sandbox import confine
    confine.seccomp()
    seen = {"uid": os.getuid(), "pid": os.getpid(), "proc": sorted(int(n) for n in os.listdir("/proc") if n.isdigit())}
    seen["present"] = {p: os.path.exists(p) for p in json.loads(sys.argv[1])}
    seen["interfaces"] = sorted(line.split(":")[0].strip() for line in open("/proc/self/net/dev").read().splitlines()[2:])
    seen["capabilities"] = [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff")][0]

    def fails(name, act):
        try:
            act()
        except OSError as exc:
            seen[name] = errno.errorcode.get(exc.errno, str(exc.errno))
        except ValueError as exc:  # setrlimit's EPERM
            seen[name] = "EPERM" if "not allowed" in str(exc) else str(exc)
        else:
            seen[name] = "done"

    fails("execve", lambda: os.execv("/usr/bin/true", ["true"]))
    fails("fork", lambda: os._exit(0) if os.fork() == 0 else None)
    fails("signal to the parent", lambda: os.kill(os.getppid(), signal.SIGSTOP))
    fails("signal to every process", lambda: os.kill(-1, signal.SIGKILL))
    fails("pidfd", lambda: os.pidfd_open(1))
    fails("socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM))
    fails("unix socket", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
    fails("write to the project", lambda: open(sys.argv[2] + "/planted", "w"))
    fails("write to the root", lambda: open("/planted", "w"))
    fails("write to the Python installation", lambda: open(os.path.dirname(os.__file__) + "/planted.py", "w"))
    fails("mkfifo", lambda: os.mkfifo("fifo"))
    fails("utime", lambda: os.utime("."))
    fails("write a sysctl", lambda: open("/proc/sys/vm/swappiness", "w").write(open("/proc/sys/vm/swappiness").read()))
    fails("open core_pattern for writing", lambda: open("/proc/sys/kernel/core_pattern", "w"))
    fails("write to /dev", lambda: open("/dev/planted", "w"))
    fails("fill /dev/shm", lambda: open("/dev/shm/big", "wb").write(bytes(8 << 20)))
    fails("write to scratch", lambda: open("note.txt", "w").write("kept"))
    import resource
    fails("set a limit", lambda: resource.setrlimit(resource.RLIMIT_CPU, resource.getrlimit(resource.RLIMIT_CPU)))
    print(json.dumps(seen))
''')


@pytest.fixture(scope="module")
def inside(tmp_path_factory) -> dict:
    """What the probe saw from inside a jail, with the worker's seccomp allow-list loaded."""
    if jail.why_not():
        pytest.fail(f"the jail must be available where the tests run: {jail.why_not()}")
    import transformers

    scratch = tmp_path_factory.mktemp("jail-scratch")
    secrets = {"home": os.path.expanduser("~"), "judge key": os.environ["ONBOARD_JUDGE_KEY"],
               "user judge key": os.path.expanduser("~/.cache/onboard/judge.key"),
               "transformers": os.path.dirname(transformers.__file__),
               "judge": str(ROOT / "onboard" / "agent" / "sandbox" / "judge.py"),
               "agent loop": str(ROOT / "onboard" / "agent" / "loop.py"), "tests": str(ROOT / "tests"),
               "the caller's scratch": str(scratch), "a virtual environment": sys.prefix,
               "the interpreter's own path": os.path.realpath(sys.executable)}
    argv = jail.command([sys.executable, "-c", PROBE, json.dumps(list(secrets.values())), str(ROOT)])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, cwd=scratch,
                          env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    seen["names"] = secrets
    seen["host scratch"] = sorted(p.name for p in scratch.iterdir())  # (the probe's cwd is the jail's tmpfs)
    return seen


def test_proc_holds_only_its_own_pid_namespace(inside):
    """And in it, only itself: pid 1. (Held-out attack: with bubblewrap's init as pid 1 beside it, a candidate wrote
    code into init through /proc/1/mem, and init, which has no seccomp filter, ran an execve that outlived the jail.)"""
    assert inside["pid"] == 1 and inside["proc"] == [1], inside["proc"]
    assert inside["uid"] == jail.NOBODY and int(inside["capabilities"], 16) == 0


def test_home_judge_keys_transformers_and_onboards_judge_are_absent(inside):
    present = {name: inside["present"][path] for name, path in inside["names"].items()}
    assert not any(present.values()), present


def test_execve_fork_signals_and_pidfds_fail(inside):
    for what in ("execve", "fork", "signal to the parent", "signal to every process", "pidfd"):
        assert inside[what] == "EPERM", (what, inside[what])


def test_writes_outside_scratch_fail_and_scratch_is_its_own(inside):
    """Held-out attacks: the jail's uid is the caller's outside (root where onboard runs as root), so /proc/sys was
    writable (kernel.core_pattern, the way to code on the host); /dev and /dev/shm took 600 MiB past scratch's cap."""
    for what in ("write to the project", "write to the root", "write to the Python installation", "mkfifo",
                 "utime", "write a sysctl", "open core_pattern for writing", "write to /dev", "fill /dev/shm"):
        assert inside[what] != "done", (what, inside[what])
    assert inside["write to scratch"] == "done"
    assert inside["host scratch"] == []  # its scratch is a tmpfs of the jail's: nothing reaches the caller
    assert inside["set a limit"] == "EPERM"  # (even to what it is: the parent's CPU limit stays)


def test_the_network_is_absent(inside):
    assert inside["interfaces"] == ["lo"]
    assert inside["socket"] == "EPERM" and inside["unix socket"] == "EPERM"


def test_a_planted_gap_in_the_allow_list_shows():
    """Planted: with execve on the allow-list the probe's execve is no longer refused (the test above would fail)."""
    from onboard.agent.sandbox import confine

    assert "execve" not in confine.ALLOWED_SYSCALLS
    script = "from onboard.agent.sandbox import confine\nconfine.ALLOWED_SYSCALLS.append('execve')\n" \
             "confine.seccomp()\nimport os\nos.execv('/usr/bin/true', ['true'])\n"
    done = subprocess.run(jail.command([sys.executable, "-c", script]), capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0 and "EPERM" not in done.stderr, done.stderr[-2000:]


def test_without_bubblewrap_the_sandbox_refuses_in_one_line(monkeypatch, tmp_path):
    from onboard.agent.sandbox.session import Sandbox

    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    jail.why_not.cache_clear()
    try:
        with pytest.raises(OnboardError) as refused:
            Sandbox()
        assert "bubblewrap" in str(refused.value) and "\n" not in str(refused.value)
    finally:
        monkeypatch.undo()
        jail.why_not.cache_clear()


def test_a_candidate_worker_runs_jailed_and_a_flood_of_output_is_stopped(tmp_path):
    """A jailed worker: its pid inside is small, it has no transformers. A candidate printing 48 MiB without a newline
    on a call is stopped at the output cap, and this side kept a few kilobytes of it."""
    import resource

    import torch

    from onboard.agent.sandbox import wire
    from onboard.agent.sandbox.process import Stopped, Worker

    worker = Worker("onboard.agent.sandbox.candidate_worker", tmp_path / "w", memory_bytes=8 << 30, jailed=True)
    try:
        assert worker.ready["ready"] == 1 and worker.ready["transformers"] is False
        assert worker.pid != worker.proc.pid  # the worker two levels under bubblewrap
        flood = ("from runtime.generated import Generated\nclass Replacement(Generated):\n"
                 "    def forward(self, x):\n        print('x' * (48 << 20), end='')\n        return x\n")
        worker.request({"op": "load", "key": "k", "code": flood}, seconds=30)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        structure, tensors = wire.pack((torch.ones(2),), prefix="a")
        state = {"parameters": [], "buffers": [], "settings": {}}
        with pytest.raises(Stopped, match="MiB of output"):
            worker.request({"op": "call", "id": 1, "key": "k", "state": state, "args": structure,
                            "kwargs": wire.pack({}, prefix="k")[0], "training": False}, tensors, seconds=60)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        assert grown < 32 << 10, f"this process grew by {grown} KiB"  # ru_maxrss is in KiB
        assert all(len(line) <= 500 for line in worker.errors)
    finally:
        worker.close()


def test_cpu_time_counts_every_thread_of_the_worker():
    """Held-out attack: the timing run read the main thread's schedstat alone, and a candidate that worked on a
    second thread was timed at 0.0 s for 0.5 s of work. A worker's CPU time now holds all its threads, those that
    have ended too. (The process is a plain child here: what is tested is the reading.)"""
    from onboard.agent.sandbox.process import Worker

    code = ("import threading, time\ndef spin():\n    t = time.process_time()\n    while time.process_time() - t < 0.5:"
            "\n        pass\nthread = threading.Thread(target=spin)\nthread.start()\nthread.join()\nprint('done', "
            "flush=True)\ntime.sleep(30)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "done"
        reader = Worker.__new__(Worker)  # its CPU reading only, on a process of our own
        reader.pid = child.pid
        assert reader.cpu_seconds() >= 0.45
    finally:
        child.kill()
        child.wait()


def test_onboard_agent_without_a_jail_refuses_in_one_line_and_writes_nothing(tmp_path):
    from tests.helpers import run_cli

    jail.why_not.cache_clear()
    try:
        done = run_cli("agent", "qwen3-8b", "--out", tmp_path / "out", env={"PATH": str(tmp_path)})
    finally:
        jail.why_not.cache_clear()
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and "bubblewrap" in lines[0], done.stderr
    assert not (tmp_path / "out").exists()


# --- a sandbox's zygote and the processes forked from it ---------------------------------------------------------

FORKED_PROBE = textwrap.dedent('''
    import errno, json, os, signal, sys
    from onboard.agent.sandbox import candidate_worker, confine
    candidate_worker.DUMPABLE = int(sys.argv[1])

    def probe(read_fd, write_fd, jailed, network):
        confine.seccomp()
        role = os.read(read_fd, 1)
        if role == b"w":  # the sibling: waits to be looked at, then ends
            os.read(read_fd, 1)
            return
        if role == b"l":  # litter beside its folder, then end
            open("/scratch/litter", "w").write("for the next candidate")
            return
        if role == b"d":  # a chain of folders deeper than the zygote's open-file limit lets it remove, then end
            fd = os.open(".", os.O_RDONLY)
            for _ in range(300):
                os.mkdir("d", dir_fd=fd)
                deeper = os.open("d", os.O_RDONLY, dir_fd=fd)
                os.close(fd)
                fd = deeper
            return
        me = os.getpid()
        others = sorted(int(n) for n in os.listdir("/proc") if n.isdigit() and int(n) not in (1, me))
        seen = {"pid": me, "others": others, "cwd": os.getcwd(), "path": sys.path}

        def fails(name, act):
            try:
                act()
            except OSError as exc:
                seen[name] = errno.errorcode.get(exc.errno, str(exc.errno))
            else:
                seen[name] = "done"

        for pid, who in [(1, "zygote"), *((p, "sibling") for p in others)]:
            fails(f"read the {who}'s memory", lambda: open(f"/proc/{pid}/mem", "rb").close())
            fails(f"open the {who}'s descriptors", lambda: [open(f"/proc/{pid}/fd/{fd}", "rb").close()
                                                            for fd in os.listdir(f"/proc/{pid}/fd")])
            fails(f"read the {who}'s root", lambda: os.readlink(f"/proc/{pid}/root"))
            fails(f"read the {who}'s environment", lambda: open(f"/proc/{pid}/environ", "rb").read())
            fails(f"signal the {who}", lambda: os.kill(pid, signal.SIGSTOP))
        os.write(write_fd, json.dumps(seen).encode())

    confine.early(0)
    candidate_worker.zygote(int(sys.argv[2]), serve=probe)
''')


def _forked_probe(tmp_path, dumpable: int) -> dict:
    """What one fork of a zygote saw of the zygote and of a sibling fork alive beside it (the worker's seccomp
    allow-list loaded, no audit hook: the kernel's layer alone)."""
    from onboard.agent.sandbox.zygote import Zygote

    zygote = Zygote(tmp_path / "zygote", program=["-c", FORKED_PROBE, str(dumpable)])
    pipes = []
    try:
        children = []
        for role in (b"w", b"p"):
            to_child, from_parent = os.pipe()[::-1]
            from_child, to_parent = os.pipe()
            err_r, err_w = os.pipe()
            children.append(zygote.start((from_parent, to_parent, err_w), 8 << 30, err_r))
            for fd in (from_parent, to_parent, err_w):
                os.close(fd)
            os.write(to_child, role)
            pipes.append((to_child, from_child))
        seen = json.loads(os.read(pipes[1][1], 1 << 20) or b"{}")
        os.write(pipes[0][0], b"e")
        return seen
    finally:
        for fds in pipes:
            for fd in fds:
                os.close(fd)
        zygote.close()


@pytest.fixture(scope="module")
def forked(tmp_path_factory) -> dict:
    return _forked_probe(tmp_path_factory.mktemp("forked"), 0)


def test_a_forked_candidate_cannot_reach_its_zygote_or_a_sibling(forked):
    """A candidate's process forked from the sandbox's zygote shares its pid namespace with the zygote (which has
    no seccomp filter) and with the round's other processes. None of them is dumpable, so the kernel refuses what
    /proc/1/mem gave a candidate when bubblewrap's init sat beside it; signals go nowhere but to itself."""
    assert forked["others"], "no sibling was alive beside the probe"
    refused = {what: how for what, how in forked.items() if what.startswith(("read", "open", "signal"))}
    assert refused and all(how in ("EACCES", "EPERM") for how in refused.values()), refused


def test_a_forked_candidate_works_in_a_folder_of_its_own_off_the_import_path(forked):
    assert forked["cwd"].startswith(jail.SCRATCH + "/candidate-")
    assert not [p for p in forked["path"] if p in ("", jail.SCRATCH) or p.startswith(jail.SCRATCH + "/")]


def test_a_dumpable_zygote_is_seen(tmp_path):
    """Planted: a zygote left dumpable gives its memory to its children (the test above would fail)."""
    seen = _forked_probe(tmp_path, 1)
    assert seen["read the zygote's memory"] == "done"


def _start(zygote, role: bytes):
    """A fork of the probe's zygote given `role`: (the process, the descriptor to write to it)."""
    to_child, from_parent = os.pipe()[::-1]
    from_child, to_parent = os.pipe()
    err_r, err_w = os.pipe()
    try:
        forked = zygote.start((from_parent, to_parent, err_w), 8 << 30, err_r)
    finally:
        for fd in (from_parent, to_parent, err_w, from_child):
            os.close(fd)
    os.write(to_child, role)
    return forked, to_child


@pytest.mark.parametrize("role", [b"l", b"d"], ids=["a file beside its folder", "a tree deeper than rmtree reaches"])
def test_what_an_ended_candidate_left_retires_the_zygote(tmp_path, role):
    """Held-out attacks: a candidate's files outlived its round in the shared tmpfs (a 256 MiB file at the bottom
    of a chain of folders 300 deep, past the zygote's open-file limit, left every later candidate without space).
    A zygote whose tmpfs holds anything but its live candidates' folders forks no more, and says why; a failed
    request is answered and the zygote goes on."""
    from onboard.agent.sandbox.zygote import Retired, Zygote

    zygote = Zygote(tmp_path / "zygote", program=["-c", FORKED_PROBE, "0"])
    try:
        with pytest.raises(Exception, match="three file descriptors"):
            zygote._fork((0, 1), 8 << 30, 30)  # a malformed request: answered, the zygote lives on
        forked, to_child = _start(zygote, role)
        forked.wait(60)
        os.close(to_child)
        with pytest.raises(Retired, match="left by candidates"):
            _start(zygote, b"w")
        assert zygote.retired and zygote.proc.poll() is None or zygote.proc.wait(10) == 0
    finally:
        zygote.close()


def test_a_sandbox_forks_from_a_new_zygote_when_one_retires_or_dies(tmp_path):
    from onboard.agent.sandbox.session import Sandbox

    with Sandbox() as sandbox:
        first = sandbox.zygote()
        first.retire("planted")
        second = sandbox.zygote()
        assert second is not first and second.pid != first.pid
        worker = sandbox.acquire()
        assert worker.forked and worker.ready["transformers"] is False
        sandbox.release(worker, spare=False)
        second.kill()
        second.proc.wait(10)
        second.dead = "killed"
        third = sandbox.zygote()
        assert third is not second and second.proc.returncode is not None and second._socket.fileno() == -1
    assert first.proc.returncode is not None and third.proc.returncode is not None  # closed with the sandbox
