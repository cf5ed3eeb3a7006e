"""DSA lightning indexer: which K keys each query attends to, scored chunk by chunk over the queries.

    indices = indexer_topk(q, k, weights, mask, top_k, scale)      # (B, S, K) int32, like HuggingFace's

    score[b, s, t] = sum_h weights[b, s, h] * relu(scale * q[b, s, h] . k[b, t]),  masked keys at -inf
    (scale None: relu(q . k), the scale being already in the weights, as HunYuan-V4 (hy_v4) computes it)

HuggingFace's indexer scores every query against every key at once ((B, S, H, T) fp32, then (B, S, T)); here
only one chunk of queries is scored at a time, so memory is the (B, S, K) result plus one (B, C, H, T) chunk.
Each chunk runs the same ops in the same order as HuggingFace, so the scores (hence the picks, ties included)
are the ones HuggingFace would get, as long as the backend's matmul gives a row the same bits whichever rows
share the call (true of the CPU BLAS here; tests check it). Masked keys score -inf (HuggingFace's additive
eager mask gives them finfo.min instead); either way, when fewer than K keys are visible the spare picks land
on masked keys, which the attention masks again, so the attended set is the same.

`LightningIndexer` stands in for a HuggingFace DSA indexer module (DeepSeek-V3.2, GLM-MoE-DSA, HunYuan-V4): it
adopts that module's projections as its own children (same parameter names and objects, no copies) and runs them
as HuggingFace does. Designs differ in three places, all read off a probe rather than the class: the rotary
layout (half-split or interleaved pairs), which head dims carry it (the leading or the trailing rope dims), and
where the softmax scale goes (onto the q.k products before the relu, or onto the head weights after it; equal
in exact arithmetic, not in bits, and the bits decide ties). `LightningIndexer.adopt` runs the module on a probe
input, records the operands of its two products (query x key, weights x scores) and keeps the variant whose own
operands are bit for bit the same, so the picks are too.
"""

from __future__ import annotations

from itertools import product

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from runtime.sequence_split import active

CHUNK_BYTES = 256 * 2**20  # one chunk of (B, C, H, T) fp32 scores


