"""The gated delta rule token by token: the definition that the chunked forms are tested against.

For each head, with state S (K x V), decay D_t = diag(exp(g_t)) (g_t one value per head, Gated DeltaNet,
or one per key channel, KDA) and write strength beta_t:

    S_t = D_t S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T (scale q_t)

Slow on purpose (a Python loop over tokens); only tests and small checks call it.
"""

from __future__ import annotations

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6, scale: float = 1.0) -> torch.Tensor:
    """scale * x / sqrt(sum x^2 + eps) over the last dim (flash-linear-attention's convention, eps inside the
    root); one pass to read x and one to write, the scale folded into the per-row factor."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return x * (torch.rsqrt(norm * norm + eps) * scale)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for half-precision inputs (the state is sensitive to rounding), fp64 stays fp64 (tests)."""
    return torch.promote_types(x.dtype, torch.float32)


def prepare_qk(query: torch.Tensor, key: torch.Tensor, num_v_heads: int, use_qk_l2norm: bool,
               scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys in the compute dtype, normalised if asked, queries scaled (default 1/sqrt(head dim)), and repeated
    when several value heads share one key head (grouped value attention, head h uses key head h // group)."""
    dtype = compute_dtype(query)
    query, key = query.to(dtype), key.to(dtype)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    if use_qk_l2norm:
        query, key = l2norm(query, scale=scale), l2norm(key)
    else:
        query = query * scale
    heads = key.shape[2]
    if num_v_heads % heads:
        raise ValueError(f"value heads ({num_v_heads}) must be a multiple of key heads ({heads})")
    if num_v_heads != heads:
        query = query.repeat_interleave(num_v_heads // heads, dim=2)
        key = key.repeat_interleave(num_v_heads // heads, dim=2)
    return query, key


def recurrent_gated_delta_rule(query, key, value, g, beta, *, scale: float | None = None, initial_state=None,
                               output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False):
    """Token-by-token gated delta rule. query/key (B, T, Hk, K), value (B, T, H, V), g (B, T, H) or
    (B, T, H, K) in log space, beta (B, T, H), initial_state (B, H, K, V). Returns (out (B, T, H, V) in the
    value dtype, final state or None)."""
    batch, length, heads, v_dim = value.shape
    q, k = prepare_qk(query, key, heads, use_qk_l2norm_in_kernel, scale)
    v, g, beta = (x.to(q.dtype) for x in (value, g, beta))
    if g.dim() == 3:
        g = g.unsqueeze(-1)
    state = (torch.zeros(batch, heads, k.shape[-1], v_dim, dtype=v.dtype, device=v.device) if initial_state is None
             else initial_state.to(v.dtype))
    outs = []
    for t in range(length):
        state = state * g[:, t].exp().unsqueeze(-1)
        predicted = (state * k[:, t].unsqueeze(-1)).sum(-2)
        delta = (v[:, t] - predicted) * beta[:, t].unsqueeze(-1)
        state = state + k[:, t].unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append((state * q[:, t].unsqueeze(-1)).sum(-2))
    out = torch.stack(outs, 1).to(value.dtype)
    return out, (state if output_final_state else None)
