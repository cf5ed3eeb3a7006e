"""The walls of a sandboxed process, raised by the process itself before it reads any request.

    early(parent_pid)           # first thing: dies with its parent, no network, limits, stdout onto stderr
    ...import what it needs, warm up...
    audit(scratch)              # last thing before serving: the audit hook (PEP 578); it cannot be removed

`early` runs before the process imports torch (a new network namespace needs a single-threaded process). It
starts a watchdog thread that ends the process as soon as its parent is gone (the kernel's parent-death signal
follows the thread that started a process, and the sandbox starts its processes from threads), moves it into a network namespace of its own where
the kernel allows one (root, or unprivileged user namespaces): there is no interface but a loopback nobody
listens on; sets resource limits (open files, file size, core dumps; memory with `memory`; the parent sets its
CPU time from outside, `resource.prlimit`, which the process itself may not change); and points file
descriptor 1 at 2, so nothing the process prints can pass for a reply.

`audit` installs an audit hook that refuses, by raising, for the rest of the process's life: opening files for
writing outside the scratch directory, or for reading outside the Python installation, the project's runtime
and the scratch directory; sockets; starting processes (subprocess, os.system, os.exec*, os.posix_spawn,
os.fork); signals to other processes; ctypes; frames, tracers, gc's object graph, new code or function
objects; setting attributes on classes; and importing anything but torch, runtime, math, numpy and a short
list of the standard library. Its policy is frozen in the hook's closure. Each refusal is also written to
stderr, a line starting REFUSED, so a candidate that swallows the exception is still seen.
"""

from __future__ import annotations

import os
import resource
import sys

from runtime.parent_watch import end_with_parent

REFUSED = "REFUSED"
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000

# the standard library a candidate's torch calls may import lazily, and nothing that reaches the world
IMPORTABLE = frozenset("""
torch torchgen runtime math cmath numpy sympy mpmath typing_extensions functools collections dataclasses enum
typing abc itertools operator warnings weakref contextlib re copy copyreg numbers decimal fractions random
string textwrap struct bisect heapq keyword types traceback linecache tokenize token reprlib pprint
statistics array difflib unicodedata opcode dis inspect ast
""".split())
PROCESS_EVENTS = frozenset("""
os.system os.exec os.posix_spawn os.spawn os.fork os.forkpty os.kill os.killpg os.putenv os.unsetenv os.chdir
os.symlink os.link os.rename os.remove os.rmdir os.truncate os.chmod os.chown os.chflags os.setxattr
os.removexattr os.startfile os.add_dll_directory pty.spawn signal.pthread_kill sys._getframe
sys._current_frames sys._current_exceptions sys.settrace sys.setprofile sys.remote_exec gc.get_referrers
gc.get_referents gc.get_objects code.__new__ function.__new__ object.__setattr__ object.__delattr__
builtins.input builtins.breakpoint pickle.find_class mmap.__new__ webbrowser.open
cpython.run_command cpython.run_file cpython.run_module cpython.run_startup cpython.run_interactivehook
urllib.Request ftplib.connect http.client.connect imaplib.open nntplib.connect poplib.connect
smtplib.connect telnetlib.Telnet.open shutil.copyfile shutil.copymode shutil.copystat shutil.copytree
shutil.rmtree shutil.move shutil.make_archive shutil.chown shutil.unpack_archive tempfile.mkstemp
tempfile.mkdtemp resource.setrlimit resource.prlimit fcntl.ioctl fcntl.fcntl fcntl.flock fcntl.lockf
""".split())
REFUSED_PREFIXES = ("socket.", "subprocess.", "ctypes.", "_winapi.", "winreg.", "msvcrt.", "ssl.", "sqlite3.",
                    "syslog.", "_posixsubprocess.")
