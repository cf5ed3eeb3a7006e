"""A checkpoint someone hands over is read without running its code (issue 55): DCP's `.metadata` is a pickle and
its non-tensor items are `torch.save` blobs, each able to name any function to call while it loads.
`runtime.train.checkpoint_reader` builds only the classes DCP's index is made of and loads the items as data;
the same files through torch's own readers run the planted code (shown here, so the test can fail)."""

from __future__ import annotations

import io
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex

from runtime.bounded import Refused
from runtime.train.checkpoint import incomplete
from runtime.train.checkpoint_reader import Planner, Reader, Unsafe, read_metadata


class _Planted:
    """Pickles as a call of os.system that leaves a marker file: code a loader runs if it unpickles freely."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _checkpoint(folder: Path) -> dict:
    model = torch.nn.Linear(3, 2)
    state = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
             "train": {"step": 7, "data_position": 11, "expert_placement": "{}"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a single process, no process group: DCP says so)
        dcp.save(state, checkpoint_id=str(folder))
    return state


def test_a_checkpoint_reads_back_through_the_safe_reader(tmp_path):
    saved = _checkpoint(tmp_path / "ck")
    assert set(read_metadata(tmp_path / "ck").state_dict_metadata) >= {"model.weight", "train.step"}
    assert incomplete(tmp_path / "ck") is None
    state = {"model": {k: torch.zeros_like(v) for k, v in saved["model"].items()},
             "train": {"step": 0, "data_position": 0, "expert_placement": ""}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=Reader(str(tmp_path / "ck")), planner=Planner())
    assert all(torch.equal(state["model"][k], v) for k, v in saved["model"].items())
    assert state["train"] == saved["train"]


def test_an_index_that_names_code_is_refused_and_nothing_runs(tmp_path):
    _checkpoint(tmp_path / "ck")
    marker = tmp_path / "ran"
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    with pytest.raises(Unsafe, match="system, which a checkpoint's index does not hold"):
        read_metadata(tmp_path / "ck")
    with pytest.raises(Unsafe, match="--trust-checkpoint"):  # not an incomplete checkpoint to pass over
        incomplete(tmp_path / "ck")
    assert not marker.exists()
    try:
        FileSystemReader(str(tmp_path / "ck")).read_metadata()  # planted: torch's own reader runs it
    except Exception:  # noqa: BLE001 - (and then fails on what the call returned)
        pass
    assert marker.exists()


def test_an_item_that_names_code_loads_as_nothing_but_data(tmp_path):
    marker = tmp_path / "ran"
    blob = io.BytesIO()
    torch.save(_Planted(marker), blob)
    item = type("Item", (), {"dest_index": MetadataIndex("train.step")})()
    planner = Planner()
    planner.set_up_planner({"train.step": 0}, None, True)
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(item, io.BytesIO(blob.getvalue()))
    assert not marker.exists()
    torch_planner = DefaultLoadPlanner()  # planted: DCP's default planner runs it
    torch_planner.set_up_planner({"train.step": 0}, None, True)
    torch_planner.load_bytes(item, io.BytesIO(blob.getvalue()))
    assert marker.exists()


@pytest.mark.parametrize("damage", ["a path out of the folder", "a negative offset", "not an index", "a FIFO",
                                    "an entry that is not DCP's", "a chunk of negative size", "planner data"])
def test_a_damaged_index_is_one_line(tmp_path, damage):
    _checkpoint(tmp_path / "ck")
    index = tmp_path / "ck" / ".metadata"
    metadata = read_metadata(tmp_path / "ck")
    info = next(iter(metadata.storage_data.values()))
    if damage == "a path out of the folder":
        info.relative_path = "../../etc/passwd"
    elif damage == "a negative offset":
        info.offset = -5
    elif damage == "an entry that is not DCP's":
        metadata.state_dict_metadata["model.weight"] = torch.Size([2, 3])
    elif damage == "a chunk of negative size":
        metadata.state_dict_metadata["model.weight"].chunks[0].sizes = torch.Size([-2, 3])
    elif damage == "planner data":
        metadata.planner_data = {"model.weight": 3.5}
    if damage == "not an index":
        index.write_bytes(pickle.dumps({"storage_data": {}}))
    elif damage == "a FIFO":
        index.unlink()
        os.mkfifo(index)
    else:
        index.write_bytes(pickle.dumps(metadata))
    with pytest.raises(Refused) as refused:
        read_metadata(tmp_path / "ck")
    assert "\n" not in str(refused.value) and str(index) in str(refused.value)
    assert incomplete(tmp_path / "ck").startswith("its metadata does not read")
