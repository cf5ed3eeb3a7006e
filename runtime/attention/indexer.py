"""DSA lightning indexer: which K keys each query attends to, scored chunk by chunk over the queries.

    indices = indexer_topk(q, k, weights, mask, top_k, scale)      # (B, S, K) int32, like HuggingFace's

    score[b, s, t] = sum_h weights[b, s, h] * relu(scale * q[b, s, h] . k[b, t]),  masked keys at -inf

HuggingFace's indexer scores every query against every key at once ((B, S, H, T) fp32, then (B, S, T)); here
only one chunk of queries is scored at a time, so memory is the (B, S, K) result plus one (B, C, H, T) chunk.
Each chunk runs the same ops in the same order as HuggingFace, so the scores (hence the picks, ties included)
are the ones HuggingFace would get, as long as the backend's matmul gives a row the same bits whichever rows
share the call (true of the CPU BLAS here; tests check it). Masked keys score -inf (HuggingFace's additive
eager mask gives them finfo.min instead); either way, when fewer than K keys are visible the spare picks land
on masked keys, which the attention masks again, so the attended set is the same.

`LightningIndexer` stands in for a HuggingFace DSA indexer module (DeepSeek-V3.2, GLM-MoE-DSA): it adopts that
module's projections as its own children (same parameter names and objects, no copies) and runs them as
HuggingFace does; `LightningIndexer.adopt` first checks on a probe input that it computes the same query and
key as the module it replaces, which also tells the rotary layout (half-split or interleaved pairs) apart.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

CHUNK_BYTES = 256 * 2**20  # one chunk of (B, C, H, T) fp32 scores


def indexer_topk(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor | None, top_k: int,
                 scale: float) -> torch.Tensor:
    """q (B, S, H, D), k (B, T, D), weights (B, S, H) fp32, mask (B, S, T) bool (True: visible) or additive,
    None for plain causal with the queries at the end of the keys. Returns (B, S, min(top_k, T)) int32."""
    batch, seq, heads, _ = q.shape
    keys_len = k.shape[1]
    kt = k.transpose(-1, -2).float().unsqueeze(1)
    out = torch.empty(batch, seq, min(top_k, keys_len), dtype=torch.int32, device=q.device)
    step = max(1, min(seq, CHUNK_BYTES // (2 * batch * heads * keys_len * 4)))
    for start in range(0, seq, step):
        end = min(start + step, seq)
        scores = F.relu(torch.matmul(q[:, start:end].float(), kt) * scale)
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
PROJECTIONS = ("wq_b", "wk", "k_norm", "weights_proj")


class LightningIndexer(nn.Module):
    """A HuggingFace DSA indexer's projections, scored with `indexer_topk`. Same call as the module it replaces:
    (hidden_states, q_resid, (cos, sin), mask (B, S, T), position_ids, cache=None) -> (B, S, K) int32."""

    def __init__(self, hf: nn.Module, rotary: str):
        super().__init__()
        for name in PROJECTIONS:
            setattr(self, name, getattr(hf, name))  # the module itself: parameter objects and names unchanged
        self.layer_idx = hf.layer_idx
        self.n_heads, self.head_dim = hf.n_heads, hf.head_dim
        self.rope_dim, self.index_topk = hf.qk_rope_head_dim, hf.index_topk
        self.softmax_scale = hf.softmax_scale
        self.rotary = rotary

    def project(self, hidden_states, q_resid, position_embeddings):
        """Per-head queries (B, S, H, D) and the shared keys (B, S, D), rotary on the leading rope dims."""
        batch, seq, _ = hidden_states.shape
        cos, sin = (x.unsqueeze(2) for x in position_embeddings)
        rotate = ROTARY[self.rotary]
        split = [self.rope_dim, self.head_dim - self.rope_dim]
        q_rot, q_pass = torch.split(self.wq_b(q_resid).view(batch, seq, self.n_heads, self.head_dim), split, dim=-1)
        k_rot, k_pass = torch.split(self.k_norm(self.wk(hidden_states)).unsqueeze(2), split, dim=-1)
        q = torch.cat([rotate(q_rot, cos, sin), q_pass], dim=-1)
        k = torch.cat([rotate(k_rot, cos, sin), k_pass], dim=-1).squeeze(2)
        return q, k

    @torch.no_grad()  # as in HuggingFace: the picks are not differentiable and the indexer gets no gradient here
    def forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None, cache=None,
                **kwargs):
        if cache is None:
            cache = kwargs.get("past_key_values")
        q, k = self.project(hidden_states, q_resid, position_embeddings)
        if cache is not None:
            k = cache.update_indexer(k, self.layer_idx)
        weights = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float() * self.n_heads**-0.5
        return indexer_topk(q, k, weights, attention_mask, self.index_topk, self.softmax_scale)

    @classmethod
    def adopt(cls, hf: nn.Module) -> LightningIndexer:
        """The runtime indexer for `hf`, after checking on a probe that both compute the same query and key;
        ValueError when no rotary layout reproduces them (an indexer of another design)."""
        missing = [n for n in (*PROJECTIONS, "n_heads", "head_dim", "qk_rope_head_dim", "index_topk",
                               "softmax_scale", "layer_idx") if not hasattr(hf, n)]
        if missing:
            raise ValueError(f"{type(hf).__name__} is not a lightning indexer the runtime knows (no {missing[0]})")
        probe = _probe(hf)
        for rotary in ROTARY:
            candidate = cls(hf, rotary)
            with torch.no_grad():
                q, k = candidate.project(*probe[:3])
            if probe[3] is not None and torch.equal(q.float(), probe[3]) and torch.equal(k.float(), probe[4]):
                return candidate
        raise ValueError(f"{type(hf).__name__} does not compute the lightning indexer's query and key as the "
                         f"runtime does (half-split or interleaved rotary)")


class _FirstMatmul(TorchFunctionMode):
    """Records the operands of the first torch.matmul: the indexer's query x key product."""

    def __init__(self):
        super().__init__()
        self.operands = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.matmul and self.operands is None:
            self.operands = (args[0].detach().clone(), args[1].detach().clone())
        return func(*args, **(kwargs or {}))


def _probe(hf: nn.Module):
    """Random inputs (random cos / sin too, so the two rotary layouts differ) and HuggingFace's query and key."""
    weight = hf.wk.weight
    gen = torch.Generator().manual_seed(0)
    seq = 5

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=weight.device, dtype=weight.dtype)

    hidden = rand(1, seq, weight.shape[1])
    q_resid = rand(1, seq, hf.wq_b.weight.shape[1])
    cos, sin = rand(1, seq, hf.qk_rope_head_dim), rand(1, seq, hf.qk_rope_head_dim)
    mask = torch.ones(1, seq, seq, dtype=torch.bool, device=weight.device)
    recorder = _FirstMatmul()
    with torch.no_grad(), recorder:
        hf(hidden, q_resid, (cos, sin), mask, torch.arange(seq, device=weight.device)[None])
    if recorder.operands is None:
        return hidden, q_resid, (cos, sin), None, None
    q, kt = recorder.operands  # (B, S, H, D) and (B, 1, D, T)
    return hidden, q_resid, (cos, sin), q, kt.squeeze(1).transpose(-1, -2)
