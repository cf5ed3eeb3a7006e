"""Tensor parallelism: attention heads and MLP hidden units split over the plan's `tp` ranks.

    declare(model, attention={path: Heads(heads, kv_heads)}, mlps=[path, ...])   # the model's builder, once
    splits = find_splits(model)          # which projections split how, read from one forward pass
    apply_tensor_parallel(model, tp_mesh, splits)

Which modules are split is what inspection found (the ModelSpec's attention and dense-MLP paths, declared by
whoever builds the model; every runtime MoE block's shared experts are added here). How each one splits is read
from what its projections do in a forward pass, never from their names:

- a projection that reads the module's input is split by output rows (column-wise): each rank computes its own
  heads (attention) or its own hidden units (MLP) from the full input;
- the projection whose output is the module's output is split by input columns (row-wise): each rank's partial
  product is summed over the tp ranks (one all-reduce per module in forward, one in backward).

    y = sum_r  W_o[:, cols_r] f(W_in[rows_r, :] x)     (f: per-head attention or the MLP's activation)

is exact when f works on each head (hidden unit) alone, which is why anything else is refused: a projection that
neither reads the input nor writes the output (MLA's low-rank paths), a parameter that is not per head (attention
sinks), an MLP projection wider than what its output projection reads (a fused gate|up matmul, whose halves a
contiguous split would mix), heads that do not divide by tp. Experts stay expert-parallel and are not split:
every tp rank of a group computes the same routed experts on the same tokens. Norms, embeddings, routers and the
LM head are replicated; between a layer's blocks the sequence is split over the tp ranks (`runtime.parallel.
sequence`), so a split module's row-wise projection there reduce-scatters rather than all-reduces.

Parameters become DTensors on the tp mesh (Shard(0) / Shard(1) / Replicate), which FSDP2 then shards over the
data-parallel mesh as 2-D DTensors, and `torch.distributed.checkpoint` saves as such. LoRA adapters split with
their base: column-wise B by rows (A whole), row-wise A by columns (B whole), so x A^T B^T sums like x W^T.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from runtime.lora import LoRALinear
from runtime.model_tree import moe_blocks

_DECLARED = "tensor_parallel_modules"  # the attribute `declare` sets on a model (read by `declared` only)


@dataclass(frozen=True)
class Heads:
    """An attention module's query and key/value head counts (as the model that is trained has them)."""
    heads: int
    kv_heads: int


@dataclass(frozen=True)
class Split:
    """How one module splits: its column-wise projections (child paths), its row-wise one, its heads, and the
    per-head modules with parameters (q / k norms) with the dimension of their input that holds the heads."""
    path: str
    colwise: tuple[str, ...]
    rowwise: str
    heads: Heads | None = None  # None: an MLP
    per_head: tuple[tuple[str, int], ...] = ()


def declare(model: nn.Module, *, attention: dict[str, Heads], mlps: list[str], blocks: list[str] = ()) -> None:
    """Record which modules of `model` tensor parallelism may split (their paths in the model), and `blocks`: every
    decoder layer's attention and MLP, split or not (what sequence parallelism gathers the sequence for)."""
    setattr(model, _DECLARED, {"attention": dict(attention), "mlps": list(mlps), "blocks": list(blocks)})


def declared(model: nn.Module) -> dict | None:
    """What `declare` recorded on `model`, or None."""
    return getattr(model, _DECLARED, None)


def _projection(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, LoRALinear))


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return kwargs["hidden_states"]
    return next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)


def _targets(model: nn.Module) -> dict[str, Heads | None]:
    found = declared(model)
    if found is None:
        raise ValueError("tp > 1 but nothing declares which modules split (runtime.parallel.tensor.declare; "
                         "onboard's model factory declares them from the bundle's spec)")
    targets: dict[str, Heads | None] = dict(found["attention"])
    targets.update({path: None for path in found["mlps"]})
    for name, block in moe_blocks(model):  # shared experts: plain MLPs inside the runtime's MoE blocks
        targets.update({f"{name}.shared.{i}" if name else f"shared.{i}": None for i in range(len(block.shared))})
    return targets


def find_splits(model: nn.Module, inputs: dict | None = None) -> list[Split]:
    """How each declared module splits, read from one forward pass of `model` (`inputs`: its keyword arguments;
    default a short random sequence). ValueError naming the module when one cannot split."""
    targets = _targets(model)
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("tensor parallelism reads how projections split from a forward pass, which a model on the "
                         "meta device (released weights, read after parallelising) cannot run yet")
    seen: dict[str, tuple] = {}
    hooks = []

    def remember(path):
        def hook(module, args, kwargs, output):
            out = output[0] if isinstance(output, tuple) else output
            seen.setdefault(path, (_first_tensor(args, kwargs), out))
        return hook

    for path in targets:
        module = model.get_submodule(path)
        hooks.append(module.register_forward_hook(remember(path), with_kwargs=True))
        for name, child in module.named_modules():
            if name and (_projection(child) or next(child.parameters(recurse=False), None) is not None):
                hooks.append(child.register_forward_hook(remember(f"{path}.{name}"), with_kwargs=True))
    if inputs is None:  # 7 tokens: a length no head count is likely to equal, so the heads' dimension is plain
        vocab = model.config.vocab_size
        ids = torch.randint(0, vocab, (1, 7), generator=torch.Generator().manual_seed(0))
        device = next(model.parameters()).device
        inputs = {"input_ids": ids.to(device), "labels": ids.to(device), "use_cache": False}
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for h in hooks:
            h.remove()
    return [_split(model, path, heads, seen) for path, heads in targets.items()]


