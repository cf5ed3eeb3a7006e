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

import io
import pickle
import re
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

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
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        return f"it holds {type(metadata).__name__}"
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        return "it names no storage"
    for info in storage.values():
        name = str(getattr(info, "relative_path", ""))
        if not FILE_NAME.fullmatch(name) or name in (".", ".."):
            return f"a storage entry names {name[:80]!r}, not a file in the checkpoint's folder"
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0):
            return f"a storage entry of {name} has offset {offset!r} and length {length!r}"
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
