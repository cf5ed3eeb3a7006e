"""Full-scale inspections kept on disk, so that a planner asked about the same model again answers in seconds.

    spec = cached_spec(source)          # the ModelSpec `inspect_source` makes, from the cache when it holds it

An entry is named by the digest of everything the spec is made from: the model's config.json as resolved (and,
for remote code, every Python file beside it), whether remote code was trusted, the code of onboard and of the
runtime that inspection runs (every `.py` file of both packages: a change to any matcher makes new entries), and
the torch and transformers versions. So an entry is never stale: a changed input is another name. What is read
back is checked as any spec file is (`ModelSpec.from_dict`); an entry that does not parse is made again. An entry
carries an HMAC of its spec under a key of the user's (`onboard.user_key`, `$ONBOARD_CACHE_KEY` or
~/.cache/onboard/cache.key): one someone else wrote, or edited (a forged entry with parameter counts x1000 changed a
plan silently), is a miss, and made again.

The cache lives in `$ONBOARD_CACHE_DIR`, else `$XDG_CACHE_HOME/onboard`, else `~/.cache/onboard`, under
`specs/`; `ONBOARD_CACHE_DIR=off` keeps nothing. In-memory configs (the families, tests) are never cached: they
have no file to name them by.

The catalogue's models ship their specs (`catalogue/<slug>/spec.json`, written by `write_catalogue_specs`,
`onboard catalogue --write-specs`), so that even a first plan of one answers in seconds (`catalogue_spec`, read
before anything imports torch or transformers). Such a file records the digest of the model's own files and of
the transformers version it was made with (`model_digest`) and is taken only while they match; that it is what
today's onboard makes is what `tests/onboard/test_spec_cache.py` checks, as `onboard check` does for bundles.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from functools import lru_cache
from pathlib import Path

from onboard.errors import OnboardError
from onboard.inspect.spec import ModelSpec
from onboard.source import ModelSource
from onboard.user_key import user_key
from runtime import bounded

CACHE_ENV = "ONBOARD_CACHE_DIR"
KEY_ENV, KEY_NAME = "ONBOARD_CACHE_KEY", "cache.key"  # the key that seals entries (`onboard.user_key`)


def cache_dir() -> Path | None:
    """Where specs are kept (None: caching is off)."""
    named = os.environ.get(CACHE_ENV)
    if named:
        return None if named.lower() in ("off", "0", "none") else Path(named) / "specs"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "onboard" / "specs"


@lru_cache(maxsize=1)
def code_digest() -> str:
    """sha256 over onboard's and the runtime's Python files (path and bytes, in path order)."""
    import onboard
    import runtime

    h = hashlib.sha256()
    for package in (onboard, runtime):
        root = Path(package.__file__).parent
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root.parent)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def transformers_version() -> str:
    """The installed transformers' version, looked up, not imported."""
    from importlib.metadata import version

    return version("transformers")


def model_digest(folder: Path, name: str) -> str:
    """sha256 of what a model's folder brings to its spec: config.json and the Python beside it (remote code), and
    its name."""
    h = hashlib.sha256(name.encode() + b"\0")
    for path in [folder / "config.json", *sorted(folder.glob("*.py"))]:
        if path.is_file():
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


SHIPPED = "spec.json"  # beside a catalogue model's config.json


def catalogue_spec(ref: str) -> ModelSpec | None:
    """The spec the catalogue ships for `ref` (a catalogue name, as `onboard.source.resolve` reads one), when it
    was made from the same files and transformers version; None otherwise. Reads no model code and imports
    neither torch nor transformers, so that a plan of a catalogue model starts in a second."""
    from onboard.source import CATALOGUE_DIR, catalogue_slug

    if Path(os.path.expanduser(ref)).exists():
        return None  # a directory of that name is what resolve takes
    slug = catalogue_slug(ref)
    path = CATALOGUE_DIR / slug / SHIPPED if slug else None
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if (data.get("model_digest") != model_digest(path.parent, slug)
                or data.get("transformers") != transformers_version()):
            return None  # another model, or read by another transformers: inspected, not taken from here
        return ModelSpec.from_dict(data["spec"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None


def write_catalogue_specs(slugs: list[str] | None = None) -> list[Path]:
    """Inspect each catalogue model (all by default) and write the spec it ships; the paths written."""
    from onboard.inspect.inspection import inspect_source
    from onboard.outputs import write_atomically
    from onboard.source import catalogue_index, resolve

    written = []
    for slug in slugs or list(catalogue_index()):
        source = resolve(slug)
        spec = inspect_source(source)[0]
        text = json.dumps({"model_digest": model_digest(Path(source.path), slug), "spec": spec.to_dict(),
                           "transformers": transformers_version()}, indent=1, sort_keys=True) + "\n"
        try:
            written.append(write_atomically(Path(source.path) / SHIPPED, text))
        except OSError as exc:  # an installed, read-only catalogue: this is a step for a checkout of onboard
            raise OnboardError(f"cannot write {Path(source.path) / SHIPPED}: {exc.strerror or exc}") from None
    return written


def spec_key(source: ModelSource) -> str | None:
    """The entry name of `source`'s spec; None for a source with no file behind it."""
    if source.kind == "config":
        return None
    import torch

    made_from = {"model": model_digest(Path(source.path), source.name), "config": source.raw,
                 "trust_remote_code": source.trust_remote_code, "code": code_digest(), "torch": torch.__version__,
                 "transformers": transformers_version()}
    return hashlib.sha256(json.dumps(made_from, sort_keys=True, default=str).encode()).hexdigest()


def cached_spec(source: ModelSource) -> tuple[ModelSpec, bool]:
    """(`source`'s full-scale spec, whether it came from the cache). Inspects and keeps the result on a miss;
    a cache that cannot be written costs nothing but the next call's time."""
    from onboard.inspect.inspection import inspect_source
    from onboard.outputs import write_atomically

    folder, key = cache_dir(), spec_key(source)
    entry = folder / f"{key}.json" if folder is not None and key is not None else None
    if entry is not None and entry.is_file():
        try:
            opened = unsealed(bounded.read_text(entry, "cache entry"), str(entry))
            if opened is not None:
                return ModelSpec.from_dict(opened), True
        except (OSError, ValueError, RecursionError):
            pass  # made again below
    spec = inspect_source(source)[0]
    if entry is not None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            write_atomically(entry, sealed(spec.to_dict()))
        except OSError:
            pass
    return spec, False


def _seal(body: str) -> str:
    return hmac.new(user_key(KEY_NAME, KEY_ENV), body.encode(), hashlib.sha256).hexdigest()


def sealed(spec: dict) -> str:
    """A cache entry: the spec and an HMAC of it under the user's cache key."""
    body = json.dumps(spec, sort_keys=True)
    return json.dumps({"seal": _seal(body), "spec": spec}, sort_keys=True)


def unsealed(text: str, where: str) -> dict | None:
    """The spec a cache entry holds, or None where its seal is not this user's key's over it (an entry someone
    else wrote or edited is a miss, never a result)."""
    record = bounded.loads(text, where, "cache entry")
    if not isinstance(record, dict) or not isinstance(record.get("seal"), str) or not isinstance(
            record.get("spec"), dict):
        return None
    body = json.dumps(record["spec"], sort_keys=True)
    return record["spec"] if hmac.compare_digest(record["seal"], _seal(body)) else None
