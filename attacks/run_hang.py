"""g09_parent_hang through the judge (probe, then timing) with the guard skipped -- the guard passes it anyway.
A watchdog dumps every thread's stack and exits after LIMIT seconds if the parent hangs.
Usage (from /work/main): OMP_NUM_THREADS=1 python attacks/run_hang.py"""
import faulthandler
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_e2e  # noqa: E402
from run_e2e import HERE, MODULE, Sandbox, family_twin, guard, judged, ModuleState  # noqa: E402
import tempfile  # noqa: E402

LIMIT = 150
source, twin, spec = family_twin("zaya", Path(tempfile.mkdtemp()))
code = (HERE / "candidates" / "g09_parent_hang.py").read_text()
print("guard:", guard.check(code, ModuleState.of(twin.model.get_submodule(MODULE)).names()) or "passes", flush=True)
faulthandler.dump_traceback_later(LIMIT, exit=True)
t0 = time.monotonic()
with Sandbox(source.ref) as sandbox:
    print("result:", judged(sandbox, code, True), f"after {time.monotonic() - t0:.0f}s", flush=True)
print("returned normally after", round(time.monotonic() - t0), "s")
