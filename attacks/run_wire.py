"""The parent side (process.Worker, wire.read) against hostile workers (fake_worker.py).
Usage (from /work/main): OMP_NUM_THREADS=1 python attacks/run_wire.py"""
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.chdir(ROOT)
from onboard.agent.sandbox.process import Stopped, Worker  # noqa: E402


def start(mode):
    os.environ["FAKE_MODE"] = mode
    return Worker("attacks.fake_worker", Path(tempfile.mkdtemp()), memory_bytes=1 << 30, passed_env=("FAKE_MODE",))


def timed_request(worker, seconds=5):
    t0 = time.monotonic()
    try:
        got = worker.request({"op": "repeat"}, seconds=seconds)
        out = f"reply {str(got[0])[:80]}"
    except Stopped as exc:
        out = f"Stopped: {exc}"
    return f"{out} after {time.monotonic() - t0:.2f}s"


for mode in ("deepjson", "sigstop", "flood"):
    w = start(mode)
    print(mode, "->", timed_request(w), "| refusals/errors kept:", len(w.errors), "| parent maxrss MiB:",
          resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10)
    t0 = time.monotonic()
    w.close()
    print("   closed in", round(time.monotonic() - t0, 2), "s; alive:", w.proc.poll() is None)

for mode in ("honestwork", "threadwork", "prequeue"):
    w = start(mode)
    samples = []
    for _ in range(4):
        before = w.cpu_seconds()
        t0 = time.monotonic()
        timed_request(w)
        samples.append((round(w.cpu_seconds() - before, 3), round(time.monotonic() - t0, 3)))
    total = Path(f"/proc/{w.pid}/stat").read_text().rpartition(")")[2].split()
    cpu_all = (int(total[11]) + int(total[12])) / os.sysconf("SC_CLK_TCK")
    print(f"{mode}: (measured cpu_seconds delta, wall) per request (true work 0.5 s CPU each): {samples}; "
          f"whole-process CPU per /proc/pid/stat: {cpu_all:.2f}s")
    w.close()
