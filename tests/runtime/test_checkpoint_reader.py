"""A checkpoint someone hands over is read without running its code (issue 55): DCP's `.metadata` is a pickle and
its non-tensor items are `torch.save` blobs, each able to name any function to call while it loads.
`runtime.train.checkpoint_reader` builds only the classes DCP's index is made of and loads the items as data;
the same files through torch's own readers run the planted code (shown here, so the test can fail)."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
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


def test_an_index_cannot_set_the_state_of_a_class_it_may_name(tmp_path):
    """Held-out attack: pickle's BUILD on the PosixPath class (a name the index may hold) set its `_str` for the
    whole process, and every Path onboard made afterwards pointed where the checkpoint chose (train made the
    attacker's folder and wrote into it). BUILD now sets state only on an instance of DCP's index classes."""
    _checkpoint(tmp_path / "ck")
    index = tmp_path / "ck" / ".metadata"
    raw = index.read_bytes()
    planted = b"cpathlib\nPosixPath\nN}V_str\nV" + str(tmp_path / "chosen").encode() + b"\ns\x86b0"
    index.write_bytes(raw[:2] + planted + raw[2:])  # after PROTO
    with pytest.raises(Refused, match="sets the state of a type"):
        read_metadata(tmp_path / "ck")
    assert str(Path("/tmp/anything")) == "/tmp/anything"
    # planted, in a process of its own (it would poison this one): Python's own unpickler sets it
    script = "import pathlib, pickle, sys\npickle.load(open(sys.argv[1], 'rb'))\nprint(pathlib.Path('/tmp/anything'))"
    alone = tmp_path / "planted.pkl"
    alone.write_bytes(raw[:2] + planted + b"N.")  # the planted part alone (no torch to import in a poisoned process)
    done = subprocess.run([sys.executable, "-c", script, str(alone)], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == str(tmp_path / "chosen"), done.stderr[-500:]


def test_an_index_of_colliding_numbers_is_refused_unread(tmp_path):
    """Held-out attack: storage entries whose offsets all hash alike (multiples of 2**61 - 1) made building the
    index quadratic (hours within the size cap). Numbers past 2**61 are refused before anything is built."""
    _checkpoint(tmp_path / "ck")
    metadata = read_metadata(tmp_path / "ck")
    index, info = next(iter(metadata.storage_data.items()))
    metadata.storage_data = {MetadataIndex(index.fqn, torch.Size([k * (2 ** 61 - 1)])): info for k in range(1, 50)}
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(Refused, match="past any size or offset"):
        read_metadata(tmp_path / "ck")


def test_a_data_file_linked_from_elsewhere_is_not_read(tmp_path):
    """Held-out attack: a `.distcp` linked to another run's checkpoint loaded that run's weights into this one
    (DCP opens the folder's name, and a link is followed). A file that is not the folder's own is incomplete."""
    _checkpoint(tmp_path / "ck")
    other = _checkpoint(tmp_path / "other")
    data = next((tmp_path / "ck").glob("*.distcp"))
    data.unlink()
    data.symlink_to(next((tmp_path / "other").glob("*.distcp")))
    assert incomplete(tmp_path / "ck") == f"{data.name} is not a file of the checkpoint's own"
    assert other


@pytest.mark.parametrize("damage", ["a transform", "an item of a gigabyte", "a chunk past its tensor",
                                    "a storage record that is a dtype"])
def test_what_dcp_would_fail_on_deep_inside_is_refused_first(tmp_path, damage):
    """Held-out attacks: each of these passed the reader and then failed inside DCP (a CheckpointException, its
    traceback in the line, exit 70), inflated a few kilobytes to gigabytes (a zstd transform), or loaded nothing
    and kept the tensor as it was (a chunk outside its tensor)."""
    _checkpoint(tmp_path / "ck")
    metadata = read_metadata(tmp_path / "ck")
    if damage == "a transform":
        next(iter(metadata.storage_data.values())).transform_descriptors = ["stream.zstd/1"]
    elif damage == "an item of a gigabyte":
        index = next(i for i in metadata.storage_data if i.fqn == "train.step")
        metadata.storage_data[index].length = 1 << 30
    elif damage == "a chunk past its tensor":
        metadata.state_dict_metadata["model.weight"].chunks[0].offsets = torch.Size([5, 0])
    else:
        metadata.storage_meta = torch.float32
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(Refused) as refused:
        read_metadata(tmp_path / "ck")
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("damage", ["a list", "a float tensor", "a link"])
def test_a_random_number_state_that_is_not_one_is_one_line(tmp_path, damage):
    """Held-out attack: rng-0.pt holding [1, 2], or a float tensor, stopped a resume with a TypeError (exit 70)."""
    from runtime.errors import InputError
    from runtime.train import checkpoint

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saved = checkpoint.save(tmp_path / "ck", 1, model, optimizer, data_position=0)
        assert checkpoint.load_latest(tmp_path / "ck", model, optimizer)["step"] == 1
        rng = saved / "rng-0.pt"
        if damage == "a list":
            torch.save([1, 2], rng)
        elif damage == "a float tensor":
            torch.save({"cpu": torch.ones(8)}, rng)
        else:
            torch.save({"cpu": torch.get_rng_state()}, tmp_path / "elsewhere.pt")
            rng.unlink()
            rng.symlink_to(tmp_path / "elsewhere.pt")
        with pytest.raises(InputError) as refused:
            checkpoint.load_latest(tmp_path / "ck", model, optimizer)
    assert "rng-0.pt" in str(refused.value) and "\n" not in str(refused.value)
