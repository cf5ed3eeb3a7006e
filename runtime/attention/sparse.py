"""Sparse attention over each query's selected keys (DeepSeek Sparse Attention's second half).

    out = sparse_attention(q, k, v, indices, scale)

q (B, H, S, Dk), k (B, Hkv, T, Dk), v (B, Hkv, T, Dv) in HuggingFace's layout (H a multiple of Hkv: MHA, GQA,
MQA, and MLA's expanded per-head keys whose Dk differs from Dv); indices (B, S, K) integer key positions shared
by all heads of a query, -1 where a slot holds no key (a pick the mask forbids, or fewer than K valid keys).
Returns (B, H, S, Dv) in q's dtype. Softmax runs in fp32; a query with no key left gets zeros.

The reference never builds a query x key tensor: it walks the queries in chunks, gathers the K selected keys and
values of each chunk, and keeps only the output and one log-sum-exp per query and head for backward, which
recomputes the chunk's probabilities. Memory is O(S * K) for the indices plus one chunk of gathered keys.
Backend dispatch (`runtime.kernels.registry`, op "attention.sparse") may swap in a rendered Triton kernel.
"""

from __future__ import annotations

import torch

from runtime.kernels import registry

CHUNK_BYTES = 64 * 2**20  # working set of one query chunk (gathered keys and values, scores)


def _chunk_len(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, top_k: int) -> int:
    batch, heads = q.shape[:2]
    per_query = batch * top_k * (k.shape[1] * (k.shape[-1] + v.shape[-1]) + 4 * heads) * 4
    return max(1, min(q.shape[2], CHUNK_BYTES // max(per_query, 1)))


def _acc(x: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: fp32, or wider when the inputs are (float64 in gradient checks)."""
    return torch.promote_types(x.dtype, torch.float32)


def _gather(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x (B, Hkv, T, D) at rows (B, C, K) -> (B, C, Hkv, D, K) in the accumulation dtype."""
    batch = torch.arange(x.shape[0], device=x.device)[:, None, None]
    return x.transpose(1, 2)[batch, rows].to(_acc(x)).permute(0, 1, 3, 4, 2)


def _chunk_scores(q, k, indices, start, end, scale):
    """Scores of queries [start, end) against their picks: (B, C, Hkv, G, K), -inf where no key."""
    batch, heads, _, dk = q.shape
    kv_heads = k.shape[1]
    picks = indices[:, start:end].long()
    rows = picks.clamp(min=0)
    qc = q[:, :, start:end].to(_acc(q)).reshape(batch, kv_heads, heads // kv_heads, end - start, dk).permute(0, 3, 1, 2, 4)
    keys = _gather(k, rows)
    scores = torch.matmul(qc, keys) * scale
    scores = scores.masked_fill((picks < 0)[:, :, None, None, :], float("-inf"))
    return qc, keys, rows, scores


def _probabilities(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    # a query with no valid key has lse -inf: its probabilities are zero, not NaN
    finite = torch.isfinite(lse)
    return torch.exp(scores - torch.where(finite, lse, 0.0)[..., None]).masked_fill(~finite[..., None], 0.0)


class SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, indices, scale: float):
        batch, heads, seq, _ = q.shape
        kv_heads, dv = k.shape[1], v.shape[-1]
        out = q.new_empty(batch, seq, heads, dv)  # returned as a (B, H, S, Dv) view: HF transposes it back
        lse = torch.empty(batch, seq, kv_heads, heads // kv_heads, dtype=_acc(q), device=q.device)
        step = _chunk_len(q, k, v, indices.shape[-1])
        for start in range(0, seq, step):
            end = min(start + step, seq)
            _, _, rows, scores = _chunk_scores(q, k, indices, start, end, scale)
            chunk_lse = torch.logsumexp(scores, dim=-1)
            probs = _probabilities(scores, chunk_lse)
            values = _gather(v, rows).transpose(-1, -2)  # (B, C, Hkv, K, Dv)
            out[:, start:end] = torch.matmul(probs, values).reshape(batch, end - start, heads, dv).to(out.dtype)
            lse[:, start:end] = chunk_lse
        ctx.save_for_backward(q, k, v, indices, out, lse)
        ctx.scale = scale
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, indices, out, lse = ctx.saved_tensors
        batch, heads, seq, qk_dim = q.shape
        kv_heads, keys_len, dv = k.shape[1], k.shape[2], v.shape[-1]
        groups = heads // kv_heads
        grad_out = grad_out.transpose(1, 2)  # (B, S, H, Dv) like `out`
        delta = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1).view(batch, seq, kv_heads, groups)
        dq = torch.empty_like(q, dtype=lse.dtype)
        # key and value gradients accumulate over every query that picked them: (B*T, Hkv, D) rows
        dk = torch.zeros(batch * keys_len, kv_heads, qk_dim, dtype=lse.dtype, device=q.device)
        dv_acc = torch.zeros(batch * keys_len, kv_heads, dv, dtype=lse.dtype, device=q.device)
        offsets = (torch.arange(batch, device=q.device) * keys_len)[:, None, None]
        step = _chunk_len(q, k, v, indices.shape[-1])
        for start in range(0, seq, step):
            end = min(start + step, seq)
            qc, keys, rows, scores = _chunk_scores(q, k, indices, start, end, ctx.scale)
            probs = _probabilities(scores, lse[:, start:end])
            values = _gather(v, rows)  # (B, C, Hkv, Dv, K)
            go = grad_out[:, start:end].to(lse.dtype).reshape(batch, end - start, kv_heads, groups, dv)
            dscores = probs * (torch.matmul(go, values) - delta[:, start:end, ..., None]) * ctx.scale
            dq[:, :, start:end] = torch.matmul(dscores, keys.transpose(-1, -2)).reshape(
                batch, end - start, heads, qk_dim).transpose(1, 2)
            flat = (rows + offsets).reshape(-1)
            dk.index_add_(0, flat, torch.matmul(dscores.transpose(-1, -2), qc).permute(0, 1, 3, 2, 4).reshape(
                flat.numel(), kv_heads, qk_dim))
            dv_acc.index_add_(0, flat, torch.matmul(probs.transpose(-1, -2), go).permute(0, 1, 3, 2, 4).reshape(
                flat.numel(), kv_heads, dv))
        dk = dk.view(batch, keys_len, kv_heads, qk_dim).transpose(1, 2)
        dv_acc = dv_acc.view(batch, keys_len, kv_heads, dv).transpose(1, 2)
        return dq.to(q.dtype), dk.to(k.dtype), dv_acc.to(v.dtype), None, None


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("sparse attention takes q (B, H, S, Dk), k (B, Hkv, T, Dk), v (B, Hkv, T, Dv)")
    if q.shape[1] % k.shape[1] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"sparse attention: heads or head dims do not line up: q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if indices.shape[:2] != (q.shape[0], q.shape[2]) or indices.dim() != 3:
        raise ValueError(f"sparse attention: indices {tuple(indices.shape)} should be (batch, queries, top_k) = "
                         f"({q.shape[0]}, {q.shape[2]}, K)")


def sparse_attention_reference(q, k, v, indices, scale: float) -> torch.Tensor:
    return SparseAttention.apply(q, k, v, indices, scale)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Softmax attention of each query over the keys `indices` names (-1: none); see the module docstring."""
    check_shapes(q, k, v, indices)
    return registry.lookup("attention.sparse", sparse_attention_reference)(q, k, v, indices, scale)