def indexer_topk(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor | None, top_k: int,
                 scale: float | None) -> torch.Tensor:
    """q (B, S, H, D), k (B, T, D), weights (B, S, H) fp32, mask (B, S, T) bool (True: visible) or additive,
    None for plain causal with the queries at the end of the keys; scale None: the q.k products go unscaled
    (the weights carry it). Returns (B, S, min(top_k, T)) int32."""
    batch, seq, heads, _ = q.shape
    keys_len = k.shape[1]
    kt = k.transpose(-1, -2).float().unsqueeze(1)
    out = torch.empty(batch, seq, min(top_k, keys_len), dtype=torch.int32, device=q.device)
    step = max(1, min(seq, CHUNK_BYTES // (2 * batch * heads * keys_len * 4)))
    for start in range(0, seq, step):
        end = min(start + step, seq)
        scores = torch.matmul(q[:, start:end].float(), kt)
        scores = F.relu(scores if scale is None else scores * scale)
        scores = torch.matmul(weights[:, start:end].unsqueeze(-2), scores).squeeze(-2)
        if mask is None:
            positions = torch.arange(start, end, device=q.device)[:, None] + (keys_len - seq)
            scores = scores.masked_fill(torch.arange(keys_len, device=q.device) > positions, float("-inf"))
        elif mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask[:, start:end], float("-inf"))
        else:
            scores = scores + mask[:, start:end]
        out[:, start:end] = scores.topk(out.shape[-1], dim=-1).indices
    return out


def _rotate_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # rotary over (x[:d/2], x[d/2:]) pairs; cos/sin hold each angle twice
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # rotary over (x0, x1), (x2, x3), ... pairs, written out as (all first, all second) halves
    cos, sin = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


ROTARY = {"half": _rotate_half_split, "interleaved": _rotate_interleaved}
ROPE_AT = ("leading", "trailing")  # which of a head's dims carry the rotary: the first rope dims or the last
SCALE_AT = ("scores", "weights")  # softmax scale on the q.k products (before relu) or on the head weights
PROJECTIONS = ("wq_b", "wk", "k_norm", "weights_proj")


class LightningIndexer(nn.Module):
    """A HuggingFace DSA indexer's projections, scored with `indexer_topk`. Same call as the module it replaces:
    (hidden_states, q_resid, (cos, sin), mask (B, S, T), position_ids, cache=None) -> (B, S, K) int32."""

    def __init__(self, hf: nn.Module, rotary: str, rope_at: str = "leading", scale_at: str = "scores"):
        super().__init__()
        for name in PROJECTIONS:
            setattr(self, name, getattr(hf, name))  # the module itself: parameter objects and names unchanged
        self.layer_idx = hf.layer_idx
        self.n_heads, self.head_dim = hf.n_heads, hf.head_dim
        self.rope_dim, self.index_topk = hf.qk_rope_head_dim, hf.index_topk
        self.softmax_scale = hf.softmax_scale
        self.rotary, self.rope_at, self.scale_at = rotary, rope_at, scale_at

    def extra_repr(self) -> str:
        return f"rotary={self.rotary}, rope_at={self.rope_at}, scale_at={self.scale_at}"

    def _rope(self, x, cos, sin):
        """Rotary on the rope dims of x (..., D), at the leading or the trailing end."""
        rotate = ROTARY[self.rotary]
        if self.rope_at == "leading":
            rot, rest = torch.split(x, [self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
            return torch.cat([rotate(rot, cos, sin), rest], dim=-1)
        rest, rot = torch.split(x, [self.head_dim - self.rope_dim, self.rope_dim], dim=-1)
        return torch.cat([rest, rotate(rot, cos, sin)], dim=-1)

    def project(self, hidden_states, q_resid, position_embeddings):
        """Per-head queries (B, S, H, D) and the shared keys (B, S, D), rotary on the rope dims."""
        batch, seq, _ = hidden_states.shape
        cos, sin = (x.unsqueeze(2) for x in position_embeddings)
        q = self.wq_b(q_resid).view(batch, seq, self.n_heads, self.head_dim)
        # the key norm in its own dtype (an fp32 norm in a bf16 model), the key back in the hidden dtype
        norm_dtype = getattr(getattr(self.k_norm, "weight", None), "dtype", hidden_states.dtype)
        k = self.k_norm(self.wk(hidden_states).to(norm_dtype)).to(hidden_states.dtype).unsqueeze(2)
        return self._rope(q, cos, sin), self._rope(k, cos, sin).squeeze(2)

    @torch.no_grad()  # as in HuggingFace: the picks are not differentiable and the indexer gets no gradient here
    def forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None, cache=None,
                **kwargs):
        if cache is None:
            cache = kwargs.get("past_key_values")
        q, k = self.project(hidden_states, q_resid, position_embeddings)
        if cache is not None:
            k = cache.update_indexer(k, self.layer_idx)
        weights = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float() * self.n_heads**-0.5
        scale = self.softmax_scale
        if self.scale_at == "weights":
            weights, scale = weights * self.softmax_scale, None
        if (split := active()) is not None:  # context parallelism: global picks among every rank's keys
            return split.index_topk(q, k, weights, self.index_topk, scale)
        return indexer_topk(q, k, weights, attention_mask, self.index_topk, scale)

    @classmethod
    def adopt(cls, hf: nn.Module) -> LightningIndexer:
        """The runtime indexer for `hf`, after checking on a probe that both multiply the same query by the same
        key, and the same head weights by the same scores; ValueError when no variant (rotary layout, rope dims,
        scale placement) reproduces them (an indexer of another design)."""
        missing = [n for n in (*PROJECTIONS, "n_heads", "head_dim", "qk_rope_head_dim", "index_topk",
                               "softmax_scale", "layer_idx") if not hasattr(hf, n)]
        if missing:
            raise ValueError(f"{type(hf).__name__} is not a lightning indexer the runtime knows (no {missing[0]})")
        inputs = _probe_inputs(hf)
        want = _products(hf, inputs)
        if len(want) == 2:
            for rotary, rope_at, scale_at in product(ROTARY, ROPE_AT, SCALE_AT):
                candidate = cls(hf, rotary, rope_at, scale_at)
                if _same(_products(candidate, inputs), want):
                    return candidate
        raise ValueError(f"{type(hf).__name__} does not compute the lightning indexer's query and key as the "
                         f"runtime does (half-split or interleaved rotary on the leading or trailing rope dims, "
                         f"softmax scale on the scores or on the head weights)")


class _Matmuls(TorchFunctionMode):
    """Records the operands of the first two torch.matmul calls: query x key, then head weights x scores."""

    def __init__(self):
        super().__init__()
        self.operands = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.matmul and len(self.operands) < 2:
            self.operands.append((args[0].detach().clone(), args[1].detach().clone()))
        return func(*args, **(kwargs or {}))


def _products(indexer: nn.Module, inputs) -> list[tuple[torch.Tensor, torch.Tensor]]:
    recorder = _Matmuls()
    with torch.no_grad(), recorder:
        indexer(*inputs)
    return recorder.operands


def _same(got, want) -> bool:
    """The runtime's first chunk of queries multiplies what HuggingFace multiplies for those queries (dim 1 of
    every operand runs over the queries, or is 1 for the keys)."""
    return len(got) == len(want) and all(a.shape == b[:, : a.shape[1]].shape and torch.equal(a, b[:, : a.shape[1]])
                                         for pair, other in zip(got, want) for a, b in zip(pair, other))


def _probe_inputs(hf: nn.Module):
    """Random inputs (random cos / sin too, so the rotary layouts differ) in the call the indexers share."""
    weight = hf.wk.weight
    gen = torch.Generator().manual_seed(0)
    seq = 5

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=weight.device, dtype=weight.dtype)

    hidden = rand(1, seq, weight.shape[1])
    q_resid = rand(1, seq, hf.wq_b.weight.shape[1])
    cos, sin = rand(1, seq, hf.qk_rope_head_dim), rand(1, seq, hf.qk_rope_head_dim)
    mask = torch.ones(1, seq, seq, dtype=torch.bool, device=weight.device)
    return hidden, q_resid, (cos, sin), mask, torch.arange(seq, device=weight.device)[None]
