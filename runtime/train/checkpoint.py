"""Checkpoints with `torch.distributed.checkpoint`: model, optimizer, step, data position and RNG.

Each checkpoint is a directory `step-XXXXXXXX`. Every rank writes into a hidden temporary directory;
only when all ranks are done does rank 0 rename it into place, so a run killed at any moment leaves
either a complete checkpoint or none (the debris of an interrupted write is removed by the next save).
The newest `keep` checkpoints are kept. State dicts come from `torch.distributed.checkpoint.state_dict`,
which names optimizer state by parameter name and handles FSDP2-sharded (DTensor) parameters too.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

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
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state,
              "train": {"step": step, "data_position": data_position}}, checkpoint_id=str(tmp))
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


def load_latest(directory, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict | None:
    """Restore the newest complete checkpoint in place; returns its train state (step, data position)
    or None when there is none."""
    found = checkpoints(directory)
    if not found:
        return None
    _, path = found[-1]
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "train": {"step": 0, "data_position": 0}}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng = path / f"rng-{_rank()}.pt"
    if rng.is_file():
        saved = torch.load(rng, weights_only=True)
        torch.set_rng_state(saved["cpu"])
        if "cuda" in saved and torch.cuda.is_available():
            torch.cuda.set_rng_state(saved["cuda"])
    return {**state["train"], "path": path}
