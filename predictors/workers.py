"""Independent fits spread over worker processes.

Evaluating or calibrating a predictor fits one model per held-out group, and holding out a source at a time with its
own calibrated interval fits about 150 of them (`learned.evaluate`); each fit is single-threaded (OpenMP threads
spin-wait on a busy machine) and takes a second or two, most of it scikit-learn placing bin thresholds. The fits do
not depend on each other, so `pool` hands them to separate processes: the results are the same, in the same order,
whatever the number of workers (each fit is deterministic: fixed random state, one thread).

Workers are spawned, not forked: a forked child of a process whose OpenMP runtime already ran threads (torch,
scikit-learn) can hang in its first parallel region. They end themselves when the process that started them is
gone (`runtime.parent_watch`): a pool's workers outlive a parent killed outright, blocked on its queue for ever.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Iterable, Iterator

from runtime.parent_watch import end_with_parent


def cores() -> int:
    """CPU cores this process may run on (its affinity mask where the platform has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def resolve(jobs: int | None) -> int:
    """Worker processes for `jobs`: None takes every core this process may use; at least 1."""
    return cores() if jobs is None else max(1, int(jobs))


Mapper = Callable[[Callable, Iterable], Iterator]


@contextlib.contextmanager
def pool(jobs: int | None) -> Iterator[Mapper]:
    """A `map` that runs on `jobs` processes (None: every core; 1: here, in this process, with no pool). Functions
    and their arguments must pickle: module-level functions, plain data."""
    jobs = resolve(jobs)
    if jobs == 1:
        yield map
        return
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                             initializer=end_with_parent, initargs=(os.getpid(),)) as executor:
        yield executor.map
