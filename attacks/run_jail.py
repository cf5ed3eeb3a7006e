"""Run jail_inner.py inside the candidate jail (jail.command), as the worker would be.
Usage: OMP_NUM_THREADS=1 python attacks/run_jail.py"""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from onboard.agent.sandbox import jail  # noqa: E402

script = (Path(__file__).parent / "jail_inner.py").read_text()
argv = jail.command([sys.executable, "-c", script])
done = subprocess.run(argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                      env={"PATH": "/usr/bin:/bin"}, start_new_session=True)
print("rc", done.returncode)
print(done.stdout[-20000:])
print("STDERR", done.stderr[-5000:])
