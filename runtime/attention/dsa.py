"""Run HuggingFace's DSA attention (DeepSeek-V3.2, GLM-MoE-DSA and kin) on the runtime, in place.

    from runtime.attention import swap_sparse_attention, sparse_calls, reset_sparse_calls

    swapped = swap_sparse_attention(model)                 # a model or any module holding DSA attention
    swapped = swap_sparse_attention(model, paths=[...])    # or name the attention modules (the spec's paths)
    swapped.attention   # attention modules whose softmax now runs over the picked keys only
    swapped.indexers    # indexers now scored chunk by chunk (runtime.attention.indexer.LightningIndexer)
    swapped.kept        # {indexer path: why it stays HuggingFace code}
    sparse_calls()      # {"indexer": n, "sparse": n, "dense": n} since reset_sparse_calls()

HuggingFace's DSA attention asks its indexer for each query's top-k keys, then, under eager / sdpa, scatters them
into a dense (B, 1, S, T) mask and attends to every key; under any other registered attention implementation it
passes them on as `indices=`. The swap uses that door: it registers `ATTENTION` in transformers'
ALL_ATTENTION_FUNCTIONS (`dsa_attention`) and ALL_MASK_ATTENTION_FUNCTIONS (sdpa's boolean mask, 1 byte per
query-key pair, built once per forward and shared by all layers), and makes it the `_attn_implementation` of the
config those attention modules read (an object the whole model shares: its mask builder and every layer see the
change, so swap the copy meant to run on the runtime, never the reference). No module, parameter or buffer
changes except the indexers, replaced by runtime modules that adopt the same projection modules (same names, same
parameter objects); an indexer the runtime does not reproduce on a probe input stays HuggingFace code (`kept`).

`dsa_attention` turns the picks the mask hides (future keys, padding, the spare picks of a query that sees fewer
than k keys) into -1 and runs `runtime.attention.sparse.sparse_attention`; a call without indices (a layer of the
same config that has none) falls back to transformers' sdpa. Attention sinks come as transformers passes them,
`s_aux=` (one logit per head: gpt-oss, HunYuan-V4), and join the sparse softmax; sdpa has no sink term, so a call
with sinks and no indices attends to every visible key through the sparse attention instead. A query that sees
no key at all (a left-padding position) gets zeros, as under sdpa (HuggingFace's default); eager's finfo.min mask
averages every value there.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from runtime.adapt import replace_module
from runtime.attention.indexer import LightningIndexer
from runtime.attention.sparse import sparse_attention

ATTENTION = "onboard_dsa"
_CALLS: Counter = Counter()
PICK_CHUNK_BYTES = 16 * 2**20


def sparse_calls() -> dict[str, int]:
    """How often the runtime's indexer, sparse attention and dense fallback ran since `reset_sparse_calls()`."""
    return {key: _CALLS[key] for key in ("indexer", "sparse", "dense")}


def reset_sparse_calls() -> None:
    _CALLS.clear()


def visible_picks(indices: torch.Tensor, mask: torch.Tensor | None, keys_len: int) -> torch.Tensor:
    """indices (B, S, K) with -1 where mask (B, 1, S, T) hides the key: bool (True: visible) or additive (0 or
    -inf / finfo.min); None means plain causal, the queries being the last S of the T keys."""
    batch, seq, top_k = indices.shape
    out = indices.to(torch.int32, copy=True)
    if mask is None:
        limit = torch.arange(seq, device=indices.device)[:, None] + (keys_len - seq)
        return out.masked_fill_(indices > limit, -1)
    seen_by = mask[:, 0].expand(batch, seq, mask.shape[-1])
    step = max(1, PICK_CHUNK_BYTES // (batch * top_k * 8))
    for start in range(0, seq, step):
        end = min(start + step, seq)
        seen = torch.gather(seen_by[:, start:end], 2, indices[:, start:end].long())
        if seen.dtype != torch.bool:
            hidden = seen <= torch.finfo(seen.dtype).min / 2
            if ((seen != 0) & ~hidden).any():
                raise ValueError("sparse attention takes a boolean mask or an additive one of 0 / -inf only; "
                                 "this one carries a bias")
            seen = ~hidden
        out[:, start:end].masked_fill_(~seen, -1)
    return out


def dsa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                  indices: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention interface: query (B, H, S, Dk), key / value (B, Hkv, T, D) -> (B, S, H, Dv);
    `s_aux` (H,): attention-sink logits, when the module has them."""
    sinks = kwargs.pop("s_aux", None)
    dense = indices is None
    if dense and sinks is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        _CALLS["dense"] += 1
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dense:  # every key a pick; the mask hides what the query may not see
        batch, seq, keys_len = query.shape[0], query.shape[2], key.shape[2]
        indices = torch.arange(keys_len, device=query.device).expand(batch, seq, keys_len)
    if dropout:
        raise ValueError("sparse attention has no attention dropout; set the config's attention_dropout to 0")
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = sparse_attention(query, key, value, visible_picks(indices, attention_mask, key.shape[2]), scale, sinks)
    _CALLS["dense" if dense else "sparse"] += 1
    return out.transpose(1, 2), None


def register() -> None:
    """Make `ATTENTION` a name transformers knows, for attention and for mask creation (idempotent)."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTENTION, dsa_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


@dataclass
class SparseSwap:
    attention: list[str] = field(default_factory=list)
    indexers: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)


def _count_indexer(module, args, output):
    _CALLS["indexer"] += 1


def _dsa_modules(root: nn.Module) -> list[str]:
    # the attribute DSA attention modules keep their indexer under (None on layers that reuse another's picks)
    return [name for name, m in root.named_modules()
            if hasattr(m, "indexer") and hasattr(m, "config") and (m.indexer is None or isinstance(m.indexer, nn.Module))]


def swap_sparse_attention(root: nn.Module, paths: list[str] | None = None) -> SparseSwap:
    """Route the DSA attention modules under `root` (all of them, or those at `paths`) through the runtime."""
    register()
    swapped = SparseSwap()
    for path in _dsa_modules(root) if paths is None else paths:
        attention = root.get_submodule(path) if path else root
        config = getattr(attention, "config", None)
        if config is None or not hasattr(attention, "indexer"):
            raise ValueError(f"{path or type(root).__name__} is not a DSA attention module (no config or indexer)")
        config._attn_implementation = ATTENTION
        swapped.attention.append(path)
        indexer = attention.indexer
        where = f"{path}.indexer" if path else "indexer"
        if indexer is None or isinstance(indexer, LightningIndexer):
            continue
        try:
            ours = LightningIndexer.adopt(indexer)
        except ValueError as err:
            swapped.kept[where] = str(err)
            continue
        ours.register_forward_hook(_count_indexer)
        replace_module(root, where, ours)
        swapped.indexers.append(where)
    return swapped
