"""Context parallelism at the model level: each cp rank runs the model on its segments of every sequence.

    split = Split.of(inputs, group)          # this rank's zig-zag segments of one micro-batch
    local = split.inputs(inputs)             # the model's keyword arguments for them
    with running(split):                     # runtime.sequence_split: the cores compute across the cp ranks
        loss = model(**local, use_cache=False).loss
        loss.backward()

A sequence of T tokens is cut into 2 cp equal segments; rank r holds segments r and 2 cp - 1 - r
(`runtime.parallel.context.zigzag`), one cheap early part and one costly late one for causal attention. What the
model needs to compute as on the unsplit sequence:

- rotary positions: `position_ids` are the tokens' global positions (per document for packed sequences), so the
  decoder's rotary tables are the unsplit sequence's;
- the labels are shifted on the whole sequence before the cut (the token at a segment's end predicts the first
  token of the next segment, which another rank holds) and passed as `shift_labels`;
- the loss: rank r returns cp * (its tokens' summed cross-entropy) / (the sequence's target count), so the mean
  over the cp ranks, which FSDP2's gradient reduction over (dp_shard x cp) takes, is the unsplit sequence's mean
  loss and gradient, also when the ranks hold different numbers of targets (packed documents, masked prompts);
- the router's load-balancing loss (`balance_loss`): HuggingFace's E * sum_e f_e P_e over every token, with f
  (the share of picks per expert) all-reduced over the cp group and P split into each rank's share, so the
  ranks' terms add up to the unsplit sequence's loss and gradient;
- attention (`runtime.sequence_split`): softmax attention runs as `ATTENTION`, registered with transformers'
  attention interface (sliding windows from its keyword arguments, chunked attention's chunk from `declare_chunks`:
  transformers passes it to the mask only); the linear cores carry their states across segments; DSA picks global
  top-k.

Every rank of the cp group reads the same micro-batch (`ParallelMesh.dp_rank` does not count cp).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
import torch.nn.functional as F

from runtime.parallel.context import (
    context_parallel_attention,
    context_parallel_conv1d,
    context_parallel_gated_delta,
    context_parallel_scalar_decay,
    gathered_in_order,
    visible,
    zigzag,
)

ATTENTION = "onboard_cp"  # softmax attention under context parallelism, in transformers' attention interface
_CHUNK = "context_parallel_chunk"  # the attribute `declare_chunks` sets on a chunked-attention module
IGNORE = -100
PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")  # the whole sequence's: dropped


@dataclass
class Split:
    """Where this rank's tokens lie in the unsplit sequence."""

    group: object
    size: int
    segments: list[int]  # this rank's segments, increasing
    n_segments: int
    positions: torch.Tensor  # (Tl,) the global index of each of this rank's tokens
    documents: torch.Tensor | None  # (T,) the document of every global position (packed sequences), else None
    targets: int  # tokens of the whole micro-batch with a label (every rank's)

    @classmethod
    def of(cls, inputs: dict, group) -> Split:
        """This rank's split of the micro-batch `inputs` (input_ids (B, T), labels, optional position_ids)."""
        ids = inputs["input_ids"]
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        n_segments = 2 * size
        length = ids.shape[-1]
        if length % n_segments:
            raise ValueError(f"context parallelism cuts each sequence into 2*cp={n_segments} equal segments: "
                             f"seq_len={length} is not a multiple")
        per = length // n_segments
        segments = zigzag(size)[rank]
        positions = torch.cat([torch.arange(s * per, (s + 1) * per) for s in segments]).to(ids.device)
        documents = None
        if "position_ids" in inputs:  # packed: documents restart their positions
            if ids.shape[0] != 1:
                raise ValueError("packed sequences come one row per micro-batch")
            documents = torch.cumsum(inputs["position_ids"][0] == 0, 0) - 1
        labels = inputs.get("labels")
        targets = ids.numel() - ids.shape[0] if labels is None else int((_shifted(labels) != IGNORE).sum())
        return cls(group, size, segments, n_segments, positions, documents, max(targets, 1))

    @property
    def per(self) -> int:
        return len(self.positions) // len(self.segments)

    def inputs(self, inputs: dict) -> dict:
        """The model's keyword arguments for this rank's tokens (see the module docstring)."""
        ids = inputs["input_ids"]
        local = {k: v for k, v in inputs.items() if k not in PACKING_KEYS}
        local["input_ids"] = ids[:, self.positions]
        if "position_ids" in inputs:
            local["position_ids"] = inputs["position_ids"][:, self.positions]
        else:
            local["position_ids"] = self.positions.unsqueeze(0).expand(ids.shape[0], -1)
        if "labels" in inputs:
            local["labels"] = local["shift_labels"] = _shifted(inputs["labels"])[:, self.positions]
            # cp * (this rank's summed loss) / (every rank's targets): the cp ranks' mean is the sequence's loss
            local["num_items_in_batch"] = self.targets / self.size
        return local

    # what every layer's core asks, known from the split alone: computed once per micro-batch, not per layer (each
    # would otherwise be a collective or a host sync in every layer, forward and recompute)

    @cached_property
    def owners(self) -> dict[int, tuple[int, int]]:
        """Segment -> (rank, index among that rank's segments): the zig-zag layout every rank holds."""
        return {s: (rank, i) for rank, held in enumerate(zigzag(self.size)) for i, s in enumerate(held)}

    @cached_property
    def key_positions(self) -> torch.Tensor:
        """(T,) every rank's global positions in rank order: where the all-gathered keys come from."""
        per = self.per
        return torch.cat([torch.arange(s * per, (s + 1) * per) for held in zigzag(self.size)
                          for s in held]).to(self.positions.device)

    @cached_property
    def firsts(self) -> torch.Tensor | None:
        """(T,) True at the first token of every document (packed sequences), else None."""
        if self.documents is None:
            return None
        first = torch.ones_like(self.documents, dtype=torch.bool)
        first[1:] = self.documents[1:] != self.documents[:-1]
        return first

    @cached_property
    def starts(self) -> list[list[int]]:
        """The document starts inside each of this rank's segments (offsets in the segment; 0 where one starts
        with it)."""
        first, per = self.firsts, self.per
        if first is None:
            return [[] for _ in self.segments]
        return [[int(i) for i in first[s * per:(s + 1) * per].nonzero().flatten()] for s in self.segments]

    @cached_property
    def resets(self) -> torch.Tensor | None:
        """(1, Tl) True at this rank's tokens that start a document (the sequence's start too: no state precedes
        it), for the scalar-decay scan."""
        return None if self.firsts is None else self.firsts[self.positions].unsqueeze(0)

    # the cores, across the cp group ------------------------------------------------------------------------

    def gated_delta(self, query, key, value, g, beta, **kw) -> torch.Tensor:
        """`chunk_gated_delta_rule` of this rank's tokens, each row carried across the segments."""
        rows = [context_parallel_gated_delta(*(x[b:b + 1] for x in (query, key, value, g, beta)), group=self.group,
                                             segments=self.segments, n_segments=self.n_segments,
                                             starts=self.starts, owners=self.owners, **kw)
                for b in range(query.shape[0])]
        return torch.cat(rows)

    def scalar_decay(self, q, k, v, g, *, chunk_size: int = 64) -> torch.Tensor:
        """`chunk_scalar_decay` of this rank's tokens (Mamba2's SSD, lightning attention), each row carried across
        the segments; a document's first token drops the state before it."""
        rows = [context_parallel_scalar_decay(*(x[b:b + 1] for x in (q, k, v, g)), group=self.group,
                                              segments=self.segments, n_segments=self.n_segments,
                                              reset=self.resets, chunk_size=chunk_size, owners=self.owners)
                for b in range(q.shape[0])]
        return torch.cat(rows)

    def conv1d(self, x, weight, bias=None, activation=None) -> torch.Tensor:
        """The short causal convolution (x (B, C, Tl)) with each segment's predecessor's last taps."""
        return context_parallel_conv1d(x, weight, bias, activation, group=self.group, segments=self.segments,
                                       n_segments=self.n_segments, documents=self.documents, owners=self.owners)

    def attention(self, query, key, value, *, window=None, chunk=None, scale=None, sinks=None) -> torch.Tensor:
        """Softmax attention (B, H, Tl, D) of this rank's queries over the whole sequence's keys."""
        return context_parallel_attention(query, key, value, group=self.group, positions=self.positions,
                                          kpos=self.key_positions, documents=self.documents, window=window,
                                          chunk=chunk, scale=scale, sinks=sinks)

    def visible(self) -> torch.Tensor:
        """(Tl, T) True where this rank's query sees the key at global position j: causal, within its document
        (built per call, not kept: it is Tl x T)."""
        return visible(self.positions, torch.arange(self.n_segments * self.per, device=self.positions.device),
                       self.documents)

    def index_topk(self, q, k, weights, top_k: int, scale) -> torch.Tensor:
        """The DSA indexer's picks (B, Tl, top_k): global key positions, each query's top-k among the keys it may
        see of the whole sequence (k (B, Tl, D) here, all-gathered). The keys are scored in the unsplit order, so
        equal scores (the indexer's ReLU makes exact ties) are broken as one process breaks them."""
        from runtime.attention.indexer import indexer_topk

        keys = gathered_in_order([k], self.group, [1], self.positions, self.key_positions)[0]
        return indexer_topk(q, keys, weights, self.visible().expand(q.shape[0], -1, -1), top_k, scale)

    def sparse_attention(self, query, key, value, picks, scale, sinks=None) -> torch.Tensor:
        """Sparse attention (B, H, Tl, Dv) of this rank's queries to their picked global keys (key / value
        (B, Hkv, Tl, D) here, all-gathered)."""
        from runtime.attention.dsa import visible_picks
        from runtime.attention.sparse import sparse_attention

        keys, values = gathered_in_order([key, value], self.group, [2, 2], self.positions, self.key_positions)
        picks = visible_picks(picks, self.visible()[None, None], keys.shape[2])
        return sparse_attention(query, keys, values, picks, scale, sinks)

    def balance_loss(self, router_logits, num_experts: int, top_k: int) -> torch.Tensor:
        """This rank's term of HuggingFace's load-balancing loss over every layer's router logits (each
        (tokens, E)): cp * E * sum_e f_e P_e^r with f over the whole sequence, P^r this rank's share."""
        logits = torch.cat([x.float() for x in router_logits])
        probs = torch.softmax(logits, dim=-1)
        picks = torch.topk(probs, top_k, dim=-1).indices.flatten()
        counts = probs.new_zeros(num_experts + 1)
        counts[:-1].index_add_(0, picks, torch.ones_like(picks, dtype=probs.dtype))
        counts[-1] = probs.shape[0]
        dist.all_reduce(counts, group=self.group)  # picks and rows of the whole sequence (no gradient)
        rows = counts[-1]
        return self.size * num_experts * (counts[:-1] / rows * (probs.sum(0) / rows)).sum()


