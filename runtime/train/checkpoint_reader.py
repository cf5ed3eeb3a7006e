"""Reading a DCP checkpoint someone else wrote, without running their code.

    metadata = read_metadata(path)                                # what DCP's `.metadata` says, checked
    dcp.load(state, storage_reader=Reader(path), planner=Planner())

A checkpoint folder arrives with a run, a pull request or a colleague's disk. DCP keeps its index in `.metadata`,
a pickle that `FileSystemReader.read_metadata` loads with `pickle.load`, and the non-tensor items (a run's step,
its data position) as `torch.save` blobs that `DefaultLoadPlanner.load_bytes` loads with `weights_only=False`.
Either runs whatever code the file names. Here the index is read from a regular file of bounded size by an
unpickler that builds only the classes DCP's index is made of (`METADATA_CLASSES`, torch's dtypes) and refuses
any other name, so no function of the file's choosing is called; every storage entry must name a file inside the
checkpoint folder (no `..`, no path: DCP joins it to the folder and reads it into the model) at a non-negative
offset. Non-tensor items load with `weights_only=True` (numbers, strings and containers).
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import pickle
import pickletools
import re
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   StorageMeta, TensorProperties, TensorStorageMetadata)

from runtime import bounded

# what DCP's index pickles (read off torch 2.13's own checkpoints), and nothing that runs code when built
METADATA_CLASSES = frozenset({
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # a layout by its name
    ("torch", "Size"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
})
# the class each storage entry is pickled as: private to torch, so taken by the name the index itself names it by
STORAGE_INFO = getattr(importlib.import_module("torch.distributed.checkpoint.filesystem"), "_StorageInfo")
# the only types whose state a pickle may set (BUILD), all dataclasses of DCP's index
_BUILDABLE = frozenset({Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata, TensorProperties,
                        MetadataIndex, StorageMeta, STORAGE_INFO})
FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


class Unsafe(bounded.Refused):
    """An index that names something else than DCP's index classes: code, were it unpickled. Not an incomplete
    checkpoint to pass over: one to refuse (`--trust-checkpoint` reads it with torch's own readers)."""


class _Named(pickle.UnpicklingError):
    pass


# Python's pure-Python unpickler (private to pickle): the only one whose opcode handlers can be replaced, which the
# BUILD rule below needs (the C unpickler sets attributes on whatever BUILD finds on its stack, a class included)
_PurePython = getattr(pickle, "_Unpickler")
LARGEST_INT = 1 << 61
BYTES_ITEM = 1 << 20  # the most a non-tensor item (a step, a position, the expert placement as JSON) may take  # no hash collisions: Python hashes an int by its value modulo 2**61 - 1


class _IndexUnpickler(_PurePython):
    """Builds DCP's index classes and nothing else. A class is found only by its exact name on the list; BUILD
    (setting an object's state) is allowed only on an instance of one of DCP's index dataclasses, with the state
    a dict of its own field names (or TensorProperties' own state tuple): on a class, a path, a function or any
    other object it is refused (held-out attack: BUILD on the PosixPath class set its `_str` for the whole
    process, and every Path onboard made after pointed where the checkpoint chose)."""

    def find_class(self, module: str, name: str):
        if (module, name) in METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Named(f"it names {module}.{name}, which a checkpoint's index does not hold")

    def _build(self):
        state = self.stack.pop()
        inst = self.stack[-1]
        kind = type(inst)
        if kind not in _BUILDABLE:
            raise pickle.UnpicklingError(f"it sets the state of a {kind.__name__}")
        if kind is TensorProperties and isinstance(state, tuple):
            inst.__setstate__(state)
            return
        names = {f.name for f in dataclasses.fields(kind)}
        if not isinstance(state, dict) or not set(state) <= names:
            raise pickle.UnpicklingError(f"it sets a {kind.__name__} to what it does not hold")
        for key, value in state.items():
            object.__setattr__(inst, key, value)

    dispatch = dict(_PurePython.dispatch)
    dispatch[pickle.BUILD[0]] = _build


def _scan(raw: bytes) -> str:
    """What in the opcodes (read, not run) is out of bounds: "" or why."""
    try:
        for opcode, argument, _position in pickletools.genops(raw):
            if isinstance(argument, int) and not isinstance(argument, bool) and abs(argument) >= LARGEST_INT:
                return f"it holds the number {str(argument)[:40]}..., past any size or offset"
    except (ValueError, EOFError) as exc:  # not a pickle
        return f"{type(exc).__name__}: {str(exc)[:100]}"
    return ""


def read_metadata(path, name: str = ".metadata") -> Metadata:
    """The checkpoint folder `path`'s index, read without running code and checked (`bounded.Refused`, an
    `InputError`, otherwise)."""
    file = Path(path) / name
    raw = bounded.read_bytes(file, "checkpoint metadata")
    scanned = _scan(raw)
    if scanned:
        raise bounded.Refused(str(file), f"not a checkpoint's index ({scanned})")
    try:
        metadata = _IndexUnpickler(io.BytesIO(raw)).load()
    except _Named as exc:
        raise Unsafe(str(file), f"not loaded: {exc}; a checkpoint you wrote yourself loads with "
                                f"--trust-checkpoint") from None
    except Exception as exc:  # noqa: BLE001 - whatever a damaged or hostile pickle raises
        raise bounded.Refused(str(file), f"not a checkpoint's index ({type(exc).__name__}: {str(exc)[:200]})") from None
    why = _problem(metadata)
    if why:
        raise bounded.Refused(str(file), f"not a checkpoint's index ({why})")
    return metadata


def _problem(metadata) -> str:
    """What in a loaded index is not what DCP writes ("" when nothing): only DCP's own types, at DCP's places, so
    that nothing DCP does with it next fails deep inside (a traceback) or reads outside the folder."""
    if not isinstance(metadata, Metadata):
        return f"it holds {type(metadata).__name__}"
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict) or not all(isinstance(k, str) for k in entries):
        return "its entries are not named by text"
    for key, entry in entries.items():
        why = "" if isinstance(entry, BytesStorageMetadata) else _tensor_problem(entry)
        if why:
            return f"{key[:80]}: {why}"
    meta = metadata.storage_meta
    if meta is not None and not (isinstance(meta, StorageMeta) and all(
            v is None or isinstance(v, str) for v in (meta.save_id, meta.load_id))
            and isinstance(meta.modules, list)):
        return "its storage record is not DCP's"
    if not (metadata.version is None or isinstance(metadata.version, str)):
        return "its version is not text"
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        return "it names no storage"
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, STORAGE_INFO):
            return "a storage entry is not DCP's"
        if not (isinstance(index.fqn, str) and index.fqn in entries and (index.offset is None or _size(index.offset))
                and (index.index is None or _whole(index.index))):
            return f"a storage entry names {str(index.fqn)[:80]!r}, which the index does not hold"
        if isinstance(entries[index.fqn], BytesStorageMetadata) and isinstance(info.length, int) \
                and info.length > BYTES_ITEM:
            return f"the item {index.fqn[:80]} is {info.length:,} bytes (a step or a position takes a few)"
        name = info.relative_path
        if not isinstance(name, str) or not FILE_NAME.fullmatch(name):
            return f"a storage entry names {str(name)[:80]!r}, not a file in the checkpoint's folder"
        if not all(_whole(v) for v in (info.offset, info.length)):
            return f"a storage entry of {name} has offset {info.offset!r} and length {info.length!r}"
        if info.transform_descriptors:  # (compression: a few kilobytes that inflate to gigabytes; onboard writes none)
            return f"a storage entry of {name} is transformed ({str(info.transform_descriptors)[:60]})"
    planner = metadata.planner_data
    if planner is not None and not (isinstance(planner, dict) and all(
            isinstance(k, str) and isinstance(v, (list, tuple)) and all(isinstance(p, (str, int)) for p in v)
            for k, v in planner.items())):
        return "its planner data is not paths of names"
    return ""


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _size(value) -> bool:
    return isinstance(value, torch.Size) and all(_whole(v) for v in value)


def _tensor_problem(entry) -> str:
    if not isinstance(entry, TensorStorageMetadata):
        return f"an entry of type {type(entry).__name__}"
    properties = entry.properties
    if not isinstance(properties, TensorProperties) or not isinstance(properties.dtype, torch.dtype):
        return "a tensor without a dtype"
    if not _size(entry.size) or not isinstance(entry.chunks, list):
        return "a tensor without a size"
    if not entry.chunks and entry.size.numel():
        return "a tensor with no data"
    for chunk in entry.chunks:
        if not (isinstance(chunk, ChunkStorageMetadata) and _size(chunk.offsets) and _size(chunk.sizes)
                and len(chunk.offsets) == len(chunk.sizes) == len(entry.size)
                and all(o + n <= whole for o, n, whole in zip(chunk.offsets, chunk.sizes, entry.size))):
            return "a chunk that is not a part of its tensor"
    return ""


class Reader(FileSystemReader):
    """DCP's file-system reader with its index read by `read_metadata`."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        metadata = read_metadata(self.path, ".metadata" if rank is None else f"__{rank}.metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class Planner(DefaultLoadPlanner):
    """DCP's default load planner, its non-tensor items loaded as data only (`weights_only=True`)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
