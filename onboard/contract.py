"""A contract's JSON read back into its dataclass, field by field, by the fields' annotations.

    record = read(Verification, data, "bundles/x/verification.json", version=1, readable=(0, 1))
    data = load(path)              # a file's JSON value, or one line saying why there is none
    record.to_json()               # a Document's JSON, as every contract writes it (indented, keys sorted)

Contracts arrive in pull requests, so nothing is taken on trust: a document that is not an object, lacks a field
without a default, holds a field the dataclass does not have, or holds a value of another type is refused with
one line (OnboardError) naming the file and the field, e.g. `.../verification.json: 'seeds'[1]: 'kl' must be a
number, not str`. Numbers are kept as written (an int where a float is declared stays an int), so a document read
and written again is the same document.

A document without `schema_version` was written before its contract had one: it reads as version 0 where the
contract still reads those (`readable`), and is refused otherwise, as is any version not in `readable`.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path

from onboard.errors import OnboardError
from runtime import bounded


class Document:
    """A contract's dataclass: written as indented JSON with sorted keys, ending in a newline."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"


def load(path: Path):
    """The JSON value of the file `path` (a regular file of at most a bundle file's size, `runtime.bounded`); one
    line naming it when it is not that, or not JSON."""
    try:
        text = bounded.read_text(path, "bundle file")
    except bounded.Refused as exc:
        raise OnboardError(str(exc)) from None
    try:
        return json.loads(text)
    except (ValueError, UnicodeDecodeError):
        raise OnboardError(f"{path}: not JSON") from None
    except RecursionError:
        raise OnboardError(f"{path}: nested too deeply to be a bundle's") from None


def read(cls: type, data, where: str, *, version: int, readable: tuple[int, ...] = ()):
    """`cls` (a dataclass with a `schema_version` field) from the JSON value `data` of the file `where`."""
    if not isinstance(data, dict):
        raise OnboardError(f"{where} must be a JSON object")
    found = data.get("schema_version", 0)
    if found not in (*readable, version) or isinstance(found, bool):
        raise OnboardError(f"{where}: schema_version {found!r} is not {version} (written by another onboard: "
                           f"make it again)")
    return build(cls, {**data, "schema_version": found}, where)


def build(cls: type, data, where: str):
    """`cls` (a dataclass) from the JSON object `data`; one line naming `where` and the field when it does not fit."""
    if not isinstance(data, dict):
        raise OnboardError(f"{where} must be a JSON object")
    fields = dataclasses.fields(cls)
    unknown = sorted(set(data) - {f.name for f in fields})
    if unknown:
        raise OnboardError(f"{where}: '{unknown[0]}' is not a field of {cls.__name__}")
    hints = typing.get_type_hints(cls)
    values = {}
    for f in fields:
        if f.name in data:
            values[f.name] = _value(hints[f.name], data[f.name], f"{where}: '{f.name}'")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise OnboardError(f"{where}: no '{f.name}'")
    return cls(**values)


_NAMES = {bool: "true or false", int: "a whole number", float: "a number", str: "text", dict: "an object",
          list: "a list"}


def _value(kind, value, where: str):
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (kind,) = [a for a in args if a is not type(None)]
        return _value(kind, value, where)
    if dataclasses.is_dataclass(kind):
        return build(kind, value, where)
    if origin is list:
        _check(list, value, where)
        return [_value(args[0], item, f"{where}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        _check(dict, value, where)
        return {k: _value(args[1], v, f"{where}: '{k}'") for k, v in value.items()}
    _check(kind, value, where)
    return value


def _check(kind: type, value, where: str) -> None:
    if kind is float:
        fits = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind is int:
        fits = isinstance(value, int) and not isinstance(value, bool)
    elif kind in _NAMES:
        fits = isinstance(value, kind)
    else:
        raise TypeError(f"a contract field of type {kind!r} is not read by onboard.contract")
    if not fits:
        raise OnboardError(f"{where} must be {_NAMES[kind]}, not {_json_name(value)}")


def _json_name(value) -> str:
    if value is None:
        return "null"
    return next((name for kind, name in _NAMES.items() if isinstance(value, kind)), type(value).__name__)
