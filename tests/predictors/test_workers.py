"""The predictors' fitting pool (predictors/workers.py): its workers end with the process that started them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the process tree from /proc")
def test_workers_do_not_outlive_a_parent_killed_outright():
    """A parent killed with SIGKILL runs no clean-up: its pool's two workers, each busy for a minute, end themselves
    within seconds instead of living on as orphans (and then blocking on the dead parent's queue for ever)."""
    script = textwrap.dedent("""
        import time
        from predictors import workers
        with workers.pool(2) as run:
            list(run(time.sleep, [60, 60]))
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(_children(parent.pid)) < 3 and time.monotonic() < deadline:  # two workers and the resource tracker
            time.sleep(0.1)
        workers = [pid for pid in _children(parent.pid) if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]
        assert workers, "the pool started no worker"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 20
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [pid for pid in workers if _alive(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"workers {left} outlived their parent"
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
