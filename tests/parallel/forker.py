"""Start a gloo world's ranks as forks of one process that has already imported what every rank imports.

Usage: python forker.py <world> <script> <job.json> <log folder>, with MASTER_ADDR / MASTER_PORT set. Each rank is
a process of its own, as under torchrun: RANK, LOCAL_RANK and WORLD_SIZE in its environment, `script` run as
`__main__` with the job as its argument, its output in `<log folder>/rank<N>.log`. What changes is only who pays for
the imports: a rank that imports torch, the runtime and transformers spends about 6 s of CPU on that before its
first collective, once per rank; here it is paid once per world. Prints the ranks' exit codes as JSON
(a rank killed by a signal: minus the signal's number) and exits 0 when it could wait for them all.

No thread runs when the ranks fork (imports start none), so each begins as a copy of one thread, its locks free.
"""

import importlib
import json
import os
import runpy
import sys
import traceback
from pathlib import Path

# what the tests' rank scripts import: the torch stack, the runtime's training and parallel code, transformers'
# model base (a model's own module is small beside it), and what tests/parallel/worker.py reads bundles with
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.tensor",
           "transformers", "transformers.modeling_utils", "transformers.masking_utils", "runtime.train",
           "runtime.parallel", "runtime.parallel.pipeline", "runtime.lora", "onboard.source", "onboard.bundle.files",
           "onboard.train.model", "onboard.twin", "onboard.review.families")


def main() -> None:
    world, script, job, logs = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    for name in PRELOAD:
        importlib.import_module(name)
    sys.stdout.flush()
    ranks = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            _rank(rank, world, script, job, logs)  # never returns
        ranks[pid] = rank
    codes = {}
    while ranks:
        pid, status = os.wait()
        codes[ranks.pop(pid)] = os.waitstatus_to_exitcode(status)
    print(json.dumps(codes))


def _rank(rank: int, world: int, script: Path, job: str, logs: Path) -> None:
    code = 1
    try:
        out = os.open(logs / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
        sys.argv = [str(script), job]
        sys.path[0] = str(script.parent)  # as `python script` would have it
        runpy.run_path(str(script), run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001 - the rank's failure, for the test to show
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    main()