def _split(model: nn.Module, path: str, heads: Heads | None, seen: dict) -> Split:
    if path not in seen:
        raise ValueError(f"tensor parallelism: {path} did not run in a forward pass")
    given, result = seen[path]
    module = model.get_submodule(path)
    colwise, rowwise, others = [], [], []
    for name, child in module.named_modules():
        if not (name and _projection(child)):
            if name and next(child.parameters(recurse=False), None) is not None:
                others.append(name)
            continue
        if f"{path}.{name}" not in seen:
            continue  # a projection that never runs stays whole
        reads, writes = seen[f"{path}.{name}"]
        if writes is result:
            rowwise.append(name)
        elif reads is given:
            colwise.append(name)
        else:
            raise ValueError(f"tensor parallelism: {path}.{name} neither reads {path}'s input nor writes its "
                             f"output (a low-rank or chained projection); splitting it is not built")
    if len(rowwise) != 1 or not colwise:
        raise ValueError(f"tensor parallelism: {path} has {len(colwise)} input and {len(rowwise)} output "
                         f"projection(s); one output projection after the input ones is what splits")
    out = module.get_submodule(rowwise[0])
    widths = {module.get_submodule(c).out_features for c in colwise}
    own = [name for name, _ in module.named_parameters(recurse=False)]
    if heads is None:
        if widths != {out.in_features}:
            raise ValueError(f"tensor parallelism: {path}'s input projections are {sorted(widths)} wide and its output "
                             f"projection reads {out.in_features} (a fused gate|up matmul?): splitting it is not built")
        if own or others:
            raise ValueError(f"tensor parallelism: {path} holds parameters outside its projections "
                             f"({(own + others)[0]}); splitting it is not built")
        return Split(path, tuple(colwise), rowwise[0])
    if own:
        raise ValueError(f"tensor parallelism: {path}.{own[0]} is a parameter of the attention itself (per-head "
                         f"sinks or scales?) that splitting would need; not built")
    return Split(path, tuple(colwise), rowwise[0], heads, tuple((name, _head_dim(path, name, seen, heads))
                                                                  for name in others if f"{path}.{name}" in seen))


def _head_dim(path: str, name: str, seen: dict, heads: Heads) -> int:
    """The dimension of a per-head module's input that holds the heads (not the last: that is one head's
    features, which the module's parameters must span)."""
    given = seen[f"{path}.{name}"][0]
    dims = [d for d in range(given.dim() - 1) if given.shape[d] in (heads.heads, heads.kv_heads)]
    if len(dims) != 1:
        raise ValueError(f"tensor parallelism: {path}.{name} (input {tuple(given.shape)}) is not a per-head module "
                         f"with one dimension of {heads.heads} or {heads.kv_heads} heads; splitting it is not built")
    return dims[0]


def problems(splits: list[Split], tp: int) -> list[str]:
    """Why `splits` cannot be laid out over `tp` ranks (empty when they can)."""
    out = []
    for s in splits:
        if s.heads is not None and (s.heads.heads % tp or s.heads.kv_heads % tp):
            out.append(f"{s.path}: {s.heads.heads} query and {s.heads.kv_heads} key/value heads do not divide "
                       f"by tp={tp}")
    return out


def _lora_placements(module: nn.Module, colwise: bool) -> dict[str, list]:
    if colwise:
        return {"weight": [Shard(0)], "bias": [Shard(0)], "lora_a": [Replicate()], "lora_b": [Shard(0)]}
    return {"weight": [Shard(1)], "bias": [Replicate()], "lora_a": [Shard(1)], "lora_b": [Replicate()]}


def _distribute(placements: dict, module: nn.Module, mesh, src_data_rank) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        tensor = distribute_tensor(param, mesh, placements[name], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(tensor, requires_grad=param.requires_grad))


class _Colwise(ColwiseParallel):
    """ColwiseParallel that also splits a LoRALinear (B by rows, A whole)."""

    def _apply(self, module, device_mesh):
        if not isinstance(module, LoRALinear):
            return super()._apply(module, device_mesh)
        return distribute_module(
            module, device_mesh,
            lambda _, m, mesh: _distribute(_lora_placements(m, True), m, mesh, self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class _Rowwise(RowwiseParallel):
    """RowwiseParallel that also splits a LoRALinear (A by columns, B whole: the low-rank product sums too)."""

    def _apply(self, module, device_mesh):
        if not isinstance(module, LoRALinear):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh,
            lambda _, m, mesh: _distribute(_lora_placements(m, False), m, mesh, self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


def apply_tensor_parallel(model: nn.Module, mesh, splits: list[Split], sequence: set[str] = frozenset()) -> None:
    """Split every module of `splits` over the 1-D tp `mesh`, in place (collective over the mesh). The modules in
    `sequence` return their part of the sequence (a reduce-scatter, for sequence parallelism) rather than all of
    it (an all-reduce)."""
    if why := problems(splits, mesh.size()):
        raise ValueError("; ".join(why))
    for s in splits:
        plan = {name: _Colwise() for name in s.colwise}
        plan[s.rowwise] = _Rowwise(output_layouts=Shard(1)) if s.path in sequence else _Rowwise()
        # per-head norms: their parameters replicated, their input sharded on the heads' dimension, so the
        # parameters' gradient is summed over the tp ranks' heads
        plan.update({name: SequenceParallel(sequence_dim=dim, use_local_output=True) for name, dim in s.per_head})
        module = model.get_submodule(s.path)
        frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
        parallelize_module(module, mesh, plan)
        for name, p in module.named_parameters():  # SequenceParallel's replicas come back trainable
            p.requires_grad_(name not in frozen)
