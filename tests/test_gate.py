"""The gate is a function of the commit (issue 53): no test reads the date, the wall clock, the host, the load or
an outside source of randomness to decide what to run or which inputs to draw, so the same commit runs the same
tests with the same inputs on any machine, on any day.

Two checks. `test_no_test_reads_the_date_the_host_or_the_load` reads every file under tests/ (the gate's test
files, conftests, workers and helpers) for the calls that do; discovery (`tests/variety/discover.py`), whose job
is to draw by date, is the one file allowed to. A use whose result cannot move what runs (a host name the code
under test compares with itself) carries `# gate: <why>` on its line. Timing a wait with `time.monotonic` (a
deadline against hangs) is no input and stays allowed. `test_another_day_collects_the_same_tests` then collects
the whole suite again under libfaketime, two years from now, and compares the test ids with today's.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
DISCOVERY = {"tests/variety/discover.py"}  # draws by date on purpose; the gate never runs it
WAIVER = "# gate:"

# module -> its functions that read the date, the wall clock, the host, the load or the OS's randomness
READERS = {
    "datetime": {"now", "today", "utcnow"},  # datetime.datetime.now, datetime.date.today, ...
    "date": {"today"},
    "time": {"time", "time_ns", "localtime", "gmtime", "ctime", "asctime", "strftime", "clock_gettime"},
    "socket": {"gethostname", "getfqdn", "gethostbyname"},
    "platform": {"node", "uname", "processor"},
    "os": {"uname", "getloadavg", "cpu_count", "sched_getaffinity", "urandom", "getrandom"},
    "multiprocessing": {"cpu_count"},
    "secrets": {"token_bytes", "token_hex", "token_urlsafe", "randbits", "choice", "randbelow", "SystemRandom"},
    "uuid": {"uuid1", "uuid4"},
    # the random module's own generator (seeded from the OS) and numpy's global one
    "random": {"random", "randint", "randrange", "choice", "choices", "shuffle", "sample", "uniform", "gauss",
               "getrandbits", "randbytes", "SystemRandom", "rand", "randn", "normal", "permutation"},
    "torch": {"seed"},  # seeds torch's generator from the OS
    "psutil": None,  # every use
}
CI_VARIABLES = {"CI", "GITHUB_ACTIONS", "GITHUB_RUN_ID", "HOSTNAME"}  # environments that say where, not what


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _reads(name: str) -> bool:
    """`name` ("datetime.datetime.now", "time.time", "np.random.default_rng") reads one of READERS."""
    parts = name.split(".")
    if len(parts) < 2:
        return False
    owner, func = parts[-2], parts[-1]
    funcs = READERS.get(owner, set())
    return funcs is None or func in funcs or parts[0] == "psutil"


def date_readers(text: str, filename: str = "<test>") -> list[str]:
    """'line N: what' for each read of the date, the wall clock, the host, the load or the OS's randomness in the
    source `text` (lines carrying `# gate: <why>` excepted)."""
    tree = ast.parse(text, filename)
    lines = text.splitlines()
    aliases: dict[str, str] = {}  # a name imported from a reader's module -> its dotted origin
    found = []

    def note(node: ast.AST, what: str) -> None:
        if WAIVER not in lines[node.lineno - 1]:
            found.append(f"line {node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(getattr(node, "ctx", None), ast.Load):
            name = _dotted(node)
            head, _, rest = name.partition(".")
            full = f"{aliases[head]}.{rest}".rstrip(".") if head in aliases else name
            if _reads(full):
                note(node, full)
        if isinstance(node, ast.Call):
            func = _dotted(node.func)
            head, _, rest = func.partition(".")
            func = f"{aliases[head]}.{rest}".rstrip(".") if head in aliases else func
            if func.endswith(("random.Random", "random.default_rng")) and not node.args and not node.keywords:
                note(node, f"{func}() without a seed")
            if func in ("os.environ.get", "os.getenv") and node.args and isinstance(node.args[0], ast.Constant) \
                    and node.args[0].value in CI_VARIABLES:
                note(node, f"{func}({node.args[0].value!r})")
        if isinstance(node, ast.Subscript) and _dotted(node.value) == "os.environ" \
                and isinstance(node.slice, ast.Constant) and node.slice.value in CI_VARIABLES:
            note(node, f"os.environ[{node.slice.value!r}]")
    return sorted(set(found), key=lambda s: int(s.split()[1].rstrip(":")))


def test_no_test_reads_the_date_the_host_or_the_load():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel not in DISCOVERY:
            found += [f"{rel} {what}" for what in date_readers(path.read_text(), rel)]
    assert found == [], ("the gate must be a function of the commit; these read the date, the clock, the host, the "
                         "load or the OS's randomness (mark a use that cannot move what runs with '# gate: <why>'):\n"
                         + "\n".join(found))


PLANTED = '''
import datetime, os, random, socket, time
from datetime import date
import numpy as np

def _cases():
    return int(datetime.datetime.now(datetime.UTC).strftime("%Y%m%d"))   # 7

def test_a():
    seed = date.today().toordinal()                                      # 10
    random.seed(time.time())                                             # 11
    if os.environ.get("CI"):                                             # 12
        pass
    rng = np.random.default_rng()                                        # 14
    host = socket.gethostname()                                          # 15
    k = random.choice([1, 2])                                            # 16
    n = os.cpu_count()                                                   # 17
'''

CLEAN = '''
import os, random, time
import numpy as np
import torch

def test_b():
    deadline = time.monotonic() + 300   # a deadline against hangs: allowed
    rng = random.Random(0)
    g = np.random.default_rng(7)
    t = torch.Generator().manual_seed(0)
    name = os.uname().nodename  # gate: the code under test compares it with itself
    assert os.environ.get("HF_HUB_OFFLINE")
'''


def test_the_scan_sees_a_planted_date_dependence():
    """Planted: a case list from the date, seeds from the clock, a branch on CI, an unseeded generator, the host
    name, the module's OS-seeded generator and the core count are each reported on their line; deadlines,
    seeded generators and a waived line are not."""
    lines = [int(f.split()[1].rstrip(":")) for f in date_readers(PLANTED)]
    assert sorted(set(lines)) == [7, 10, 11, 12, 14, 15, 16, 17], date_readers(PLANTED)
    assert date_readers(CLEAN) == []


def _collected(env: dict | None = None, faketime: str | None = None) -> list[str]:
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider", "tests"]
    if faketime:
        command = [faketime, "-f", "@2028-02-29 23:30:00", *command]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


@pytest.mark.slow
def test_another_day_collects_the_same_tests(request):
    """The whole suite collected under libfaketime (a leap day two years on, half an hour before midnight UTC)
    gives the same test ids as this session's own collection: no test list, parameter or id is drawn from the
    date. libfaketime is a Debian package (`faketime`), which `.ci/run` installs."""
    faketime = shutil.which("faketime")
    if faketime is None:
        pytest.skip("libfaketime is not installed (apt-get install faketime; .ci/run installs it)")
    session = request.session
    whole = (not request.config.option.keyword and not request.config.option.markexpr
             and [Path(a).resolve() for a in request.config.args] in ([TESTS], [ROOT]))
    today = [item.nodeid for item in session.items] if whole else _collected()  # a worker collects every test
    other = _collected({"FAKETIME_DONT_FAKE_MONOTONIC": "1"}, faketime)
    assert len(other) == len(today) and other == today, (
        f"{len(set(other) ^ set(today))} test ids differ on another day: {sorted(set(other) ^ set(today))[:10]}")
