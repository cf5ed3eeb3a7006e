"""Checkpoints with `torch.distributed.checkpoint`: model, optimizer, step, data position and RNG.

Each checkpoint is a directory `step-XXXXXXXX`. Every rank writes into a hidden temporary directory;
only when all ranks are done does rank 0 rename it into place, so a run killed at any moment leaves
either a complete checkpoint or none (the debris of an interrupted write is removed by the next save).
The newest `keep` checkpoints are kept. State dicts come from `torch.distributed.checkpoint.state_dict`,
which names optimizer state by parameter name and handles FSDP2-sharded (DTensor) parameters too.

Under expert parallelism every EP rank holds different experts under the same parameter names, which DCP
would take for replicas and store once. In the checkpoint those parameters (and their optimizer state)
therefore carry their global identity: per-module experts their global index, expert stacks the EP slice
they hold (`...experts.gate_up@ep1of2`). Each slice is stored once (FSDP2 shards over the ranks holding
the same experts stay DTensors) and loads back to the rank that owns it. The checkpoint records `ep`, and
a run with another expert-parallel degree is refused rather than handed the wrong experts. It also records
where each MoE layer's experts are (`runtime.moe.placement`, after rebalancing): a resume lays the experts out
that way before it reads the rows back.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import stat
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from runtime import bounded
from runtime.bounded import Refused
from runtime.errors import InputError
from runtime.train.checkpoint_reader import Planner, Reader, Unsafe, read_metadata

_NAME = re.compile(r"step-(\d{8})")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def checkpoints(directory) -> list[tuple[int, Path]]:
    """Complete checkpoints in `directory`, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.fullmatch(p.name)) and p.is_dir()]
    return sorted(found)


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _expert_shards(model: torch.nn.Module) -> dict[str, tuple[int, int, int]]:
    """State-dict key prefix of each expert-parallel experts module -> (EP rank, EP size, experts)."""
    return {f"{name}." if name else "": m.expert_shard for name, m in model.named_modules()
            if getattr(m, "expert_shard", None) is not None}


def _ep(shards: dict[str, tuple[int, int, int]]) -> int:
    return max((size for _, size, _ in shards.values()), default=1)