def split_inputs(inputs: dict, group) -> tuple[Split | None, dict]:
    """(this rank's split, its model inputs) of a micro-batch; (None, inputs) without a cp `group`."""
    if group is None:
        return None, inputs
    split = Split.of(inputs, group)
    return split, split.inputs(inputs)


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    """Token t's target is label t + 1 of the whole sequence; the last token predicts nothing."""
    return F.pad(labels, (0, 1), value=IGNORE)[..., 1:]


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention interface under context parallelism: (B, H, S, D) in, (B, S, H, D) out. Without
    an active split (a forward outside the training step) it is transformers' sdpa."""
    from runtime.sequence_split import active

    split = active()
    if split is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dropout:
        raise ValueError("context parallelism runs attention without dropout; set the config's attention_dropout "
                         "to 0")
    window = kwargs.get("sliding_window") or None
    out = split.attention(query, key, value, window=window, chunk=getattr(module, _CHUNK, None), scale=scaling,
                          sinks=kwargs.get("s_aux"))
    return out.transpose(1, 2), None


def mask(*args, **kwargs):
    """transformers' mask interface under context parallelism: the attention computes what each query sees from
    global positions, so the mask is a (B, 1, 1, 1) placeholder (DSA modules slice it); sdpa's without a split."""
    from runtime.sequence_split import active

    if active() is None:
        from transformers.masking_utils import sdpa_mask

        return sdpa_mask(*args, **kwargs)
    batch = kwargs.get("batch_size", args[0] if args else 1)
    device = kwargs.get("cache_position", torch.zeros(0)).device
    return torch.ones(batch, 1, 1, 1, dtype=torch.bool, device=device)


