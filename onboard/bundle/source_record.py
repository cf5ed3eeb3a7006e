"""source.json: the model a bundle was made from, as a versioned document.

    {"schema_version": 1, "ref": "qwen3-30b-a3b", "kind": "catalogue", "trust_remote_code": false}

`ref` is what `onboard adapt` was given (a catalogue name, a folder, a hub id), `kind` how it resolved
(`onboard.source.ModelSource.kind`), `trust_remote_code` whether the model's own code ran when it was made: a
record, never consent (`onboard.bundle.files.bundle_source` takes consent from the command line alone). Version
0 is the same fields without schema_version, as bundles held them before: still read, so that a base branch's
bundle is reviewed against a pull request's.
"""

from __future__ import annotations

from dataclasses import dataclass

from onboard import contract
from onboard.errors import OnboardError

FILE = "source.json"
SCHEMA_VERSION = 1
READABLE_VERSIONS = (0, 1)


@dataclass
class SourceRecord(contract.Document):
    ref: str
    kind: str  # how `ref` resolved: catalogue, local, hf-cache, hub
    trust_remote_code: bool = False
    schema_version: int = SCHEMA_VERSION

    @classmethod
    def of(cls, source) -> SourceRecord:
        """The record of a resolved `onboard.source.ModelSource`."""
        return cls(source.ref, source.kind, source.trust_remote_code)

    @classmethod
    def from_dict(cls, data, where: str = FILE) -> SourceRecord:
        record = contract.read(cls, data, where, version=SCHEMA_VERSION, readable=READABLE_VERSIONS)
        if not record.ref:
            raise OnboardError(f"{where}: 'ref' names no model")
        return record
