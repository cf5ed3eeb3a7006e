"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): the mixing weights of N residual streams.

    post, comb, collapsed = hyper_connection_weights(streams, fn, base, scale, sinkhorn_iters=20, eps=1e-6,
                                                     norm_eps=1e-6)

A layer keeps N residual streams X (B, S, N, D) instead of one. Before each block the streams give, per token,

    r     = 1 / sqrt(mean(X_flat^2) + norm_eps)            X_flat = X as (B, S, N*D): one scalar per token
    m     = r * (X_flat @ fn^T)                             (B, S, 2N + N^2)
    pre   = sigmoid(m_pre  * scale_0 + base_pre) + eps      (B, S, N)
    post  = 2 sigmoid(m_post * scale_1 + base_post)         (B, S, N)
    comb  = Sinkhorn(softmax(m_comb * scale_2 + base_comb, rows) + eps)   (B, S, N, N)
    collapsed = sum_n pre_n X_n                             (B, S, D): the block's input

and the layer then adds post * block(collapsed) to comb^T @ X. Sinkhorn makes comb doubly stochastic:
normalise columns once, then (rows, columns) sinkhorn_iters - 1 times, each sum with eps added.

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
                             sinkhorn_iters: int, eps: float, norm_eps: float
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams (B, S, N, D); fn (2N + N^2, N*D), base (2N + N^2,), scale (3,). Returns (post (B, S, N),
    comb (B, S, N, N)) in fp32 and the collapsed block input (B, S, D) in the streams' dtype (module docstring)."""
    batch, seq, n, width = streams.shape
    if fn.shape != ((2 + n) * n, n * width) or base.shape != ((2 + n) * n,) or scale.shape != (3,):
        raise ValueError(f"fn {tuple(fn.shape)}, base {tuple(base.shape)}, scale {tuple(scale.shape)} do not "
                         f"fit {n} streams of width {width}")
    flat = streams.reshape(batch, seq, n * width).float()
    inv_rms = torch.rsqrt(torch.linalg.vecdot(flat, flat).unsqueeze(-1) / (n * width) + norm_eps)
    mixes = F.linear(flat, fn.float()) * inv_rms
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    scale = scale.float()
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax((comb_w * scale[2] + comb_b).view(batch, seq, n, n), dim=-1) + eps
    collapsed = (pre.unsqueeze(-2) @ flat.view(batch, seq, n, width)).squeeze(-2).to(streams.dtype)
    return post, sinkhorn(comb, sinkhorn_iters, eps), collapsed
