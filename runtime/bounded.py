"""One reader for every file a command is handed: plans, hardware YAML, agent records and replays, run logs,
predictor files, cache entries, bundle files.

A file someone handed over may be anything: `/dev/zero` (a read that never ends), a FIFO (an open that never
returns), a directory, a symlink loop, gigabytes, or JSON nested 100,000 deep (a `RecursionError` in the parser,
or later in whatever walks it). So a file is read only when it is a regular file (checked before the open, and
again on the open descriptor, which is opened non-blocking so a FIFO put in its place between the two cannot hold the
reader), of at most its kind's size (`CAPS`), and JSON is taken only when it is nested at most `MAX_DEPTH` deep.
Everything else is `Refused`, a `ValueError` (`runtime.errors.InputError`) whose message is one line naming the file: every verb turns it into
its own one-line error and a non-zero exit.
"""

from __future__ import annotations

import json
import os
import stat

from runtime.errors import InputError

# the most each kind of file may hold; each is far above what onboard writes for it
CAPS = {
    "plan": 1 << 20,  # a plan is a few hundred bytes
    "hardware spec": 1 << 20,  # a hardware YAML, a few hundred bytes
    "agent record": 64 << 20,  # agent.jsonl: a session's events, kilobytes to megabytes of generated code
    "run log": 256 << 20,  # a run log: a line a step
    "predictor": 64 << 20,  # a predictor's JSON (its trees and reach are .npz files beside it)
    "cache entry": 16 << 20,  # an inspection cache entry: one model's spec
    "bundle file": 64 << 20,  # a bundle's JSON, code and text
    "job": 1 << 20,  # a training job file
    "checkpoint metadata": 256 << 20,  # DCP's index of a checkpoint (a pickle: `runtime.train.checkpoint_reader`)
    "checkpoint state": 1 << 20,  # a rank's random-number state in a checkpoint (a few kilobytes)
    "key": 4096,  # a key of the user's (`onboard/user_key.py`): 32 bytes
}
MAX_DEPTH = 64  # JSON nesting: onboard's own files nest a handful of levels


class Refused(InputError):
    """A file the bounded reader will not take; its message is one line, `where: reason`."""

    def __init__(self, where: str, reason: str):
        super().__init__(f"{where}: {reason}")
        self.where, self.reason = where, reason


def read_bytes(path, kind: str, cap: int | None = None) -> bytes:
    """The bytes of `path`, a regular file of at most `cap` bytes (default: its kind's, `CAPS`)."""
    cap = CAPS[kind] if cap is None else cap
    shown = str(path)
    try:
        before = os.stat(path)  # follows links: a loop is ELOOP here
    except OSError as exc:
        raise Refused(shown, f"cannot read the {kind}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(before.st_mode):
        raise Refused(shown, f"the {kind} is not a regular file")
    if before.st_size > cap:
        raise Refused(shown, f"the {kind} is {before.st_size:,} bytes, over the {cap:,} a {kind} may hold")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise Refused(shown, f"cannot read the {kind}: {exc.strerror or exc}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced between the check and the open
            raise Refused(shown, f"the {kind} is not a regular file")
        chunks, size = [], 0
        while size <= cap:
            chunk = os.read(fd, min(1 << 20, cap + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise Refused(shown, f"cannot read the {kind}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if size > cap:  # it grew while it was read
        raise Refused(shown, f"the {kind} is over the {cap:,} bytes a {kind} may hold")
    return b"".join(chunks)


def read_text(path, kind: str, cap: int | None = None, errors: str = "strict") -> str:
    """`read_bytes` as UTF-8 text (`errors="replace"` where a torn line may spoil only itself)."""
    data = read_bytes(path, kind, cap)
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError:
        raise Refused(str(path), f"the {kind} is not UTF-8 text") from None


def loads(text: str | bytes, where: str, kind: str = "file"):
    """JSON nested at most MAX_DEPTH deep; `Refused` naming `where` otherwise (or where it is not JSON)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise Refused(where, f"JSON nested deeper than {MAX_DEPTH} levels") from None
    except json.JSONDecodeError as exc:
        line = "" if exc.lineno == 1 else f", line {exc.lineno}"  # a JSON line's error is on its one line
        raise Refused(where, f"not valid JSON ({exc.msg}{line})") from None
    except UnicodeDecodeError:
        raise Refused(where, "not UTF-8 text") from None
    if depth(value) > MAX_DEPTH:
        raise Refused(where, f"JSON nested deeper than {MAX_DEPTH} levels")
    return value


def read_json(path, kind: str, cap: int | None = None):
    """A JSON file, bounded in size and depth."""
    return loads(read_bytes(path, kind, cap), str(path), kind)


def depth(value) -> int:
    """How deep lists and objects nest in a parsed JSON value (a scalar is 0), without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_DEPTH:
            return deepest
        todo.extend((child, level + 1) for child in children)
    return deepest


def is_regular(path) -> bool:
    """Whether `path` is a regular file (following links; False for a loop or a missing file)."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


__all__ = ["CAPS", "MAX_DEPTH", "Refused", "depth", "is_regular", "loads", "read_bytes",
           "read_json", "read_text"]
