"""Sparse attention over each query's selected keys (DeepSeek Sparse Attention's second half).

    out = sparse_attention(q, k, v, indices, scale)
    out = sparse_attention(q, k, v, indices, scale, sinks)   # sinks (H,): per-head logits of an attention sink

q (B, H, S, Dk), k (B, Hkv, T, Dk), v (B, Hkv, T, Dv) in HuggingFace's layout (H a multiple of Hkv: MHA, GQA,
MQA, and MLA's expanded per-head keys whose Dk differs from Dv); indices (B, S, K) integer key positions shared
by all heads of a query, -1 where a slot holds no key (a pick the mask forbids, or fewer than K valid keys).
Returns (B, H, S, Dv) in q's dtype. Softmax runs in fp32; a query with no key left gets zeros.

Sinks (gpt-oss, HunYuan-V4): one learned logit per head joins every query's softmax as an extra key with no
value: it takes probability mass and gives nothing back. The chunks softmax over the picks as without it; each
query's output is then rescaled by exp(lse - lse'), lse' = logaddexp(lse, sink), and lse' is what backward
reads, so the picks' probabilities it recomputes are the ones with the sink. The sink's gradient is
-sum over queries of p_sink * (grad_out . out), p_sink = exp(sink - lse').

The reference never builds a query x key tensor: it walks the queries in chunks (`runtime.attention.sparse_chunks`:
gathering each query's picked keys, or, while the context is short against K, one GEMM over all keys masked to
the picks), and keeps only the output and one log-sum-exp per query and head for backward, which recomputes each
chunk's probabilities. Memory: the (B, S, K) indices, the output, and one bounded chunk.
Backend dispatch (`runtime.kernels.registry`, op "attention.sparse") may run a rendered Triton kernel instead,
sinks included when the kernel takes a `sinks` argument; a kernel rendered before the template had a sink term
(an older bundle) still runs attention without sinks, and attention with sinks then runs this reference.
"""

from __future__ import annotations

import functools
import inspect

import torch

from runtime.attention.sparse_chunks import chunk_walker
from runtime.kernels import registry


def _with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's output (B, C, H, Dv) and lse (B, C, H) over the picks -> the same with each head's sink in the
    softmax. A query whose picks and sink are all -inf keeps zeros and -inf."""
    total = torch.logaddexp(lse, sinks.to(lse.dtype))
    share = torch.where(torch.isfinite(total), torch.exp(lse - total), 0.0)
    return out * share[..., None], total


def _sink_grad(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks (H,): -sum over batch and queries of p_sink * delta, lse and delta (B, S, H)."""
    p_sink = torch.where(torch.isfinite(lse), torch.exp(sinks.to(lse.dtype) - lse), 0.0)
    return -(p_sink * delta).sum((0, 1)).to(sinks.dtype)


class SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, indices, scale: float, sinks=None):
        batch, heads, seq, _ = q.shape
        chunks = chunk_walker(q, k, v, indices, scale)
        out = q.new_empty(batch, seq, heads, v.shape[-1])  # returned as a (B, H, S, Dv) view: HF transposes it back
        lse = torch.empty(batch, seq, heads, dtype=chunks.dk.dtype, device=q.device)
        for start in range(0, seq, chunks.step):
            end = min(start + chunks.step, seq)
            chunk_out, chunk_lse = chunks.forward(start, end)
            if sinks is not None:
                chunk_out, chunk_lse = _with_sinks(chunk_out, chunk_lse, sinks)
            out[:, start:end], lse[:, start:end] = chunk_out, chunk_lse
        ctx.save_for_backward(q, k, v, indices, out, lse, sinks)
        ctx.scale = scale
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, indices, out, lse, sinks = ctx.saved_tensors
        seq = q.shape[2]
        chunks = chunk_walker(q, k, v, indices, ctx.scale)
        grad_out = grad_out.transpose(1, 2).to(lse.dtype)  # (B, S, H, Dv) like `out`
        delta = (grad_out * out.to(lse.dtype)).sum(-1)
        dq = torch.empty_like(q, dtype=lse.dtype)
        for start in range(0, seq, chunks.step):
            end = min(start + chunks.step, seq)
            dq[:, :, start:end] = chunks.backward(start, end, grad_out[:, start:end], delta[:, start:end],
                                                  lse[:, start:end])
        dk, dv = chunks.key_grads()
        dsinks = _sink_grad(sinks, lse, delta) if sinks is not None and ctx.needs_input_grad[5] else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, dsinks


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                 sinks: torch.Tensor | None = None) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("sparse attention takes q (B, H, S, Dk), k (B, Hkv, T, Dk), v (B, Hkv, T, Dv)")
    if q.shape[1] % k.shape[1] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"sparse attention: heads or head dims do not line up: q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if indices.shape[:2] != (q.shape[0], q.shape[2]) or indices.dim() != 3:
        raise ValueError(f"sparse attention: indices {tuple(indices.shape)} should be (batch, queries, top_k) = "
                         f"({q.shape[0]}, {q.shape[2]}, K)")
    if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"sparse attention: sinks {tuple(sinks.shape)} should hold one logit per head ({q.shape[1]},)")


def sparse_attention_reference(q, k, v, indices, scale: float, sinks=None) -> torch.Tensor:
    return SparseAttention.apply(q, k, v, indices, scale, sinks)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                     scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of each query over the keys `indices` names (-1: none), and each head's sink logit when
    `sinks` (H,) is given; see the module docstring."""
    check_shapes(q, k, v, indices, sinks)
    kernel = registry.lookup("attention.sparse", sparse_attention_reference)
    if sinks is None:
        return kernel(q, k, v, indices, scale)
    if not takes_sinks(kernel):
        kernel = sparse_attention_reference
    return kernel(q, k, v, indices, scale, sinks)


@functools.cache
def takes_sinks(kernel) -> bool:
    """Whether a registered kernel has a sink term: a `sinks` parameter. Asked by signature, not by backend, so
    a kernel a bundle rendered before the template had sinks keeps the sink-free attention it can do."""
    try:
        return "sinks" in inspect.signature(kernel).parameters
    except (TypeError, ValueError):  # a builtin or extension without a signature: assume the old contract
        return False
