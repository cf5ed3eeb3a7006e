"""What the bench scripts share: their command line."""

from __future__ import annotations

import argparse


def parser(doc: str, *, children: tuple[str, ...] = (), **options) -> argparse.ArgumentParser:
    """A bench's argument parser, described by the first line of its docstring, with a whole-number option for
    each keyword: `name=default`, or `name=(default, help)` (underscores become dashes; defaults are shown in
    --help). With `children` (the variants a bench runs one per process, `run_child`), the hidden options a
    child reads: --worker (which variant) and --out (where it writes its tensors)."""
    out = argparse.ArgumentParser(description=doc.splitlines()[0],
                                  formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    if children:
        out.add_argument("--worker", choices=children, help=argparse.SUPPRESS)
        out.add_argument("--out", help=argparse.SUPPRESS)
    for name, value in options.items():
        default, text = value if isinstance(value, tuple) else (value, name.replace("_", " "))
        out.add_argument(f"--{name.replace('_', '-')}", type=int, default=default, help=text)
    return out


def run_child(script: str, args: list[str], threads: int, what: str, **popen) -> dict:
    """Run `script` again in a fresh process (one variant per process: peak memory and allocator state are its
    own) with these arguments and `threads` OpenMP threads; the JSON object on its last `{` line. Exits with the
    child's error when it fails."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": str(threads), **popen.pop("env", {})}
    result = subprocess.run([sys.executable, script, *args], check=False, capture_output=True, text=True, env=env,
                            **popen)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        raise SystemExit(f"{what} failed (exit {result.returncode}): {result.stderr.strip()[-2000:]}")
    return json.loads(lines[-1])
