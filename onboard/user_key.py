"""Keys this installation keeps for itself, readable by the user alone.

    key = user_key("judge.key", "ONBOARD_JUDGE_KEY")    # 32 bytes, made on first use

Two things rest on a secret of the user's: the judge's draws (a candidate cannot predict the cases it is judged
on) and the inspection cache's seals (an entry someone else wrote, or edited, is not taken for one onboard made).
Each key lives in its own file, `$ENV` where set, else `$XDG_CACHE_HOME/onboard/NAME` (`~/.cache/onboard/NAME`),
made on first use with mode 0600 and never replaced. The file is read through the bounded reader (a FIFO or a
device put in its place cannot hold the command); where no file can be kept or read, the key lives for this
process only.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from runtime import bounded

KEY_BYTES = 32


def key_path(name: str, env: str) -> Path:
    return Path(os.environ.get(env) or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                / "onboard" / name)


def _read(path: Path) -> bytes | None:
    try:
        data = bounded.read_bytes(path, "key")
    except bounded.Refused:
        return None
    return data[:KEY_BYTES] if len(data) >= KEY_BYTES else None


def user_key(name: str, env: str) -> bytes:
    """The key in `name` (made on first use); a key for this process only where no file can be kept."""
    path = key_path(name, env)
    kept = _read(path)
    if kept is not None:
        return kept
    key = secrets.token_bytes(KEY_BYTES)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
    except FileExistsError:  # made meanwhile by another process, or a file that is no key: that one, or ours
        return _read(path) or key
    except OSError:
        pass
    return key
