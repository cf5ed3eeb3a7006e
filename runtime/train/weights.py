"""Released weights into a built, adapted and parallelised model, each rank keeping only what it owns.

    layout = HFLayout.of(model)          # on the model as transformers built it (meta device), before any swap
    ... adapt(model); names = layout.names(model)         # adapted key -> transformers' key, by tensor identity
    ... parallelize(model, plan, mesh); model.to_empty(device=...)
    load_weights(model, ReleasedWeights(directory), layout, names)

The checkpoint is a model directory's `*.safetensors` shards, with `model.safetensors.index.json` or without.
Keys are converted as `from_pretrained` converts them for the installed transformers
(`transformers.conversion_mapping`: renamings, per-expert tensors merged into stacks, fused projections split):
checkpoint keys are grouped by the model tensor they make, groups are read and converted one at a time, and each
rank copies its part of each (its expert-parallel rows, its FSDP2 shard; `runtime.parallel.state.LocalCopier`)
and lets the rest go. No process holds more than its own shards plus one group (the largest: one layer's expert
stack). The runtime's swaps hold transformers' own parameters (same tensor objects, under other names), which is
how an adapted key finds its checkpoint key.

A checkpoint that does not fit the model (keys missing or unexpected, shapes that differ) is a ValueError naming
the first few, raised before any tensor is read; so is a shard that is missing or not a safetensors file.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

INDEX = "model.safetensors.index.json"


class ReleasedWeights:
    """The tensors of a model directory's safetensors shards, read lazily, by key."""

    def __init__(self, directory: str | Path):
        from safetensors import safe_open

        self.directory = Path(directory)
        index = self.directory / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{index}: not a safetensors index ({exc})") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.directory.glob("*.safetensors"))
            weight_map = None
        if not files:
            raise ValueError(f"{self.directory}: no *.safetensors weights")
        self.files = files
        self._open: dict[str, object] = {}  # handles of the group being read (`release` closes them)
        self.file_of: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name in files:
            path = self.directory / name
            if not path.is_file():
                raise ValueError(f"{path}: missing (named in {INDEX})")
            try:
                with safe_open(str(path), framework="pt") as handle:
                    for key in handle.keys():
                        self.file_of.setdefault(key, name)
                        self.shapes.setdefault(key, tuple(handle.get_slice(key).get_shape()))
            except Exception as exc:  # noqa: BLE001 - safetensors' own errors name the problem
                raise ValueError(f"{path}: not a readable safetensors file ({' '.join(str(exc).split())[:120]})") \
                    from None
        if weight_map is not None:
            absent = sorted(k for k, f in weight_map.items() if self.file_of.get(k) != f)
            if absent:
                raise ValueError(f"{self.directory}: {len(absent)} tensor(s) the index names are not in their files "
                                 f"(first: {absent[0]} in {weight_map[absent[0]]})")

    def keys(self) -> list[str]:
        return list(self.file_of)

    def get(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor at `key`, or only its rows [start, stop) of dim 0 (read alone from the file)."""
        from safetensors import safe_open

        name = self.file_of[key]
        if name not in self._open:
            self._open[name] = safe_open(str(self.directory / name), framework="pt")
        if rows is None:
            return self._open[name].get_tensor(key)
        return self._open[name].get_slice(key)[rows[0]:rows[1]]

    def shape(self, key: str) -> tuple[int, ...]:
        """From the file's header: nothing is read."""
        return self.shapes[key]

    def release(self) -> None:
        """Close the files read so far: their memory maps count in the process's resident memory as long as
        they stay open, pages read included, which would add up to the whole checkpoint."""
        self._open.clear()

    def nbytes(self) -> int:
        return sum((self.directory / name).stat().st_size for name in self.files)


@dataclass
class HFLayout:
    """What loading needs to know of the model as transformers built it (before the runtime's swaps)."""
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]  # transformers' state-dict key -> (shape, dtype)
    identities: dict[int, str]  # id of each parameter / buffer -> its transformers key
    renamings: list = field(default_factory=list)
    converters: list = field(default_factory=list)
    base_model_prefix: str = ""
    tied: set[str] = field(default_factory=set)  # keys that share their tensor with another key

    @classmethod
    def of(cls, model: nn.Module) -> HFLayout:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        state = model.state_dict(keep_vars=True)
        identities, tied = {}, set()
        for key, tensor in state.items():
            if id(tensor) in identities:
                tied.add(key)
            else:
                identities[id(tensor)] = key
        mapping = get_model_conversion_mapping(model)
        return cls({k: (tuple(t.shape), t.dtype) for k, t in state.items()}, identities,
                   [m for m in mapping if isinstance(m, WeightRenaming) and not isinstance(m, WeightConverter)],
                   [m for m in mapping if isinstance(m, WeightConverter)],
                   getattr(model, "base_model_prefix", "") or "", tied)

    def names(self, model: nn.Module) -> dict[str, str]:
        """{key in `model` (adapted): transformers' key of the same tensor}; keys of tensors the swaps made
        themselves are left out."""
        return {key: self.identities[id(t)] for key, t in model.state_dict(keep_vars=True).items()
                if id(t) in self.identities}