def declare_chunks(model, chunks: dict[str, int]) -> None:
    """Record the chunk size of each chunked-attention module of `model` (path -> tokens; Llama 4's
    `attention_chunk_size` layers, as inspection found them): a query sees the earlier keys of its own chunk of the
    unsplit sequence. transformers builds that from the config into the mask, which under cp is a placeholder."""
    for path, chunk in chunks.items():
        setattr(model.get_submodule(path), _CHUNK, int(chunk))


def _positions_counted_locally(model, seq_len: int) -> str | None:
    """Why `model` cannot run under cp at `seq_len`, if a module scales its queries by positions it counts itself
    (Llama 4's attention temperature tuning on its NoPE layers: log1p(floor((p + 1) / floor_scale)) * attn_scale + 1
    with p = arange(tokens the module is given), which under cp would be each rank's local count). The factor is 1
    for every p < floor_scale - 1, so shorter sequences are exact."""
    for name, m in model.named_modules():
        floor = getattr(m, "floor_scale", None)
        if getattr(m, "attn_temperature_tuning", False) and isinstance(floor, (int, float)) and seq_len >= floor:
            return (f"context parallelism: {name} scales its queries by token positions it counts on the tokens it "
                    f"is given (attention temperature tuning, floor_scale {floor}); at seq_len {seq_len} >= "
                    f"{floor} under cp those would be each rank's own: not built")
    return None


def prepare(model, seq_len: int | None = None) -> None:
    """Make `model`'s softmax attention run as `ATTENTION` (every module that reads the model's config; a
    module with its own, as swapped DSA attention, keeps its implementation and reads the split itself).
    ValueError when a module's numbers would depend on the split at `seq_len` (`_positions_counted_locally`)."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    if seq_len is not None and (why := _positions_counted_locally(model, seq_len)):
        raise ValueError(why)

    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, mask)
    configs = {id(m.config): m.config for m in model.modules() if getattr(m, "config", None) is not None}
    for config in configs.values():
        if getattr(config, "_attn_implementation", None) in (None, "sdpa", "eager", "flash_attention_2"):
            config._attn_implementation = ATTENTION
