"""The kernel's walls around a candidate's process: bubblewrap's namespaces and a file system made for it.

    why = why_not()                                   # "" where the jail can be made here, else what is missing
    argv = command([python, "-m", CANDIDATE, ...])   # the worker's command line, run inside the jail

A jailed process has new user, pid, mount, network, ipc, uts and cgroup namespaces (`--unshare-all`), is the only
process of its pid namespace (pid 1: no bubblewrap init beside it to take over through /proc/1/mem; a sandbox's
zygote is that process, and its forks share the namespace with it, none of them dumpable: `candidate_worker.zygote`), runs as
nobody (65534) with no capabilities and `no_new_privs` (bubblewrap sets it), in a session of its own, and dies
with its parent. It sees:

- read-only: the system's shared libraries and programs (/usr and the /lib, /bin links), the interpreter and its
  own standard library, and of the installed packages only those the worker imports (`PACKAGES`: torch and what
  torch imports; not transformers, not the rest of site-packages); the project's `runtime` package, and of
  `onboard` only the worker's own files (`WORKER_FILES`: not the judge, not the agent, not the bundle code). All
  but /usr are bound under JAIL, so no path of the caller's (a home directory holding pyenv, a virtual
  environment, the checkout) exists inside;
- read-write: its scratch directory, a tmpfs of SCRATCH_BYTES at SCRATCH; the rest is read-only;
- a /proc of its own pid namespace (itself alone, or a zygote and its forks), a minimal /dev, and nothing else: no home
  directory, no /root, nothing of /etc but the linker's cache, no judge key, no model folder, no network interface but a loopback.

Every site-packages or dist-packages folder under /usr is hidden under an empty read-only tmpfs; the listed
packages are bound at JAIL/site-packages. The worker adds a seccomp allow-list of its own once its imports
are done (`confine.seccomp`), and the audit hook after that: three layers, the kernel's two first.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
# the packages a candidate's worker imports (measured: torch, its own imports and what warm-up loads lazily)
PACKAGES = ("torch", "torchgen", "functorch", "numpy", "safetensors", "sympy", "mpmath", "typing_extensions", "tqdm",
            "filelock", "packaging", "pyseccomp")
# of onboard, the files the worker imports: its server, its walls, the wire format, the call runner, the allow-list
WORKER_FILES = ("onboard/__init__.py", "onboard/agent/__init__.py", "onboard/agent/capabilities.py",
                "onboard/agent/sandbox/__init__.py", "onboard/agent/sandbox/candidate_worker.py",
                "onboard/agent/sandbox/confine.py", "onboard/agent/sandbox/wire.py",
                "onboard/agent/sandbox/calls.py")
NOBODY = 65534
JAIL = "/run/onboard"  # inside: the interpreter (when not under /usr), the packages and the project's files
SCRATCH = "/scratch"
SCRATCH_BYTES = 256 << 20  # the scratch tmpfs: what a candidate may write in all
JAILED = "ONBOARD_JAILED"  # set in a jailed process's environment: its walls are the jail's


def bwrap() -> str | None:
    return shutil.which("bwrap")


def _interpreter() -> Path:
    """The interpreter itself (a virtual environment's python is a link to it)."""
    return Path(os.path.realpath(sys.executable))


def _site_folders() -> set[str]:
    folders = set(site.getsitepackages()) | {site.getusersitepackages()}
    folders |= {p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages"))}
    for base in ("/usr/lib/python3/dist-packages", "/usr/local/lib/python3/dist-packages"):
        folders.add(base)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for prefix in ("/usr", "/usr/local"):
        folders |= {f"{prefix}/lib/{version}/site-packages", f"{prefix}/lib/{version}/dist-packages"}
    return {os.path.realpath(f) for f in folders if f}


def _package_paths() -> list[str]:
    """Where each listed package that is installed lives (a folder, or a single module's file), and the folders of
    libraries its wheel bundles beside it (`numpy.libs`)."""
    paths = []
    for name in PACKAGES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.origin or spec.origin in ("built-in", "frozen"):
            continue
        origin = Path(spec.origin)
        place = origin.parent if origin.name == "__init__.py" else origin
        paths.append(os.path.realpath(place))
        libs = place.parent / f"{name}.libs"
        if libs.is_dir():
            paths.append(os.path.realpath(libs))
    return paths


def _system_binds() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    return args


def _python_binds() -> tuple[list[str], str]:
    """(binds, the interpreter's path inside): the interpreter, its shared library and its standard library. An
    interpreter under /usr stays where it is; one elsewhere (pyenv's, under a home directory) is bound at
    JAIL/python, where it finds its standard library beside itself, so no folder of its own path exists inside."""
    exe = _interpreter()
    stdlib = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_prefix})["stdlib"]
    libdir, library = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("LDLIBRARY")
    shared = Path(libdir) / library if libdir and library and (Path(libdir) / library).is_file() else None
    if str(exe).startswith("/usr/") and stdlib.startswith("/usr/"):
        return [], str(exe)
    home = f"{JAIL}/python"
    args = ["--ro-bind", str(exe), f"{home}/bin/{exe.name}",
            "--ro-bind", os.path.realpath(stdlib), f"{home}/lib/{Path(stdlib).name}"]
    if shared is not None:
        args += ["--ro-bind", os.path.realpath(shared), f"{home}/lib/{shared.name}",
                 "--setenv", "LD_LIBRARY_PATH", f"{home}/lib"]
    return args, f"{home}/bin/{exe.name}"


