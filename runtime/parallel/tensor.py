"""Tensor parallelism: attention heads and MLP hidden units split over the plan's `tp` ranks.

    declare(model, attention={path: Heads(heads, kv_heads)}, mlps=[path, ...])   # the model's builder, once
    splits = find_splits(model, tp=2)    # which projections split how, read from one forward pass, and checked
    apply_tensor_parallel(model, tp_mesh, splits)

Which modules are split is what inspection found (the ModelSpec's attention and dense-MLP paths, declared by
whoever builds the model; every runtime MoE block's shared experts are added here). How each one splits is read
from what its projections do in a forward pass (with autograd recording, so that which projection feeds which is
in the graph), never from their names:

- the projection whose output is the module's output is split by input columns (row-wise): each rank's partial
  product is summed over the tp ranks (one reduction per module in forward, one in backward);
- a projection whose output feeds another projection (a low-rank latent: MLA's q_a / kv_a, a gate's down
  projection), or that does not feed the output projection at all (DSA's indexer, whose top-k is no gradient path)
  stays whole: every rank computes it on the full input;
- every other projection feeding the output projection is split by output rows (column-wise): each rank computes
  its own heads (attention) or its own hidden units (MLP) from the full input or from a whole latent:

    y = sum_r  W_o[:, cols_r] f(W_in[rows_r, :] x, L(x))     (f: per-head attention or the MLP's activation,
                                                              L: the whole parts, the same on every rank)

is exact when f works on each head (hidden unit) alone. Parameters outside the projections are read from the
probe's graph too (`_local`): one that each kv-head group's outputs read a disjoint part of, along one dimension,
belongs to the heads (linear attention's depthwise short convolution over q | k | v, a decay bias per channel, a
decay rate or a sink per head), and each rank computes with its own heads' part; one every group reads (a norm over
one head's features) stays whole. A module may also read a width it holds to size its heads (`torch.split` of the
convolution's output by `self.qkv_dim`, a view by `self.num_k_heads`): those integer attributes hold each rank's
share (`Split.scaled`), found as the fewest that make the check below pass.

`find_splits(tp=...)` checks the split on the probe: each rank's slices, applied in this process
(`torch.func.functional_call`), give partial outputs that must sum to the module's own output; a module that fails
is refused (heads mixed before the output projection, a norm whose statistic spans the heads), as is anything the
rules above do not cover (a parameter of the attention itself that is not per head, an MLP projection wider than
its output projection reads: a fused gate|up matmul whose halves a contiguous split would mix, heads that do not
divide by tp).

Experts stay expert-parallel and are not split: every tp rank of a group computes the same routed experts on the
same tokens. Norms, embeddings, routers and the LM head are replicated; between a layer's blocks the sequence is
split over the tp ranks (`runtime.parallel.sequence`), so a split module's row-wise projection there
reduce-scatters rather than all-reduces.

A module with whole parts or per-head parameters runs in partial-gradient form: inside it the backward's
activation gradients are each rank's share (the contribution of its own heads), so the column-wise projections
return their input gradient unreduced, the module's input gradient is summed over the ranks once where sequence
parallelism gathered it, and the gradients of every parameter outside the split projections are summed over the tp
ranks (`sum_gradients_over_ranks`; a per-head parameter's gradient on one rank is zero outside its heads, so the sum
is the whole gradient). A module with neither keeps DTensor's own placements throughout.

Parameters become DTensors on the tp mesh (Shard(0) / Shard(1) / Replicate), which FSDP2 then shards over the
data-parallel mesh as 2-D DTensors, and `torch.distributed.checkpoint` saves as such; whole parts stay plain
tensors, the same on every tp rank. LoRA adapters split with their base: column-wise B by rows (A whole),
row-wise A by columns (B whole), so x A^T B^T sums like x W^T.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial

import torch
from torch import nn
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
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
    whole: tuple[str, ...] = ()  # children with parameters every rank computes whole (partial-gradient form)
    # partial-gradient form: parameters outside the projections that belong to heads (a depthwise convolution's
    # channels, per-head decay rates): (parameter path, its per-head dimension, the kv-head group each index along
    # it belongs to). Every rank keeps them whole and computes with its own heads' indices.
    local: tuple[tuple[str, int, tuple[int, ...]], ...] = ()
    # integer attributes (path, full value) that hold a split width the module reads in forward (a fused
    # convolution's `torch.split` sizes): each rank's module holds value // tp. Found by the probe check (`find_splits`)
    scaled: tuple[tuple[str, int], ...] = ()

    @property
    def partial(self) -> bool:
        """Whether the module runs in partial-gradient form: it keeps whole parts, or parameters read per head."""
        return bool(self.whole or self.local)

    def indices(self, tp: int, rank: int) -> dict[str, tuple[int, tuple[int, ...]]]:
        """Each local parameter's per-head dimension and the indices along it rank `rank` of `tp` computes with."""
        if not self.local:
            return {}
        groups = self.heads.kv_heads
        return {name: (dim, tuple(i for i, g in enumerate(owner) if g * tp // groups == rank))
                for name, dim, owner in self.local}


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


def _targets(model: nn.Module, shared_experts: bool = True) -> dict[str, Heads | None]:
    found = declared(model)
    if found is None:
        raise ValueError("tp > 1 but nothing declares which modules split (runtime.parallel.tensor.declare; "
                         "onboard's model factory declares them from the bundle's spec)")
    targets: dict[str, Heads | None] = dict(found["attention"])
    targets.update({path: None for path in found["mlps"]})
    for name, block in moe_blocks(model) if shared_experts else ():  # plain MLPs inside the runtime's MoE blocks
        targets.update({f"{name}.shared.{i}" if name else f"shared.{i}": None for i in range(len(block.shared))})
    return targets


def find_splits(model: nn.Module, inputs: dict | None = None, tp: int | None = None,
                shared_experts: bool = True) -> list[Split]:
    """How each declared module splits, read from one forward pass of `model` (`inputs`: its keyword arguments;
    default a short random sequence). With `tp`, each split is also checked on that pass: the tp ranks' partial
    outputs, computed here from each rank's slices, must sum to the module's output. `shared_experts`: split the
    shared experts of the runtime's MoE blocks too (not under MoE parallel folding, where a block runs on each
    rank's own tokens). ValueError naming the module when one cannot split."""
    targets = _targets(model, shared_experts)
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("tensor parallelism reads how projections split from a forward pass, which a model on the "
                         "meta device (released weights, read after parallelising) cannot run yet")
    seen: dict[str, tuple] = {}  # path -> (its input, its output) at its first call
    calls: dict[str, tuple] = {}  # a declared module's path -> (args, kwargs) of that call, for `_check`
    hooks = []

    def remember(path, call=False):
        def hook(module, args, kwargs, output):
            seen.setdefault(path, (_first_tensor(args, kwargs), output[0] if isinstance(output, tuple) else output))
            if call:
                calls.setdefault(path, (args, kwargs))
        return hook

    for path in targets:
        module = model.get_submodule(path)
        hooks.append(module.register_forward_hook(remember(path, True), with_kwargs=True))
        for name, child in module.named_modules():
            if name and (_projection(child) or next(child.parameters(recurse=False), None) is not None):
                hooks.append(child.register_forward_hook(remember(f"{path}.{name}"), with_kwargs=True))
    if inputs is None:  # 7 tokens: a length no head count is likely to equal, so the heads' dimension is plain
        vocab = model.config.vocab_size
        ids = torch.randint(0, vocab, (1, 7), generator=torch.Generator().manual_seed(0))
        device = next(model.parameters()).device
        inputs = {"input_ids": ids.to(device), "labels": ids.to(device), "use_cache": False}
    # autograd records the pass (which projection feeds which is read from its graph): every parameter takes part
    frozen = [p for p in model.parameters() if not p.requires_grad]
    try:
        for p in frozen:
            p.requires_grad_(True)
        with torch.enable_grad():
            model(**inputs)
        splits = [_split(model, path, heads, seen) for path, heads in targets.items()]
        if tp is not None and not problems(splits, tp):
            with torch.no_grad():
                splits = [_checked(model.get_submodule(s.path), s, tp, *calls[s.path], seen[s.path][1])
                          for s in splits]
    finally:
        for h in hooks:
            h.remove()
        for p in frozen:
            p.requires_grad_(False)
    return splits


def _feeders(tensor: torch.Tensor | None, stops: dict) -> set[str]:
    """The projections (named by `stops`: their outputs' autograd nodes) that `tensor` is computed from, directly:
    the walk back through the graph stops at each of them."""
    found, visited = set(), set()
    todo = [tensor.grad_fn] if tensor is not None and tensor.grad_fn is not None else []
    while todo:
        node = todo.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        if node in stops:
            found.add(stops[node])
            continue
        todo.extend(n for n, _ in node.next_functions)
    return found


def _split(model: nn.Module, path: str, heads: Heads | None, seen: dict) -> Split:
    if path not in seen:
        raise ValueError(f"tensor parallelism: {path} did not run in a forward pass")
    given, result = seen[path]
    module = model.get_submodule(path)
    ran = {name: seen[f"{path}.{name}"] for name, child in module.named_modules()
           if name and _projection(child) and f"{path}.{name}" in seen}  # a projection that never runs stays whole
    rowwise = [name for name, (_, writes) in ran.items() if writes is result]
    if len(rowwise) != 1:
        raise ValueError(f"tensor parallelism: {path} has {len(rowwise)} output projection(s); one output "
                         f"projection after the input ones is what splits")
    rowwise = rowwise[0]
    stops = {writes.grad_fn: name for name, (_, writes) in ran.items() if writes.grad_fn is not None}
    if given is not None and given.grad_fn is not None:
        stops.setdefault(given.grad_fn, "")  # the module's input: the walk goes no further back
    feeds = {name: _feeders(reads, stops) - {""} for name, (reads, _) in ran.items()}
    latent = set().union(*(feeds[name] for name in ran if name != rowwise))
    colwise = [name for name in ran if name in feeds[rowwise] and name not in latent]
    whole = [name for name in ran if name != rowwise and name not in colwise]
    if not colwise:
        raise ValueError(f"tensor parallelism: {path} has no input projection that feeds its output projection "
                         f"alone; nothing splits")
    out = module.get_submodule(rowwise)
    own = [name for name, _ in module.named_parameters(recurse=False)]
    others = [name for name, child in module.named_modules()
              if name and not _projection(child) and next(child.parameters(recurse=False), None) is not None
              and not any(name.startswith(f"{p}.") for p in (*colwise, rowwise))]
    if heads is None:
        widths = {module.get_submodule(c).out_features for c in colwise}
        if whole:
            raise ValueError(f"tensor parallelism: {path}.{whole[0]} feeds another projection of the MLP (a low-rank "
                             f"path); splitting it is not built")
        if widths != {out.in_features}:
            raise ValueError(f"tensor parallelism: {path}'s input projections are {sorted(widths)} wide and its output "
                             f"projection reads {out.in_features} (a fused gate|up matmul?): splitting it is not built")
        if own or others:
            raise ValueError(f"tensor parallelism: {path} holds parameters outside its projections "
                             f"({(own + others)[0]}); splitting it is not built")
        return Split(path, tuple(colwise), rowwise)
    local = _local(module, seen[f"{path}.{rowwise}"][0], heads.kv_heads) if whole or own or others else ()
    if whole or local:  # partial-gradient form: the other parameters are whole or the heads' own (`_local`)
        parts = [name for name in (*whole, *others) if not any(name.startswith(f"{w}.") for w in whole)]
        return Split(path, tuple(colwise), rowwise, heads, whole=tuple(parts), local=local)
    if own:
        raise ValueError(f"tensor parallelism: {path}.{own[0]} is a parameter of the attention itself (per-head "
                         f"sinks or scales?) that splitting would need; not built")
    return Split(path, tuple(colwise), rowwise, heads, tuple((name, _head_dim(path, name, seen, heads))
                                                            for name in others if f"{path}.{name}" in seen))


def _outside_projections(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s parameters that no projection holds (its own, its norms', its convolutions'), by path."""
    return {f"{name}.{p}" if name else p: t for name, sub in module.named_modules() if not _projection(sub)
            for p, t in sub.named_parameters(recurse=False)}


def _local(module: nn.Module, reads: torch.Tensor, groups: int) -> tuple[tuple[str, int, tuple[int, ...]], ...]:
    """The parameters outside `module`'s projections that belong to its heads, read from the probe's graph.

    `reads`: the row-wise projection's input X (..., C), whose columns are the heads' outputs, in `groups` contiguous
    groups of C / groups (the kv-head groups: the finest unit a valid tp assigns to one rank). With R random,

        u_g(p) = d <R * 1[cols of g], X> / d p  !=  0        (one backward per group)

    marks the entries of parameter p group g's outputs are computed from (a random R leaves none at zero by
    accident). A parameter is its heads' own along dimension d when every index along d is marked by exactly one
    group and each group marks as many: a depthwise convolution's channels (q | k | v concatenated: three ranges
    per rank), a decay bias per channel, a decay rate per head. A parameter every group reads (a norm over one
    head's features) stays whole, as do those no group reads."""
    params = {name: t for name, t in _outside_projections(module).items() if t.requires_grad}
    if groups < 2 or not params or reads is None or reads.grad_fn is None:
        return ()
    names = list(params)
    noise = torch.randn(reads.shape, generator=torch.Generator().manual_seed(0), dtype=reads.dtype).to(reads.device)
    width = reads.shape[-1] // groups
    marked = {name: [] for name in names}
    for g in range(groups):
        mask = torch.zeros_like(noise)
        mask[..., g * width:(g + 1) * width] = 1
        grads = torch.autograd.grad(reads, [params[n] for n in names], grad_outputs=noise * mask, retain_graph=True,
                                    allow_unused=True)
        for name, grad in zip(names, grads):
            marked[name].append(torch.zeros_like(params[name], dtype=torch.bool) if grad is None else grad != 0)
    found = []
    for name in names:
        used = torch.stack(marked[name])  # (groups, *shape)
        dims = []
        for d in range(used.dim() - 1):
            size = used.shape[d + 1]
            by_index = used.movedim(d + 1, 1).reshape(groups, size, -1).any(-1)  # (groups, size along d)
            if size % groups == 0 and (by_index.sum(0) == 1).all() and (by_index.sum(1) == size // groups).all():
                dims.append((d, tuple(int(g) for g in by_index.to(torch.int64).argmax(0))))
        if len(dims) == 1:
            found.append((name, *dims[0]))
    return tuple(found)


def _slices(module: nn.Module, split: Split, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """`module`'s parameters as rank `rank` of `tp` holds them under `split` (the row-wise bias on rank 0 alone:
    the ranks' outputs are summed; local parameters at this rank's heads' indices)."""
    out = dict(module.named_parameters())
    for name, (dim, idx) in split.indices(tp, rank).items():
        out[name] = out[name].index_select(dim, torch.tensor(idx, device=out[name].device))
    for colwise, names in ((True, split.colwise), (False, (split.rowwise,))):
        placements = _placements(colwise)
        for name in names:
            for p, t in module.get_submodule(name).named_parameters(recurse=False):
                place = placements[p][0]
                if place.is_shard():
                    out[f"{name}.{p}"] = t.chunk(tp, place.dim)[rank]
                elif not colwise and p == "bias" and rank:  # added once, after the ranks' products are summed
                    out[f"{name}.{p}"] = torch.zeros_like(t)
    return out


def _sums(module: nn.Module, split: Split, tp: int, args: tuple, kwargs: dict, want: torch.Tensor,
          scaled: tuple[tuple[str, int], ...]) -> bool:
    """Whether the tp ranks' partial outputs of `module` under `split`, with the attributes `scaled` holding
    value // tp, computed in this process on the probe's call (`args`, `kwargs`), sum to its output (`want`)."""
    total = None
    try:
        with _scaled(module, scaled, tp):
            for rank in range(tp):
                got = torch.func.functional_call(module, _slices(module, split, tp, rank), args, kwargs)
                got = got[0] if isinstance(got, tuple) else got
                total = got if total is None else total + got
    except Exception:  # noqa: BLE001 - a width the module reads still full: shapes disagree, however it says so
        return False
    scale = want.detach().abs().max().item() or 1.0
    return total.shape == want.shape and torch.allclose(total, want.detach(), rtol=1e-4, atol=1e-5 * scale)


def _owner(module: nn.Module, path: str) -> tuple[nn.Module, str]:
    """The submodule of `module` holding the attribute or parameter at dotted `path`, and its name there."""
    prefix, _, name = path.rpartition(".")
    return module.get_submodule(prefix), name


@contextmanager
def _scaled(module: nn.Module, scaled: tuple[tuple[str, int], ...], tp: int):
    """`module`'s integer attributes `scaled` (path, full value) set to value // tp while the block runs."""
    where = [(*_owner(module, path), value) for path, value in scaled]
    for owner, attr, value in where:
        setattr(owner, attr, value // tp)
    try:
        yield
    finally:
        for owner, attr, value in where:
            setattr(owner, attr, value)


def _segments(owner: tuple[int, ...]) -> list[int]:
    """The lengths of a local parameter's segments: stretches whose groups run in order (a convolution over
    q | k | v has three, each of all the heads)."""
    cuts = [0, *(i for i in range(1, len(owner)) if owner[i] < owner[i - 1]), len(owner)]
    return [b - a for a, b in zip(cuts, cuts[1:])]


def _widths(module: nn.Module, split: Split, tp: int) -> list[tuple[str, int]]:
    """`module`'s integer attributes whose value is a width the split divides by tp (heads, a column-wise
    projection's outputs, a local parameter's per-head size or its segments' sizes): what its forward might read to
    size its heads."""
    sizes = {split.heads.heads, split.heads.kv_heads} if split.heads else set()
    sizes |= {module.get_submodule(c).out_features for c in split.colwise}
    for _, _, owner in split.local:
        sizes |= {len(owner), *_segments(owner)}
    return sorted((f"{name}.{attr}" if name else attr, value) for name, sub in module.named_modules()
                  if not _projection(sub) for attr, value in vars(sub).items()
                  if type(value) is int and value in sizes and value % tp == 0)


def _checked(module: nn.Module, split: Split, tp: int, args: tuple, kwargs: dict, want: torch.Tensor) -> Split:
    """`split`, checked on the probe (`_sums`), with the width attributes (`_widths`) scaled that make each rank's
    part sum to the module's output: none if none are needed; else all of them less each one found unneeded in
    turn (a minimal set: what forward reads); else, when scaling all of them breaks something, the smallest set of
    up to three that works. ValueError when none do."""
    candidates = _widths(module, split, tp)

    def works(scaled) -> bool:
        return _sums(module, split, tp, args, kwargs, want, tuple(scaled))

    if works(()):
        return split
    if works(candidates):
        needed = list(candidates)
        for c in candidates:
            if works([n for n in needed if n != c]):
                needed.remove(c)
        return replace(split, scaled=tuple(needed))
    for n in range(1, min(3, len(candidates)) + 1):
        for scaled in itertools.combinations(candidates, n):
            if works(scaled):
                return replace(split, scaled=scaled)
    raise ValueError(f"tensor parallelism: {split.path} split over tp={tp} does not compute the module's output "
                     f"on the probe (its heads do not work alone); splitting it is not built")


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


def _placements(colwise: bool) -> dict[str, list]:
    """Each parameter's placement on the tp mesh in a column-wise or a row-wise projection (a LoRALinear's too;
    nn.Linear's are torch's ColwiseParallel / RowwiseParallel ones)."""
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
            lambda _, m, mesh: _distribute(_placements(True), m, mesh, self.src_data_rank),
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
            lambda _, m, mesh: _distribute(_placements(False), m, mesh, self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class _PartialColwise(_Colwise):
    """A column-wise projection inside a module in partial-gradient form: its plain input (the gathered sequence, or
    a whole latent) is the same on every rank, and the gradient it returns for it is this rank's share, unreduced."""

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        if isinstance(inputs[0], DTensor):
            raise ValueError("tensor parallelism: a column-wise projection in partial-gradient form was given a "
                             "DTensor (its module's input is gathered as a plain tensor)")
        return DTensor.from_local(inputs[0], device_mesh, (Replicate(),), run_check=False,
                                  grad_placements=(Partial(),))


class _SumOverRanks(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the tp ranks (what a whole part's parameters get from
    each rank's heads)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_gradients_over_ranks(module: nn.Module, subs: list[nn.Module], group, local: dict | None = None) -> None:
    """While `module` runs, the trainable parameters `subs` hold (their own, not their children's) are seen
    through `_SumOverRanks`, so their gradients sum over `group` (the parameter objects stay what FSDP2 manages:
    only the modules' view of them changes, and is put back when `module` returns). For parameters every rank
    holds whole whose gradient each rank computes a share of: its heads' (a whole part of a split module), or
    its tokens' (an MoE block's router and shared experts under MoE parallel folding). `local`: (id(sub), name) ->
    (dim, indices) for parameters the module reads at this rank's indices only (trainable or not): each rank's
    gradient is zero elsewhere, so the sum is the whole gradient."""
    local = local or {}
    stash: list = []

    def swap_in(m, args, kwargs):
        for sub in subs:
            for name, p in list(sub._parameters.items()):
                view = local.get((id(sub), name))
                if p is None or not (p.requires_grad or view):
                    continue
                stash.append((sub, name, p))
                seen = _SumOverRanks.apply(p, group) if p.requires_grad else p
                sub._parameters[name] = seen if view is None else seen.index_select(view[0], view[1].to(p.device))

    def swap_back(m, args, kwargs, out):
        while stash:
            sub, name, p = stash.pop()
            sub._parameters[name] = p

    module.register_forward_pre_hook(swap_in, with_kwargs=True)
    module.register_forward_hook(swap_back, with_kwargs=True, always_call=True)


def apply_tensor_parallel(model: nn.Module, mesh, splits: list[Split], sequence: set[str] = frozenset()) -> None:
    """Split every module of `splits` over the 1-D tp `mesh`, in place (collective over the mesh). The modules in
    `sequence` return their part of the sequence (a reduce-scatter, for sequence parallelism) rather than all of
    it (an all-reduce). A module with whole parts (partial-gradient form) must be in `sequence`: its input is
    gathered there (`runtime.parallel.sequence`) with the gradient summed over the ranks."""
    if why := problems(splits, mesh.size()):
        raise ValueError("; ".join(why))
    for s in splits:
        if s.partial and s.path not in sequence:
            raise ValueError(f"tensor parallelism: {s.path} keeps whole parts and runs under sequence parallelism "
                             f"only")
        colwise = _PartialColwise if s.partial else _Colwise
        plan = {name: colwise() for name in s.colwise}
        plan[s.rowwise] = _Rowwise(output_layouts=Shard(1)) if s.path in sequence else _Rowwise()
        # per-head norms: their parameters replicated, their input sharded on the heads' dimension, so the
        # parameters' gradient is summed over the tp ranks' heads
        plan.update({name: SequenceParallel(sequence_dim=dim, use_local_output=True) for name, dim in s.per_head})
        module = model.get_submodule(s.path)
        frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
        parallelize_module(module, mesh, plan)
        for name, p in module.named_parameters():  # SequenceParallel's replicas come back trainable
            p.requires_grad_(name not in frozen)
        for path, value in s.scaled:  # this rank's module holds its own heads' widths
            setattr(*_owner(module, path), value // mesh.size())
        if s.partial:  # every parameter outside the split projections: whole, or read at this rank's heads
            split = {id(module.get_submodule(name)) for name in (*s.colwise, s.rowwise)}
            subs = [m for m in module.modules() if id(m) not in split]
            local = {}
            for path, (dim, idx) in s.indices(mesh.size(), mesh.get_local_rank()).items():
                owner, name = _owner(module, path)
                local[(id(owner), name)] = (dim, torch.tensor(idx))
            sum_gradients_over_ranks(module, subs, mesh.get_group(), local)
