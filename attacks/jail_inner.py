"""Runs INSIDE the jail as arbitrary Python (what a candidate that beat the guard and the audit hook has):
raises the worker's own walls first (confine.early(0), memory, seccomp -- no audit hook: we test the kernel's
layers), then probes. Prints one JSON object on stderr-as-stdout."""
import ctypes
import errno
import json
import os
import resource
import sys
import threading
import time

from onboard.agent.sandbox import confine

confine.early(0)
confine.memory(8 << 30)
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
confine.seccomp()

R = {}


def t(name, fn):
    try:
        R[name] = "OK " + repr(fn())[:400]
    except BaseException as exc:  # noqa: BLE001
        R[name] = f"ERR {type(exc).__name__}: {exc}"[:400]


def sc(nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    return r if r >= 0 else f"-{errno.errorcode.get(ctypes.get_errno(), ctypes.get_errno())}"


def read(path, n=300, mode="r"):
    with open(path, mode) as f:
        return f.read()[:n]


t("uid/gid", lambda: (os.getuid(), os.getgid(), os.getpid(), os.getppid()))
t("environ", lambda: dict(os.environ))
t("self status caps/seccomp", lambda: [l for l in read("/proc/self/status", 5000).splitlines()
                                      if l.split(":")[0] in ("CapEff", "NoNewPrivs", "Seccomp", "Seccomp_filters")])
t("pids visible", lambda: sorted(p for p in os.listdir("/proc") if p.isdigit()))
t("/proc/1/cmdline (host paths)", lambda: read("/proc/1/cmdline", 600).replace("\0", " "))
t("/proc/1/environ", lambda: read("/proc/1/environ", 300, "rb"))
t("/proc/1/status seccomp", lambda: [l for l in read("/proc/1/status", 5000).splitlines()
                                    if l.split(":")[0] in ("Name", "CapEff", "NoNewPrivs", "Seccomp")])
t("/proc/1/syscall", lambda: read("/proc/1/syscall"))
t("/proc/1/maps", lambda: read("/proc/1/maps", 200))
t("/proc/1/fd", lambda: os.listdir("/proc/1/fd"))


def mem1():
    fd = os.open("/proc/1/mem", os.O_RDWR)
    maps = read("/proc/1/maps", 100000).splitlines()
    rw = next(l for l in maps if " rw" in l)
    addr = int(rw.split("-")[0], 16)
    byte = os.pread(fd, 1, addr)
    wrote = os.pwrite(fd, byte, addr)
    return f"opened O_RDWR, read+wrote back 1 byte at {hex(addr)} of pid 1 ({rw.split()[-1] if len(rw.split()) > 5 else 'anon'}): {wrote}"


t("/proc/1/mem write (pid 1 is bwrap's init, no seccomp)", mem1)
t("mountinfo mentions /root or /work", lambda: [l.split()[3] + " -> " + l.split()[4] for l in
                                                read("/proc/self/mountinfo", 100000).splitlines()
                                                if "/root" in l or "/work" in l][:8])
t("ls /", lambda: sorted(os.listdir("/")))
t("ls /run/onboard/project/onboard/agent/sandbox", lambda: os.listdir("/run/onboard/project/onboard/agent/sandbox"))
t("ls /dev", lambda: sorted(os.listdir("/dev")))
t("ls /usr/local/etc", lambda: os.listdir("/usr/local/etc"))
t("judge key ~/.cache", lambda: read("/root/.cache/onboard/judge.key", 10, "rb"))
t("judge.py from checkout", lambda: read("/work/main/onboard/agent/sandbox/judge.py", 40))
t("/etc/passwd", lambda: read("/etc/passwd", 40))
t("/proc/net/dev", lambda: read("/proc/net/dev", 400))
t("/proc/meminfo + loadavg (side channel)", lambda: (read("/proc/meminfo", 40), read("/proc/loadavg")))
t("/sys exists", lambda: os.listdir("/sys"))

for path in ("/scratch/w", "/dev/shm/w", "/dev/w", "/dev/pts/w", "/tmp/w", "/run/w", "/run/onboard/w", "/usr/w",
             "/w", "/proc/self/comm"):
    def write(path=path):
        with open(path, "w") as f:
            f.write("x")
        return "written"
    t(f"write {path}", write)

t("statvfs /scratch, /dev, /dev/shm (MiB)", lambda: {p: os.statvfs(p).f_blocks * os.statvfs(p).f_frsize >> 20
                                                     for p in ("/scratch", "/dev", "/dev/shm") if os.path.exists(p)})
t("rlimits FSIZE/AS/NOFILE/NPROC/CPU", lambda: [resource.getrlimit(x) for x in (
    resource.RLIMIT_FSIZE, resource.RLIMIT_AS, resource.RLIMIT_NOFILE, resource.RLIMIT_NPROC, resource.RLIMIT_CPU)])


def fill(folder, mib):
    chunk = b"\0" * (1 << 20)
    done = 0
    try:
        for i in range(mib // 256 + 1):
            with open(f"{folder}/fill{i}", "wb") as f:
                for _ in range(min(256, mib - done)):
                    f.write(chunk)
                    done += 1
    except OSError as exc:
        return f"stopped after {done} MiB: {exc}"
    finally:
        for i in range(mib // 256 + 1):
            try:
                os.unlink(f"{folder}/fill{i}")
            except OSError:
                pass
    return f"wrote {done} MiB"


t("fill /scratch 300 MiB (cap 256)", lambda: fill("/scratch", 300))
t("fill /dev/shm 600 MiB (beyond scratch cap)", lambda: fill("/dev/shm", 600) if os.path.isdir("/dev/shm") else "no /dev/shm")
t("fill /dev 600 MiB", lambda: fill("/dev", 600))


def open_only(path):  # opened for writing and closed at once: NOTHING is written (these files act on the host)
    fd = os.open(path, os.O_WRONLY)
    os.close(fd)
    return "OPENED FOR WRITING (nothing written)"


for path in ("/proc/sysrq-trigger", "/proc/sys/kernel/core_pattern", "/proc/sys/vm/drop_caches",
             "/proc/sys/kernel/pid_max", "/dev/urandom", "/dev/null"):
    t(f"open O_WRONLY {path}", lambda path=path: open_only(path))
t("stat owner of /proc/sysrq-trigger, /usr/bin/python3 (uid as seen inside)",
  lambda: (os.stat("/proc/sysrq-trigger").st_uid, os.stat("/usr/bin").st_uid))
t("/proc/self/uid_map", lambda: read("/proc/self/uid_map"))

# processes
LIM, NAME, EMPTY, MASK = (ctypes.c_ulong * 2)(256, 256), ctypes.create_string_buffer(b"x"), ctypes.create_string_buffer(b""), ctypes.c_ulong(1)
print(json.dumps(R, indent=1), flush=True)  # in case an exec below succeeds
R.clear()


def fork():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    return pid
t("os.fork", fork)
t("execv /bin/true", lambda: os.execv("/bin/true", ["true"]))
t("posix_spawn", lambda: os.posix_spawn("/bin/true", ["true"], {}))


def memfd_exec():
    fd = sc(319, ctypes.addressof(NAME), 0)
    if not isinstance(fd, int):
        return f"memfd_create {fd}"
    with open("/bin/true", "rb") as f:
        os.write(fd, f.read())
    return f"memfd_create ok (fd {fd}); execveat: {sc(322, fd, ctypes.addressof(EMPTY), 0, 0, 0x1000)}"


t("memfd_create + execveat", memfd_exec)
t("vfork (58)", lambda: "refused" if str(sc(58)).startswith("-") else "FORKED?!")
for name, nr, args in [
        ("socket AF_INET", 41, (2, 1, 0)), ("socket AF_UNIX", 41, (1, 1, 0)), ("socket AF_NETLINK", 41, (16, 3, 0)),
        ("socket AF_VSOCK", 41, (40, 1, 0)), ("socketpair AF_UNIX", 53, (1, 1, 0, 0)),
        ("io_uring_setup", 425, (8, 0)), ("ptrace attach 1", 101, (16, 1, 0, 0)),
        ("process_vm_readv", 310, (1, 0, 0, 0, 0, 0)), ("kill(1,0)", 62, (1, 0)), ("kill(-1,0)", 62, (-1, 0)),
        ("kill(0,0)", 62, (0, 0)), ("tgkill(1,1,0)", 234, (1, 1, 0)), ("pidfd_open(1)", 434, (1, 0)),
        ("prlimit64 set NOFILE (same values)", 302, (0, 7, ctypes.addressof(LIM), 0)), ("setrlimit NOFILE (same values)", 160, (7, ctypes.addressof(LIM))), ("unshare NEWUSER", 272, (0x10000000,)),
        ("setns", 308, (0, 0)), ("mount", 165, (0, 0, 0, 0, 0)), ("chroot", 161, (0,)), ("bpf", 321, (0, 0, 0)),
        ("perf_event_open", 298, (0, 0, -1, -1, 0)), ("userfaultfd", 323, (0,)), ("keyctl", 250, (0, 0)),
        ("open_by_handle_at", 304, (0, 0, 0)), ("mknodat", 259, (-100, 0, 0, 0)), ("prctl", 157, (4, 0)),
        ("seccomp", 317, (0, 0, 0)), ("setpriority", 141, (0, 0, -5)), ("setsid", 112, ()),
        ("timer_create", 222, (0, 0, 0)), ("alarm(0)", 37, (0,)), ("inotify_init1", 294, (0,)),
        ("personality", 135, (0xffffffff,)), ("sched_setaffinity other(1)", 203, (1, 8, ctypes.addressof(MASK))),
        ("clone(SIGCHLD) plain", 56, (17, 0, 0, 0, 0))]:
    t(f"syscall {name}", lambda nr=nr, args=args: sc(nr, *args))


def setown():
    import fcntl
    r, w = os.pipe()
    a = fcntl.fcntl(r, fcntl.F_SETOWN, 1)
    fcntl.fcntl(r, fcntl.F_SETFL, os.O_ASYNC)
    os.write(w, b"x")
    time.sleep(0.2)
    return f"F_SETOWN(1)={a}; pid 1 alive afterwards: {os.path.exists('/proc/1/status')}"
t("fcntl F_SETOWN+O_ASYNC -> SIGIO to pid 1", setown)
t("open /dev/tty (TIOCSTI needs it)", lambda: os.open("/dev/tty", os.O_RDWR))


def threads(n=2000):
    threading.stack_size(64 << 10)
    stop = threading.Event()
    made = []
    try:
        for _ in range(n):
            th = threading.Thread(target=stop.wait, daemon=True)
            th.start()
            made.append(th)
    except BaseException as exc:  # noqa: BLE001
        stop.set()
        return f"stopped at {len(made)}: {exc}"
    count = len(os.listdir("/proc/self/task"))
    stop.set()
    return f"{len(made)} threads started ({count} tasks), each a host pid (host pid_max 32768)"
t("threads (pid exhaustion)", threads)
t("signal self SIGSTOP allowed (raise)", lambda: "skipped: tested in the wire tests")

print(json.dumps(R, indent=1))