def command(argv: list[str], *, hostname: str = "candidate") -> list[str]:
    """`argv` (its first item the interpreter) as a jailed command line, its working directory and home the
    jail's scratch tmpfs (`SCRATCH`)."""
    tool = bwrap()
    if tool is None:
        raise RuntimeError(why_not())
    # --as-pid-1: the worker is the only process of its pid namespace. With bubblewrap's init there as pid 1 (same
    # uid, no seccomp filter), a candidate could write code into it through /proc/1/mem and run it unfiltered.
    args = [tool, "--unshare-all", "--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY),
            "--disable-userns", "--cap-drop", "ALL", "--die-with-parent", "--new-session", "--as-pid-1",
            "--hostname", hostname, "--proc", "/proc", "--dev", "/dev",
            # the jail's uid is the caller's outside (root, where onboard runs as root): /proc's files that reach the
            # whole machine (sysctls such as kernel.core_pattern, sysrq) would be writable to it
            "--ro-bind", "/proc/sys", "/proc/sys", "--ro-bind-try", "/proc/sysrq-trigger", "/proc/sysrq-trigger",
            "--ro-bind-try", "/proc/irq", "/proc/irq", "--ro-bind-try", "/proc/bus", "/proc/bus",
            "--ro-bind-try", "/proc/fs", "/proc/fs", "--size", str(1 << 20), "--tmpfs", "/dev/shm",
            "--remount-ro", "/dev",
            "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]  # (how libseccomp's bindings find it)
    python, interpreter = _python_binds()
    args += _system_binds() + python
    hidden = [folder for folder in sorted(_site_folders()) if os.path.isdir(folder) and folder.startswith("/usr/")]
    for folder in hidden:
        args += ["--tmpfs", folder]  # hide what the system's Python has installed
    for folder in hidden:
        args += ["--remount-ro", folder]
    for path in _package_paths():
        args += ["--ro-bind", path, f"{JAIL}/site-packages/{Path(path).name}"]
    project = os.path.realpath(ROOT)
    for name in ("runtime", *WORKER_FILES):
        args += ["--ro-bind", os.path.join(project, name), f"{JAIL}/project/{name}"]
    args += ["--size", str(SCRATCH_BYTES), "--tmpfs", SCRATCH, "--chdir", SCRATCH, "--remount-ro", "/",
             "--setenv", "HOME", SCRATCH, "--setenv", "TMPDIR", SCRATCH, "--setenv", "PYTHONPATH", import_path(),
             "--setenv", JAILED, "1", "--"]
    return args + [interpreter, "-s", "-S", *argv[1:]]


def import_path() -> str:
    """PYTHONPATH inside the jail: the project's folder (for `runtime` and the worker's files) and the packages'
    (the interpreter runs without `site`, so nothing else is on its path)."""
    return f"{JAIL}/project{os.pathsep}{JAIL}/site-packages"


@functools.lru_cache(maxsize=1)
def why_not() -> str:
    """"" where a jailed interpreter starts here; else one line saying what is missing and what to install."""
    if sys.platform != "linux":
        return "the candidate jail needs Linux (namespaces and seccomp)"
    if bwrap() is None:
        return "the candidate jail needs bubblewrap: install it (apt-get install bubblewrap)"
    try:
        from onboard.agent.sandbox import confine

        confine.seccomp_available()
    except (ImportError, OSError) as exc:
        return f"the candidate jail needs libseccomp's Python bindings: pip install pyseccomp ({exc})"
    try:
        done = subprocess.run(command([sys.executable, "-c", "import os; print(os.getuid())"]), capture_output=True,
                              text=True, timeout=60, stdin=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bubblewrap could not start a jail here ({exc})"
    if done.returncode != 0 or done.stdout.strip() != str(NOBODY):
        last = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return f"bubblewrap could not start a jail here (user namespaces may be off: {last})"
    return ""