HIDDEN_ATTRIBUTES = frozenset({"gi_frame", "gi_code", "cr_frame", "cr_code", "ag_frame", "ag_code", "tb_frame",
                               "f_back", "f_globals", "f_locals", "f_builtins", "f_code", "__code__",
                               "__globals__", "__closure__", "__builtins__"})
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _namespace() -> str:
    """A network namespace of this process's own: "" or why not (the process then relies on the audit hook)."""
    try:
        libc = _libc()
    except OSError as exc:
        return f"no libc ({exc})"
    if libc.unshare(CLONE_NEWNET) == 0:
        return ""
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        return f"unshare refused (errno {os.strerror(__import__('ctypes').get_errno())})"
    try:  # map this user to itself, so files keep their owner inside the namespace
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{gid} {gid} 1")
    except OSError as exc:
        return f"user namespace without an id map ({exc})"
    return ""


def early(parent_pid: int, *, files: int = 256, file_bytes: int = 1 << 30) -> str:
    """The walls raised before the process imports anything heavy; returns "" or why it has no network
    namespace of its own. In the jail (`jail`: parent pid 0) the namespaces are already the jail's, and bubblewrap
    ends the process with its parent."""
    if parent_pid == 0:
        if os.environ.get("ONBOARD_JAILED") != "1":
            os._exit(1)
        why = ""
    else:
        if os.getppid() != parent_pid:
            os._exit(1)
        why = _namespace()  # before any thread: a process that has threads cannot enter a new user namespace
        end_with_parent(parent_pid)
    for limit, value in ((resource.RLIMIT_NOFILE, files), (resource.RLIMIT_FSIZE, file_bytes),
                         (resource.RLIMIT_CORE, 0)):
        soft, hard = resource.getrlimit(limit)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        try:
            resource.setrlimit(limit, (value, value))
        except (ValueError, OSError):
            pass
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return why


# what an honest worker calls once its imports are done (measured under strace: torch's calls, the server's pipe,
# the watchdog's sleep), and the file calls a tmpfs scratch folder needs. Everything else fails with EPERM:
# execve and execveat, fork (clone without CLONE_THREAD; clone3, whose flags a filter cannot read, says ENOSYS
# so that threads fall back to clone), ptrace and process_vm_*, pidfds, sockets, mount, unshare, setns, bpf,
# perf_event_open, keyrings, userfaultfd, io_uring, chmod / chown / utime, links, mknod (FIFOs).
ALLOWED_SYSCALLS = """
read write readv writev pread64 pwrite64 preadv pwritev lseek close close_range fstat newfstatat statx stat lstat
openat open access faccessat faccessat2 readlink readlinkat getdents64 getcwd fcntl ioctl dup dup2 dup3 pipe pipe2
mmap munmap mremap mprotect madvise brk mbind get_mempolicy set_mempolicy mlock munlock memfd_create membarrier
futex get_robust_list set_robust_list set_tid_address rseq getrandom rt_sigaction rt_sigprocmask rt_sigreturn
sigaltstack sched_getaffinity sched_setaffinity sched_yield sched_getparam sched_getscheduler sched_get_priority_max
sched_get_priority_min uname clock_gettime clock_getres clock_nanosleep nanosleep gettimeofday time getrlimit
getrusage times sysinfo gettid getpid getppid getuid geteuid getgid getegid getgroups getresuid getresgid
getpgrp getpgid getsid exit exit_group arch_prctl epoll_create1 epoll_ctl epoll_wait epoll_pwait poll ppoll select
pselect6 eventfd2 umask mkdir mkdirat unlink unlinkat rmdir rename renameat renameat2 ftruncate fsync fdatasync
fadvise64 flock wait4 restart_syscall
""".split()
CLONE_THREAD = 0x00010000


def seccomp_available() -> None:
    """Raises ImportError or OSError where the allow-list cannot be built (no libseccomp, no bindings)."""
    import pyseccomp

    pyseccomp.resolve_syscall(pyseccomp.system_arch(), "read")