def _natural(key: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key)]


@dataclass
class _Group:
    target: str  # transformers' key of the first tensor the group makes
    converter: object | None  # a WeightConverter (a fresh copy) or None: one tensor, renamed
    sources: list[tuple[str | None, str]] = field(default_factory=list)  # (converter source pattern, checkpoint key)


def _groups(checkpoint: ReleasedWeights, layout: HFLayout) -> tuple[list[_Group], list[str]]:
    """Shard keys grouped by the model tensor they make (as `from_pretrained` groups them), and the keys
    that make none."""
    import copy

    from transformers.core_model_loading import rename_source_key

    meta = {k: True for k in layout.shapes}
    by_pattern = {p: c for c in layout.converters for p in c.source_patterns}
    groups: dict[str, _Group] = {}
    unexpected = []
    for key in sorted(checkpoint.keys(), key=_natural):
        target, pattern = rename_source_key(key, layout.renamings, layout.converters, layout.base_model_prefix, meta)
        if target not in meta and key in meta:
            target, pattern = key, None
        if target not in meta:
            unexpected.append(key)
            continue
        group = groups.setdefault(target, _Group(target, copy.deepcopy(by_pattern[pattern]) if pattern else None))
        group.sources.append((pattern, key))
    return list(groups.values()), unexpected


