"""Run candidate code only in a child process with limits: CPU time, address space, wall clock, a scratch
working directory, one thread, no network (`probe` refuses connections before importing the candidate).

    result = run_probe(request, limits=Limits())    # the probe's JSON result, or a failed one saying why

A candidate that loops, allocates without end or crashes the interpreter fails its round; the agent's own
process never imports it.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    cpu_seconds: int = 300
    memory_bytes: int = 16 << 30  # address space: torch alone maps a few GiB
    wall_seconds: int = 600


def _limit(limits: Limits):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    return apply


def run_probe(request: dict, limits: Limits = Limits()) -> dict:
    """`python -m onboard.agent.probe` on `request` under `limits`; its JSON result, or a failure saying why."""
    env = {key: value for key, value in os.environ.items()
           if not key.endswith(("_API_KEY", "_TOKEN")) and not key.startswith(("HTTP_PROXY", "HTTPS_PROXY"))}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    with tempfile.TemporaryDirectory(prefix="onboard-probe-") as scratch:
        try:
            done = subprocess.run([sys.executable, "-m", "onboard.agent.probe"], input=json.dumps(request),
                                  capture_output=True, text=True, cwd=scratch, env=env, timeout=limits.wall_seconds,
                                  preexec_fn=_limit(limits))
        except subprocess.TimeoutExpired:
            return {"passed": False, "note": f"the probe ran past {limits.wall_seconds} s and was stopped"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"passed": False, "note": f"the probe process ended with code {done.returncode}: {tail[:300]}"}
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError:
        return {"passed": False, "note": f"the probe printed no result: {lines[-1][:300]}"}
