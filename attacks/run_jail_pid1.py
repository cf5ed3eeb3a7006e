"""Host side of jail_pid1_inner.py: start it in the jail as the worker would be, let it exit, then look for the
process it left behind; kill bubblewrap's process group (what Worker.kill does) and look again; clean up.
Usage: python attacks/run_jail_pid1.py"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from onboard.agent.sandbox import jail  # noqa: E402


def leftovers():
    out = subprocess.run(["ps", "-eo", "pid,ppid,pgid,sid,user,args"], capture_output=True, text=True).stdout
    return [l for l in out.splitlines() if "sleep 317" in l and "grep" not in l]


script = (Path(__file__).parent / "jail_pid1_inner.py").read_text()
proc = subprocess.Popen(jail.command([sys.executable, "-c", script]), stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={"PATH": "/usr/bin:/bin"},
                        start_new_session=True)
lines = []
deadline = time.monotonic() + 60
for line in proc.stdout:
    lines.append(line.rstrip())
    if "ARMED" in line or time.monotonic() > deadline:
        break
print("\n".join(lines[-10:]))
time.sleep(2)
print("bwrap still running:", proc.poll() is None)
print("left behind after the worker exited:", leftovers())
try:
    os.killpg(proc.pid, signal.SIGKILL)  # what Worker.kill does
except ProcessLookupError:
    pass
proc.wait()
time.sleep(1)
left = leftovers()
print("left behind after killpg(bwrap) and bwrap's exit:", left)
for l in left:  # clean up what this test started
    os.kill(int(l.split()[0]), signal.SIGKILL)
