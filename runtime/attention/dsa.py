"""Run HuggingFace's DSA attention (DeepSeek-V3.2, GLM-MoE-DSA and kin) on the runtime, one module at a time.

    from runtime.attention import find_sparse_attention, swap_sparse_attention

    paths = find_sparse_attention(model)                   # DSA attention modules below a model (or any module)
    swap = swap_sparse_attention(model.get_submodule(p), path=p)   # a runtime.swap.Swap
    swap.parts    # {"indexer": "runtime"}, or {"indexer": why it stays HuggingFace code}
    swap.calls    # {"sparse": n, "dense": n, "indexer": n}: attentions over picked keys, over all keys, indexer runs
    swap.undo()

HuggingFace's DSA attention asks its indexer for each query's top-k keys, then, under eager / sdpa, scatters them
into a dense (B, 1, S, T) mask and attends to every key; under any other registered attention implementation it
passes them on as `indices=`. The swap uses that door for this one module: it gives the module its own copy of
its config whose `_attn_implementation` is `ATTENTION` (`dsa_attention`, registered once with transformers'
attention interface). The model's config, its mask builder and every other module keep what they had, so a
model (or another model built from the same config object) that was not swapped never runs this code. The
indexer is replaced by a runtime module that adopts the same projection modules (same names, same parameter
objects); an indexer the runtime does not reproduce on a probe input stays HuggingFace code (`parts`).

`dsa_attention` turns the picks the mask hides (future keys, padding, the spare picks of a query that sees fewer
than k keys) into -1 and runs `runtime.attention.sparse.sparse_attention`; a call without indices (a module whose
indexer is None) falls back to transformers' sdpa. Attention sinks come as transformers passes them, `s_aux=`
(one logit per head: gpt-oss, HunYuan-V4), and join the sparse softmax; sdpa has no sink term, so a call with
sinks and no indices attends to every visible key through the sparse attention instead. A query that sees no key
at all (a left-padding position) gets zeros, as under sdpa (HuggingFace's default); eager's finfo.min mask
averages every value there.
"""

from __future__ import annotations

import copy
import weakref

import torch
from torch import nn

from runtime.attention.indexer import LightningIndexer
from runtime.attention.sparse import sparse_attention
from runtime.sequence_split import active
from runtime.swap import SPARSE_ATTENTION, Swap

ATTENTION = "onboard_dsa"
PICK_CHUNK_BYTES = 16 * 2**20
# swapped attention module -> its handle's call counter, so the attention function (which transformers calls
# with the module) counts on the right handle; weak: a module that goes away takes its entry with it
_COUNTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _count(module: nn.Module, what: str) -> None:
    counter = _COUNTERS.get(module)
    if counter is not None:
        counter[what] += 1


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
    if (split := active()) is not None:  # context parallelism: the picks are global key positions
        if indices is None or dropout:
            raise ValueError("DSA under context parallelism needs the runtime's indexer and no attention dropout")
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        _count(module, "sparse")
        return split.sparse_attention(query, key, value, indices, scale, sinks).transpose(1, 2), None
    dense = indices is None
    if dense and sinks is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        _count(module, "dense")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dense:  # every key a pick; the mask hides what the query may not see
        batch, seq, keys_len = query.shape[0], query.shape[2], key.shape[2]
        indices = torch.arange(keys_len, device=query.device).expand(batch, seq, keys_len)
    if dropout:
        raise ValueError("sparse attention has no attention dropout; set the config's attention_dropout to 0")
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = sparse_attention(query, key, value, visible_picks(indices, attention_mask, key.shape[2]), scale, sinks)
    _count(module, "dense" if dense else "sparse")
    return out.transpose(1, 2), None


def register() -> None:
    """Make `ATTENTION` a name transformers' attention interface knows (idempotent)."""
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTENTION, dsa_attention)


def find_sparse_attention(root: nn.Module) -> list[str]:
    """Paths (below `root`) of the DSA attention modules: modules with a config and an indexer attribute (None on
    layers that reuse another layer's picks)."""
    return [name for name, m in root.named_modules()
            if hasattr(m, "indexer") and hasattr(m, "config") and (m.indexer is None or isinstance(m.indexer, nn.Module))]


def swap_sparse_attention(attention: nn.Module, *, path: str = "") -> Swap:
    """Route one DSA attention module through the runtime (see the module docstring). Raises ValueError,
    changing nothing, when the module has no config or indexer."""
    config = getattr(attention, "config", None)
    if config is None or not hasattr(attention, "indexer"):
        raise ValueError(f"{path or type(attention).__name__} is not a DSA attention module (no config or indexer)")
    register()
    swap = Swap(SPARSE_ATTENTION, path)
    own = copy.copy(config)  # this module's alone: the model's config keeps its implementation
    own._attn_implementation = ATTENTION
    swap.set(attention, "config", own)
    indexer = attention.indexer
    if indexer is not None and not isinstance(indexer, LightningIndexer):
        try:
            ours = LightningIndexer.adopt(indexer)
        except ValueError as err:
            swap.parts["indexer"] = str(err)
        else:
            swap.set(attention, "indexer", ours)
            hook = ours.register_forward_pre_hook(lambda *_: swap.count("indexer"))
            swap.on_undo(hook.remove)
            swap.parts["indexer"] = "runtime"
    _COUNTERS[attention] = swap.calls
    module = weakref.ref(attention)
    swap.on_undo(lambda: module() is not None and _COUNTERS.pop(module(), None))
    return swap
