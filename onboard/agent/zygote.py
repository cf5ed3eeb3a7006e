"""A process that has imported what a probe needs and forks one fresh probe process per sandbox session (started by
`sandbox`). Importing torch and transformers takes seconds; forking a process that has them takes milliseconds,
and every session still gets a process no candidate has run in.

    python -m onboard.agent.zygote
    < {"op": "session", "cwd": DIR, "memory_bytes": N}    > {"session": PID}    the probe process serves the
    < probe requests ... > results ...                                               same pipes until
    < {"op": "end"}                                       > {"ended": CODE}     it ends (or is killed)

The zygote reads its control lines unbuffered, so a line meant for the probe process is never in the zygote's
buffer; it sends nothing on while a session runs. It never runs torch code itself (a process forked after
OpenMP has started threads can deadlock), and stops when its input ends.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import traceback

ENDED = "onboard-probe-ended"  # written to stderr once a probe process has ended: what it wrote there came before

def _preload() -> None:
    """What every probe imports (probe.py imports lazily: the probe process alone needs these)."""
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401

    import onboard.source  # noqa: F401
    import onboard.twin  # noqa: F401
    import runtime.generated  # noqa: F401


def _line(fd: int) -> bytes:
    """One line from `fd`, read a byte at a time (b"" at the end of the input)."""
    out = bytearray()
    while (byte := os.read(fd, 1)) and byte != b"\n":
        out += byte
    return bytes(out) if out or byte else b""


def _serve_session(session: dict) -> None:
    """In the forked child: the session's working directory and memory limit, then the probe's loop."""
    from onboard.agent import probe

    os.chdir(session["cwd"])
    memory = session["memory_bytes"]
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    probe.main()


def main() -> None:
    _preload()
    while line := _line(0):
        session = json.loads(line)
        if session.get("op") != "session":
            continue
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _serve_session(session)
            except BaseException:  # noqa: BLE001 - the child reports and ends; the zygote carries on
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        print(json.dumps({"session": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(ENDED, file=sys.stderr, flush=True)
        print(json.dumps({"ended": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