def _convert(group: _Group, checkpoint: ReleasedWeights, model: nn.Module,
             experts: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """The model tensors a group makes; `experts` (first, count): of per-expert sources merged into a stack, only
    those experts are read (the stack made holds them alone)."""
    if group.converter is None:
        return {group.target: checkpoint.get(group.sources[0][1])}
    converter = group.converter
    sources = group.sources
    if experts is not None:
        lo, n = experts
        sources = [(pattern, key) for pattern, key in sources if lo <= _expert_index(pattern, key) < lo + n]
    for pattern, key in sources:
        converter.add_tensor(group.target, key, pattern, checkpoint.get(key))
    made = converter.convert(group.target, model=model, config=getattr(model, "config", None))
    return {k: (v[0] if isinstance(v, list) else v) for k, v in made.items()}


def load_weights(model: nn.Module, checkpoint: ReleasedWeights, layout: HFLayout, names: dict[str, str],
                 dtype: torch.dtype | None = None, groups: list[_Group] | None = None) -> dict:
    """Copy the checkpoint into `model` (adapted, parallelised, its tensors allocated), this rank's part of
    each tensor only (module docstring). `dtype` casts floating tensors (default: the model's own). Collective
    under torch.distributed only in that every rank must call it; it sends nothing. Returns what was loaded:
    {"tensors": n, "bytes": checkpoint size, "largest_group_bytes": n}."""
    from runtime.parallel.state import LocalCopier

    groups = fitted_groups(checkpoint, layout) if groups is None else groups  # given: checked already
    by_hf: dict[str, list[str]] = {}
    for key, hf in names.items():
        by_hf.setdefault(hf, []).append(key)
    copier = LocalCopier(model)
    largest, count = 0, 0
    for group in groups:
        keys = by_hf.get(group.target, [])
        rows = copier.rows(keys[0], layout.shapes[group.target][0][0]) if group.converter is None and len(keys) == 1 \
            and copier.expert_rows(keys[0]) is None and layout.shapes[group.target][0] else None
        if rows is not None:  # one tensor taken as it is: this rank reads its own rows of it only
            tensor = checkpoint.get(group.sources[0][1], rows)
            largest = max(largest, tensor.numel() * tensor.element_size())
            copier.copy_rows(keys[0], tensor if not tensor.is_floating_point()
                             else tensor.to(dtype or layout.shapes[group.target][1]))
            count += 1
            checkpoint.release()
            continue
        experts = _local_experts(group, by_hf, copier)
        tensors = _convert(group, checkpoint, model, experts)
        largest = max(largest, sum(t.numel() * t.element_size() for t in tensors.values()))
        for hf_key, tensor in tensors.items():
            if hf_key not in layout.shapes:
                raise ValueError(f"{checkpoint.directory}: {group.sources[0][1]} makes {hf_key}, which the model "
                                 f"does not have")
            shape, own_dtype = layout.shapes[hf_key]
            expected = (experts[1], *shape[1:]) if experts else shape
            if tuple(tensor.shape) != expected:
                raise ValueError(f"{checkpoint.directory}: {hf_key} has shape {tuple(tensor.shape)} in the "
                                 f"checkpoint and {expected} in the model")
            if tensor.is_floating_point():
                tensor = tensor.to(dtype or own_dtype)
            copier.copy({key: tensor for key in by_hf.get(hf_key, ())}, expert_local=experts is not None)
            count += 1
        del tensors
        checkpoint.release()
    return {"tensors": count, "bytes": checkpoint.nbytes(), "largest_group_bytes": largest}


def _expert_index(pattern: str, key: str) -> int:
    """The expert number a per-expert source key holds where its pattern has `*` (`.experts.*.w1.weight`)."""
    found = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
    return int(found.group(1)) if found else -1


def _local_experts(group: _Group, by_hf: dict[str, list[str]], copier) -> tuple[int, int] | None:
    """(first, count) of the experts this rank holds when the group merges per-expert tensors into expert
    stacks the rank holds a slice of (so only those are read); None otherwise."""
    from transformers.core_model_loading import MergeModulelist

    converter = group.converter
    if converter is None or not converter.operations or not isinstance(converter.operations[0], MergeModulelist) \
            or converter.operations[0].dim != 0 or not all("*" in p for p in converter.source_patterns):
        return None
    targets = [group.target.replace(converter.target_patterns[0], t) for t in converter.target_patterns]
    slices = {copier.expert_rows(key) for target in targets for key in by_hf.get(target, [])}
    if len(slices) != 1 or None in slices:
        return None
    return slices.pop()


def fitted_groups(checkpoint: ReleasedWeights, layout: HFLayout) -> list[_Group]:
    """The checkpoint's groups, once it is known to fit the model: every model tensor made, every checkpoint
    tensor used, and the shapes of tensors taken as they are equal (from the headers; converted tensors are
    checked as they are made). ValueError naming the first few misfits otherwise."""
    groups, unexpected = _groups(checkpoint, layout)
    made = {g.target for g in groups}
    missing = sorted(k for k in layout.shapes if k not in made and k not in layout.tied and not _also_made(k, groups))
    shapes = [f"{g.target} {checkpoint.shape(g.sources[0][1])} in the checkpoint, {layout.shapes[g.target][0]} in "
              f"the model" for g in groups if g.converter is None
              and checkpoint.shape(g.sources[0][1]) != layout.shapes[g.target][0]]
    parts = [f"{len(missing)} model tensor(s) missing (first: {', '.join(missing[:3])})" if missing else "",
             f"{len(unexpected)} checkpoint tensor(s) the model has no place for (first: {', '.join(unexpected[:3])})"
             if unexpected else "",
             f"{len(shapes)} shape(s) differ (first: {'; '.join(shapes[:2])})" if shapes else ""]
    if any(parts):
        raise ValueError(f"{checkpoint.directory} does not fit the model: " + "; ".join(p for p in parts if p))
    return groups


def _also_made(key: str, groups: list[_Group]) -> bool:
    """Whether a group makes `key` besides its first target (a fused tensor split in several)."""
    for group in groups:
        converter = group.converter
        if converter is None or len(converter.target_patterns) < 2:
            continue
        first = converter.target_patterns[0]
        if any(group.target.replace(first, other) == key for other in converter.target_patterns[1:]):
            return True
    return False


def reinitialise_derived_buffers(model: nn.Module) -> list[str]:
    """After `to_empty`, recompute the buffers no checkpoint holds (non-persistent: rotary frequencies, masks)
    with transformers' own initialisation of their modules; returns the modules it ran on."""
    init = getattr(model, "_init_weights", None)
    done = []
    for name, module in model.named_modules():
        if not module._non_persistent_buffers_set or init is None:
            continue
        with torch.no_grad():
            init(module)
        done.append(name)
    return done


@dataclass
class Pretrained:
    """What a model factory hands the training loop for a model it built on the meta device: where its weights
    are and how its keys map to them. The loop parallelises the model first, allocates it, then calls `load`."""
    checkpoint: ReleasedWeights
    layout: HFLayout
    names: dict[str, str]
    dtype: torch.dtype | None = None
    groups: list[_Group] | None = None  # the checkpoint's groups, as `prepare` checked them

    @classmethod
    def prepare(cls, model: nn.Module, directory: str | Path, adapt, dtype: torch.dtype | None = None) -> Pretrained:
        """Read `model`'s layout (built, not yet adapted), check the checkpoint fits it, then `adapt(model)`."""
        layout = HFLayout.of(model)
        checkpoint = ReleasedWeights(directory)
        groups = fitted_groups(checkpoint, layout)
        adapt(model)
        return cls(checkpoint, layout, layout.names(model), dtype, groups)

    @staticmethod
    def shared_slots(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
        """The places (module, attribute) that hold one parameter between them, for each parameter held in more
        than one: a runtime block keeps the model's tensor under a second name (the MoE router's weight)."""
        slots: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for name, param in module._parameters.items():
                if param is not None:
                    slots.setdefault(id(param), []).append((module, name))
        return [group for group in slots.values() if len(group) > 1]

    @staticmethod
    def tie(groups: list[list[tuple[nn.Module, str]]]) -> None:
        """Make each group's places hold one parameter again (allocating with `to_empty` gave each its own copy:
        the router would train one and the model export the other)."""
        for (first, name), *rest in groups:
            for module, attr in rest:
                module._parameters[attr] = first._parameters[name]

    def load(self, model: nn.Module) -> dict:
        """Into the allocated (`to_empty`) model: derived buffers recomputed, weights read, LoRA adapters
        started afresh (B = 0: the adapted model computes what the checkpoint does)."""
        from torch.distributed.tensor import DTensor

        from runtime.lora import has_lora, reset_lora

        if self.layout.tied and not any(isinstance(p, DTensor) for p in model.parameters()):
            # allocating gave each holder of a shared tensor its own (FSDP2's DTensors are swapped in place and
            # stay shared): tie them again as transformers ties them
            model.tie_weights()
        reinitialise_derived_buffers(model)
        loaded = load_weights(model, self.checkpoint, self.layout, self.names, self.dtype, self.groups)
        if has_lora(model):
            reset_lora(model)
        return loaded
