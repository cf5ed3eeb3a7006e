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

import importlib
import io
import pickle
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
FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


class Unsafe(bounded.Refused):
    """An index that names something else than DCP's index classes: code, were it unpickled. Not an incomplete
    checkpoint to pass over: one to refuse (`--trust-checkpoint` reads it with torch's own readers)."""


class _Named(pickle.UnpicklingError):
    pass


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Named(f"it names {module}.{name}, which a checkpoint's index does not hold")


def read_metadata(path, name: str = ".metadata") -> Metadata:
    """The checkpoint folder `path`'s index, read without running code and checked (`bounded.Refused`, an
    `InputError`, otherwise)."""
    file = Path(path) / name
    raw = bounded.read_bytes(file, "checkpoint metadata")
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
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        return "it names no storage"
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, STORAGE_INFO):
            return "a storage entry is not DCP's"
        name = info.relative_path
        if not isinstance(name, str) or not FILE_NAME.fullmatch(name):
            return f"a storage entry names {str(name)[:80]!r}, not a file in the checkpoint's folder"
        if not all(_whole(v) for v in (info.offset, info.length)):
            return f"a storage entry of {name} has offset {info.offset!r} and length {info.length!r}"
        transforms = info.transform_descriptors
        if transforms is not None and not (isinstance(transforms, (list, tuple))
                                           and all(isinstance(t, str) for t in transforms)):
            return f"a storage entry of {name} has transforms that are not names"
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
    for chunk in entry.chunks:
        if not (isinstance(chunk, ChunkStorageMetadata) and _size(chunk.offsets) and _size(chunk.sizes)
                and len(chunk.offsets) == len(chunk.sizes) == len(entry.size)):
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
