"""Sequence parallelism: between a layer's blocks the residual stream is split along the sequence over the tp ranks.

With tensor parallelism alone every tp rank holds the whole (batch, sequence, hidden) residual stream and runs the
norms on all of it. Here each rank holds its 1/tp of the tokens from the first decoder layer of its stack to the
last (the decoder computes masks and rotary tables from the whole sequence before, and the final norm, LM head and
pipeline sends see it whole after):

    layer input  x_r  (tokens of rank r)
    norm         token-wise on x_r; its weight's gradient summed over the ranks (torch's SequenceParallel)
    split block  all-gather -> column-wise projections -> ... -> row-wise projection -> reduce-scatter: y_r
    local block  the block on x_r alone (MoE blocks under MoE parallel folding: token-wise, experts exchanged
                 over an EP group that spans the tp ranks)
    whole block  all-gather -> the block on every token (the same on every rank) -> keep y_r
                 (routed experts, and linear attention, which tensor parallelism does not split)
    partial      all-gather (plain; the backward reduce-scatters each rank's share of the gradient) -> whole
                 latents and split heads -> row-wise projection -> reduce-scatter: y_r (MLA, DSA)

so the all-reduce after each split block becomes a reduce-scatter plus an all-gather (the same bytes), and the
norms' and residuals' activations shrink by tp. A layer's blocks are its attention and MLP, as inspection found
them (`tensor.declare(blocks=...)`); every other child of a layer with parameters is taken to be token-wise (the
norms), which is what HuggingFace decoder layers hold.
"""

from __future__ import annotations

from functools import partial as bind

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

SEQ = 1  # (batch, sequence, hidden)


def _gathered(x: torch.Tensor, mesh, keep_dtensor: bool = False, summing_back: bool = False):
    """The whole sequence from every rank's part: a replicated DTensor (`keep_dtensor`), or a plain tensor whose
    gradient is taken as the same on every rank, or (`summing_back`) as each rank's share, summed
    (reduce-scattered) back."""
    whole = DTensor.from_local(x, mesh, [Shard(SEQ)], run_check=False).redistribute(mesh, [Replicate()])
    return whole if keep_dtensor else whole.to_local(grad_placements=[Partial()] if summing_back else None)


def _own_part(x: torch.Tensor, mesh) -> torch.Tensor:
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(SEQ)]).to_local()


def _on_first(args: tuple, kwargs: dict, change) -> tuple[tuple, dict]:
    """The call's hidden states (the first positional tensor, else `hidden_states`) changed by `change`."""
    if args and isinstance(args[0], torch.Tensor):
        return (change(args[0]), *args[1:]), kwargs
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return args, {**kwargs, "hidden_states": change(kwargs["hidden_states"])}
    raise ValueError("sequence parallelism: a block was called without hidden states to split")


def _on_output(output, change):
    if isinstance(output, tuple):
        return (change(output[0]), *output[1:])
    return change(output)


def apply_sequence_parallel(layers: list[nn.Module], blocks: dict[str, nn.Module], split: set[str], mesh,
                            partial: set[str] = frozenset(), local: tuple[nn.Module, ...] = ()) -> None:
    """Hooks and norms for sequence parallelism over the 1-D tp `mesh` on this rank's decoder `layers`. `blocks`:
    the layers' attention and MLP modules by path; `split`: the paths among them tensor parallelism split (their
    row-wise projection must already return its part of the sequence, `Shard(1)`); `partial`: those among them in
    partial-gradient form (`runtime.parallel.tensor`), which take the gathered sequence as a plain tensor whose
    gradient is summed back over the ranks. `local`: children of the layers left as they are, which run on this
    rank's tokens alone (MoE blocks under MoE parallel folding; their parameters' gradients are summed by the
    caller)."""
    if not layers:
        return
    layers[0].register_forward_pre_hook(
        lambda m, args, kwargs: _on_first(args, kwargs, lambda x: _own_part(x, mesh)), with_kwargs=True)
    layers[-1].register_forward_hook(lambda m, args, out: _on_output(out, lambda x: _gathered(x, mesh)))
    ids = {id(b) for b in (*blocks.values(), *local)}
    for path, block in blocks.items():
        # a split block's projections take the gathered DTensor, so gradients sum back (plain, summing back, in
        # partial-gradient form)
        gather = bind(_gathered, mesh=mesh, keep_dtensor=path in split and path not in partial,
                      summing_back=path in partial)
        block.register_forward_pre_hook(
            lambda m, args, kwargs, gather=gather: _on_first(args, kwargs, gather), with_kwargs=True)
        if path not in split:  # a whole block's output, the same on every rank: this rank keeps its part
            block.register_forward_hook(lambda m, args, out: _on_output(out, lambda x: _own_part(x, mesh)))
    for layer in layers:
        for name, child in layer.named_children():
            if id(child) in ids or next(child.parameters(), None) is None:
                continue
            frozen = {n for n, p in child.named_parameters() if not p.requires_grad}
            parallelize_module(child, mesh, SequenceParallel(sequence_dim=SEQ, use_local_output=True))
            for n, p in child.named_parameters():  # SequenceParallel's replicas come back trainable
                p.requires_grad_(n not in frozen)