def _global_key(key: str, shards: dict[str, tuple[int, int, int]]) -> str:
    """The checkpoint name of a state-dict key: expert keys made unique across EP ranks."""
    for prefix, (rank, size, total) in shards.items():
        if key.startswith(prefix):
            parts = key[len(prefix):].split(".")
            if parts[0] == "experts" and len(parts) > 2 and parts[1].isdigit():  # one module per expert
                return prefix + ".".join(["experts", str(rank * (total // size) + int(parts[1])), *parts[2:]])
            return f"{key}@ep{rank}of{size}"
    return key


def _placements(model: torch.nn.Module) -> dict[str, dict]:
    """MoE layer path -> its expert placement, for the layers whose experts are not where the static layout
    puts them (moved, or with replica rows)."""
    from runtime.model_tree import moe_blocks

    return {name: block.expert_parallel.placement.to_dict() for name, block in moe_blocks(model)
            if block.expert_parallel is not None and block.expert_parallel.remap is not None}


def _restore_placements(model: torch.nn.Module, saved: dict[str, dict], path: Path) -> None:
    """Route each MoE layer as the checkpoint's placement says (its rows are about to be read back)."""
    from runtime.model_tree import moe_blocks
    from runtime.moe.placement import Placement

    here = {name: block.expert_parallel for name, block in moe_blocks(model) if block.expert_parallel is not None}
    spare = {name: ep.placement.spare for name, ep in here.items()}
    for name, ep in here.items():
        placement = Placement.from_dict(saved[name]) if name in saved else \
            Placement.contiguous(ep.num_experts, ep.size, spare[name])
        if placement.spare != spare[name]:
            raise ValueError(f"checkpoint {path} was saved with {placement.spare} replica rows per rank for hot "
                             f"experts and this run has {spare[name]}: resume with the same --expert-replicas")
        ep.place(placement)


def _pp(model: torch.nn.Module) -> int:
    from runtime.parallel.pipeline import stage_of

    stage = stage_of(model)
    return 1 if stage is None else stage.num_stages


def _groups_key(model: torch.nn.Module) -> str:
    """Where the optimizer's param_groups go: one entry, or one per pipeline stage (each stage's groups list its
    own parameters, and DCP would keep one rank's copy of an entry every rank writes)."""
    from runtime.parallel.pipeline import stage_of

    stage = stage_of(model)
    return "param_groups" if stage is None else f"param_groups@stage{stage.index}of{stage.num_stages}"


def _canonical(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter name -> the first, in sorted order, of the names the same tensor goes by. A runtime block
    can hold the model's tensor under a second name (the MoE router's weight), and torch names optimizer state
    by whichever name a set yields first, which differs from process to process: a checkpoint names it by this
    one, so a resumed run finds it."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {name: min(group) for group in names.values() for name in group}


def _checkpoint_view(model_state: dict, optim_state: dict, shards: dict, groups: str,
                     canonical: dict[str, str]) -> tuple[dict, dict]:
    """The state dicts under checkpoint names (the same tensors): optimizer state under each parameter's
    canonical name, expert keys made unique across EP ranks (param_groups keep local names, the same on every
    rank of a stage), param_groups under `groups`."""
    optim = {k: v for k, v in optim_state.items() if k != "param_groups"}
    optim[groups] = optim_state["param_groups"]
    optim["state"] = {_global_key(canonical.get(k, k), shards): v for k, v in optim_state["state"].items()}
    if not shards:
        return model_state, optim
    return {_global_key(k, shards): v for k, v in model_state.items()}, optim


def _local_view(model_state: dict, optim_state: dict, view: tuple[dict, dict], shards: dict,
                groups: str, canonical: dict[str, str]) -> tuple[dict, dict]:
    """`view` (as `_checkpoint_view` named it, now loaded) back under the model's own names; param_groups
    keep this run's own parameter names with the loaded settings."""
    model_view, optim_view = view
    optim = {k: v for k, v in optim_view.items() if k not in (groups, "state")}
    optim["param_groups"] = [{**loaded, "params": here["params"]}
                             for loaded, here in zip(optim_view[groups], optim_state["param_groups"])]
    optim["state"] = {k: optim_view["state"][_global_key(canonical.get(k, k), shards)]
                      for k in optim_state["state"]}
    if not shards:
        return model_view, optim
    return {k: model_view[_global_key(k, shards)] for k in model_state}, optim


def save(directory, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
         data_position: int, keep: int = 2) -> Path:
    """Write checkpoint `step` (every rank calls this); returns its directory."""
    directory = Path(directory)
    final = directory / f"step-{step:08d}"
    tmp = directory / f".step-{step:08d}.tmp"
    if _rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    shards = _expert_shards(model)
    model_state, optim_state = _checkpoint_view(*get_state_dict(model, optimizer), shards, _groups_key(model),
                                                _canonical(model))
    dcp.save({"model": model_state, "optim": optim_state,
              "train": {"step": step, "data_position": data_position, "ep": _ep(shards), "pp": _pp(model),
                        "expert_placement": json.dumps(_placements(model), sort_keys=True)}},
             checkpoint_id=str(tmp))
    torch.save(_rng_state(), tmp / f"rng-{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        if final.exists():  # the same step saved again (a resumed run that repeats its last step)
            shutil.rmtree(final)
        tmp.rename(final)
        for _, old in checkpoints(directory)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        for debris in directory.glob(".step-*.tmp"):
            shutil.rmtree(debris, ignore_errors=True)
    _barrier()
    return final


def incomplete(path: Path, trust: bool = False) -> str | None:
    """Why a checkpoint directory cannot be loaded (None when it can): DCP's metadata must read, and every
    byte range it names must lie inside a file that is there. A truncated file or an emptied directory is
    found here, before anything is loaded into the model. An index that names code is not incomplete: `Unsafe`
    (an InputError) is raised, unless `trust` (the user's --trust-checkpoint) reads it with torch's reader."""
    try:
        # a pickle: read without running what it names, unless the user vouches for it
        metadata = FileSystemReader(str(path)).read_metadata() if trust else read_metadata(path)
    except Unsafe:
        raise
    except Refused as exc:
        return f"its metadata does not read: {exc.reason}"
    except Exception as exc:  # noqa: BLE001 - (trusted) whatever DCP raises for a garbled .metadata
        return f"its metadata does not read ({type(exc).__name__})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = str(info.relative_path)
        needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file() and not file.is_symlink():
            return f"{name} is missing"
        seen = file.lstat()
        if not stat.S_ISREG(seen.st_mode):  # a link (to another run's weights, a device, a FIFO) is not read
            return f"{name} is not a file of the checkpoint's own"
        if seen.st_size < size:
            return f"{name} is truncated ({seen.st_size} of {size} bytes)"
    return None


def _load(state: dict, path: Path, reader, planner) -> None:
    """dcp.load, its failure one line (DCP raises a CheckpointException, a BaseException, with each rank's
    traceback in its text)."""
    try:
        dcp.load(state, storage_reader=reader(str(path)), planner=planner)
    except CheckpointException as exc:
        first = next((line for line in str(exc).splitlines() if "Error" in line), str(exc).splitlines()[0])
        raise InputError(f"checkpoint {path}: DCP could not load it ({first.strip()[:200]})") from None


def _check_items(path: Path, items: dict, kinds: dict) -> None:
    for name, kind in kinds.items():
        value = items.get(name)
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 0):
            raise InputError(f"checkpoint {path}: its {name} is {type(value).__name__} {str(value)[:40]}, not "
                             f"{'a whole number' if kind is int else 'text'}")


def _rng(file: Path) -> dict:
    """A rank's saved RNG state: a regular file of the checkpoint's own, of bounded size, holding a byte tensor."""
    if file.is_symlink():
        raise InputError(f"{file}: not a file of the checkpoint's own (a link)")
    data = bounded.read_bytes(file, "checkpoint state")
    try:
        saved = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever a damaged file raises
        raise InputError(f"{file}: not a random-number state ({type(exc).__name__})") from None
    states = saved.values() if isinstance(saved, dict) else ()
    if not (isinstance(saved, dict) and "cpu" in saved and all(
            isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1 for t in states)):
        raise InputError(f"{file}: not a random-number state")
    return saved


def _check_tensors(path: Path, metadata: dict, expected: dict) -> None:
    """Refuse a checkpoint whose tensors are not the ones this run holds: DCP copies into the run's tensors and
    would cast an int32 or float64 tensor, or fail deep inside on a shape, where the file is what is wrong."""
    for key, tensor in expected.items():
        saved = metadata.get(key)
        if not isinstance(tensor, torch.Tensor) or saved is None:
            continue  # a missing key is DCP's own error, named there
        dtype, size = getattr(saved, "properties", None), getattr(saved, "size", None)
        if dtype is None or size is None:
            raise ValueError(f"checkpoint {path}: {key} is not a tensor")
        if dtype.dtype != tensor.dtype or tuple(size) != tuple(tensor.shape):
            raise ValueError(f"checkpoint {path}: {key} is {str(dtype.dtype).removeprefix('torch.')} "
                             f"{list(size)}, this run holds {str(tensor.dtype).removeprefix('torch.')} "
                             f"{list(tensor.shape)}")


def newest(directory, trust: bool = False) -> tuple[tuple[int, Path] | None, list[tuple[str, str]]]:
    """The newest complete checkpoint (step, path), or None, and the newer ones passed over, with why (`Unsafe`
    where one's index names code)."""
    skipped = []
    for step, candidate in reversed(checkpoints(directory)):
        why = incomplete(candidate, trust)
        if why is None:
            return (step, candidate), skipped
        skipped.append((str(candidate), why))
    return None, skipped


def load_latest(directory, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                trust: bool = False) -> dict | None:
    """Restore the newest complete checkpoint in place; returns its train state (step, data position, path,
    and `skipped`: newer checkpoints it passed over, with why) or None when there is none. Every rank reads
    the same files and so makes the same choice. Its pickles (DCP's index, the non-tensor items) are read by
    `checkpoint_reader`, or by torch's own readers where the user trusts the checkpoint (`trust`)."""
    found, skipped = newest(directory, trust)
    if found is None:
        return {"step": 0, "data_position": 0, "path": None, "skipped": skipped} if skipped else None
    path = found[1]
    shards = _expert_shards(model)
    layout = {"train": {"ep": 1, "pp": 1, "expert_placement": "{}"}}  # older checkpoints recorded none of these
    reader, planner = (FileSystemReader, DefaultLoadPlanner) if trust else (Reader, Planner)
    _load(layout, path, reader, planner(allow_partial_load=True))
    _check_items(path, layout["train"], {"ep": int, "pp": int, "expert_placement": str})
    for name, kind, here in (("ep", "expert", _ep(shards)), ("pp", "pipeline", _pp(model))):
        if layout["train"][name] != here:
            raise ValueError(f"checkpoint {path} was saved with {kind} parallelism {name}={layout['train'][name]} and "
                             f"this run has {name}={here}: resume with the plan's {name} it was saved with")
    _restore_placements(model, json.loads(layout["train"]["expert_placement"]), path)
    model_state, optim_state = get_state_dict(model, optimizer)  # optimizer state made for every parameter
    groups, canonical = _groups_key(model), _canonical(model)
    model_view, optim_view = _checkpoint_view(model_state, optim_state, shards, groups, canonical)
    # a parameter without optimizer state in the checkpoint had no gradient before it was saved: it gets none
    # here either (its state is not read, and taken away below), as in the run that was not interrupted
    metadata = reader(str(path)).read_metadata().state_dict_metadata
    absent = {k for k in optim_view["state"] if not any(key.startswith(f"optim.state.{k}.") for key in metadata)}
    for key in absent:
        optim_view["state"].pop(key)
    _check_tensors(path, metadata, {**{f"model.{k}": v for k, v in model_view.items()},
                                    **{f"optim.state.{k}.{n}": v for k, s in optim_view["state"].items()
                                       for n, v in s.items()}})
    state = {"model": model_view, "optim": optim_view, "train": {"step": 0, "data_position": 0}}
    _load(state, path, reader, planner())
    _check_items(path, state["train"], {"step": int, "data_position": int})
    for key in absent:
        optim_view["state"][key] = {}
    model_state, optim_state = _local_view(model_state, optim_state, (state["model"], state["optim"]), shards, groups,
                                           canonical)
    stateless = {k for k, v in optim_state["state"].items() if not v}
    optim_state["state"] = {k: v for k, v in optim_state["state"].items() if v}
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    by_name = dict(model.named_parameters(remove_duplicate=False))
    for name in stateless:
        optimizer.state.pop(by_name[name], None)
    rng = path / f"rng-{_rank()}.pt"
    if rng.is_file() or rng.is_symlink():
        saved = _rng(rng)
        torch.set_rng_state(saved["cpu"])
        if "cuda" in saved and torch.cuda.is_available():
            torch.cuda.set_rng_state(saved["cuda"])
    return {**state["train"], "path": path, "skipped": skipped}
