"""A child process that ends itself when the process that started it is gone.

A parent killed outright (SIGKILL, the OOM killer) runs no clean-up, and a child blocked on a pipe from it, or still
computing, would live on as an orphan holding memory and a core. `end_with_parent` starts a daemon thread that
watches the parent's pid and exits the process at once, whatever it is running, when it changes (the child is
re-parented). Used by the agent's sandboxed workers and by the predictors' fitting pool.
"""

from __future__ import annotations

import os
import threading
import time


def end_with_parent(parent_pid: int) -> None:
    """End this process (at once, whatever it is running) when `parent_pid` is no longer its parent."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()