def seccomp() -> None:
    """Load the allow-list (ALLOWED_SYSCALLS) on every thread of this process (TSYNC), for good: a loaded filter
    can only be narrowed. Signals go to this process only (its pid namespace holds nothing else of ours, or its zygote and the
    zygote's other forks)."""
    import errno

    import pyseccomp as sc

    rules = sc.SyscallFilter(defaction=sc.ERRNO(errno.EPERM))
    rules.set_attr(sc.Attr.CTL_TSYNC, 1)
    arch = sc.system_arch()
    for name in ALLOWED_SYSCALLS:
        try:
            sc.resolve_syscall(arch, name)
        except (ValueError, OSError):
            continue  # not a call on this architecture
        rules.add_rule(sc.ALLOW, name)
    me = os.getpid()
    rules.add_rule(sc.ALLOW, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_THREAD, CLONE_THREAD))
    rules.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    rules.add_rule(sc.ALLOW, "prlimit64", sc.Arg(2, sc.EQ, 0))  # reading a limit; raising one is refused
    for name in ("kill", "tgkill"):
        rules.add_rule(sc.ALLOW, name, sc.Arg(0, sc.EQ, me))
    rules.add_rule(sc.ALLOW, "tkill", sc.Arg(0, sc.EQ, me))  # (its main thread's id is its pid)
    rules.load()


def memory(limit_bytes: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))


def read_roots() -> tuple[str, ...]:
    """Where a confined process may read: the Python installation and its packages, and the runtime package."""
    import runtime

    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(runtime.__file__),
             os.path.dirname(os.path.abspath(__file__)), "/dev/null", "/dev/urandom", "/sys/devices/system/cpu"}
    roots |= {p for p in sys.path if "site-packages" in p or "dist-packages" in p}
    return tuple(sorted({os.path.realpath(r) for r in roots if r}))


def audit(scratch: str, roots: tuple[str, ...] | None = None) -> None:
    """Install the audit hook (module docstring). Nothing it reads can be changed afterwards: its policy is
    tuples and frozensets bound in its closure."""
    scratch = os.path.realpath(scratch)
    readable = tuple(roots if roots is not None else read_roots()) + (scratch,)
    write, refused_prefixes, process_events = WRITE_FLAGS, REFUSED_PREFIXES, PROCESS_EVENTS
    importable, hidden = IMPORTABLE, HIDDEN_ATTRIBUTES
    frequent = frozenset({"builtins.id", "exec", "compile", "marshal.loads"})  # harmless, and called often
    realpath, fspath, stderr = os.path.realpath, os.fsdecode, 2
    os_write = os.write

    def under(path, allowed) -> bool:
        """Whether `path`, every link in it followed (/proc/self/root/... is the whole file system), lies in one
        of the `allowed` folders."""
        try:
            full = realpath(fspath(path))
        except (TypeError, ValueError, OSError):
            return False
        return any(full == a or full.startswith(a.rstrip("/") + "/") for a in allowed)

    def refuse(what: str):
        try:
            os_write(stderr, f"{REFUSED} {what}\n".encode(errors="replace")[:2000])
        except OSError:
            pass
        raise PermissionError(f"the sandbox refused {what}")

    def hook(event: str, args: tuple) -> None:
        if event in frequent:
            return
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int):
                refuse(f"open of file descriptor {path}")
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & write)
            if writes and not under(path, (scratch,)):
                refuse(f"open({path!r}, {mode!r}) for writing outside the scratch directory")
            if not writes and not under(path, readable):
                refuse(f"open({path!r}) for reading outside the Python installation and the scratch directory")
        elif event == "os.mkdir":  # (held-out attack: a folder named as the zygote's next child's stopped it)
            if len(args) > 2 and args[2] not in (None, -1) or not args or not under(args[0], (scratch,)):
                refuse(f"os.mkdir({args[0] if args else ''!r}) outside the scratch directory")
        elif event in ("os.listdir", "os.scandir"):
            if args and args[0] is not None and not under(args[0], readable):
                refuse(f"{event}({args[0]!r})")
        elif event == "import":
            name = args[0] if args else ""
            if not isinstance(name, str) or name.split(".")[0] not in importable:
                refuse(f"import of {name} (only torch, runtime, math, numpy and some of the standard library)")
        elif event == "object.__getattr__":
            if len(args) > 1 and args[1] in hidden:
                refuse(f"the attribute {args[1]} (frames and code are out of reach)")
        elif event in process_events or event.startswith(refused_prefixes):
            refuse(f"{event} (no processes, signals, sockets, ctypes, frames or changes to classes)")

    sys.addaudithook(hook)
