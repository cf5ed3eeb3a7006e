"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): the mixing weights of N residual streams.

    post, comb, collapsed = hyper_connection_weights(streams, fn, base, scale, sinkhorn_iters=20, eps=1e-6,
                                                     norm_eps=1e-6)
    post, collapsed = hyper_connection_weights(streams, fn, base, scale, eps=1e-6, norm_eps=1e-6,
                                               post_magnitude=2.0, post_eps=1e-6)      # no comb (HY-V4)

A layer keeps N residual streams X (B, S, N, D) instead of one. Before each block the streams give, per token,

    r     = 1 / sqrt(mean(X_flat^2) + norm_eps)            X_flat = X as (B, S, N*D): one scalar per token
    m     = r * (X_flat @ fn^T)                             (B, S, 2N + N^2)
    pre   = sigmoid(m_pre  * scale_0 + base_pre) + eps      (B, S, N)
    post  = 2 sigmoid(m_post * scale_1 + base_post)         (B, S, N)
    comb  = Sinkhorn(softmax(m_comb * scale_2 + base_comb, rows) + eps)   (B, S, N, N)
    collapsed = sum_n pre_n X_n                             (B, S, D): the block's input

and the layer then adds post * block(collapsed) to comb^T @ X. Sinkhorn makes comb doubly stochastic:
normalise columns once, then (rows, columns) sinkhorn_iters - 1 times, each sum with eps added. HY-V4 keeps
the form without comb: fn projects to pre and post only, post = post_magnitude * sigmoid(..) + post_eps, and the
layer adds post * block(collapsed) to X itself.

transformers normalises X_flat (all N*D values of every token) and then projects it; the norm is one scalar per
token, so it commutes with the projection, and here it scales the 2N + N^2 projected values instead: the
normalised (B, S, N*D) copy of the streams is never made, forward or backward. The collapse is one batched
(1 x N) @ (N x D) product per token instead of an elementwise (B, S, N, D) product and a sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Columns, then (rows, columns) iters - 1 times, of a positive (.., N, N) matrix; each sum has eps added."""
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


def hyper_connection_weights(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
                             eps: float, norm_eps: float, sinkhorn_iters: int = 0, post_magnitude: float = 2.0,
                             post_eps: float = 0.0) -> tuple[torch.Tensor, ...]:
    """streams (B, S, N, D). With comb: fn (2N + N^2, N*D), base (2N + N^2,), scale (3,); returns (post (B, S, N),
    comb (B, S, N, N)) in fp32 (fp64 where the parameters are) and the collapsed block input (B, S, D) in the
    streams' dtype (module docstring).
    Without comb (HY-V4's form): fn (2N, N*D), base (2N,), scale (2,); returns (post, collapsed), post =
    post_magnitude * sigmoid(...) + post_eps."""
    batch, seq, n, width = streams.shape
    rows = fn.shape[0]
    with_comb = rows == (2 + n) * n and n > 0
    if (not with_comb and rows != 2 * n) or fn.shape[1] != n * width or base.shape != (rows,) \
            or scale.shape != (3 if with_comb else 2,):
        raise ValueError(f"fn {tuple(fn.shape)}, base {tuple(base.shape)}, scale {tuple(scale.shape)} do not "
                         f"fit {n} streams of width {width}")
    flat = streams.reshape(batch, seq, n * width).float()
    inv_rms = torch.rsqrt(torch.linalg.vecdot(flat, flat).unsqueeze(-1) / (n * width) + norm_eps)
    mixes = F.linear(flat, fn.float()) * inv_rms
    # the weights in fp32, or in the parameters' dtype where that is wider (fp64), as transformers promotes them
    weights = torch.promote_types(torch.float32, scale.dtype)
    scale, base = scale.to(weights), base.to(weights)
    pre = torch.sigmoid(mixes[..., :n] * scale[0] + base[:n]) + eps
    post = post_magnitude * torch.sigmoid(mixes[..., n:2 * n] * scale[1] + base[n:2 * n]) + post_eps
    collapsed = (pre.unsqueeze(-2) @ streams.to(weights)).squeeze(-2).to(streams.dtype)
    if not with_comb:
        return post, collapsed
    comb = torch.softmax((mixes[..., 2 * n:] * scale[2] + base[2 * n:]).view(batch, seq, n, n), dim=-1) + eps
    return post, sinkhorn(comb, sinkhorn_iters, eps), collapsed
