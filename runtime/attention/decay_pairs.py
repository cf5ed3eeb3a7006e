"""Decayed pair products inside a chunk, forward and backward:

    X[i, j] = sum_d a_i[d] b_j[d] exp(G_i[d] - G_j[d])   for j <= i, else 0

G is the cumulative log decay inside the chunk (non-increasing along i): one value per row (a scalar gate per
head, Gated DeltaNet) or one per channel (KDA). With one value per row the decay is a (C, C) matrix and
X = (a b^T) * decay. Per channel, exp(G_i - G_j) cannot be split as exp(G_i) * exp(-G_j) over a whole chunk:
one factor overflows fp32 once the chunk decays by more than ~88 in log space, which real KDA gates reach.
So the chunk is cut into sub-blocks of `block` rows. A pair in different sub-blocks (row block I, column j
before it) is split around r = G at the first row of block I, where exp(G_i - r) <= 1 and exp(r - G_j) <= 1,
and becomes a matmul; pairs inside one sub-block take the decay elementwise.

Shapes: a (S, M, C, K) (S left-hand operands share b and G: the key-key and query-key products of the
gated delta rule are computed together), b (M, C, K), G (M, C, 1) or (M, C, K). X is (S, M, C, C).
"""

from __future__ import annotations

import math

import torch


def _block(chunk: int, block: int) -> int:
    return math.gcd(chunk, block)


def _row_factors(G: torch.Tensor, block: int):
    """exp(G_i - r_I) for each row (M, nb, s, K); exp(r_I - G_j) for columns before block I (M, nb, C, K);
    exp(G_i - G_j) inside each sub-block for j <= i (M, nb, s, s, K). Every entry is <= 1."""
    m, c, k = G.shape
    nb = c // block
    gb = G.view(m, nb, block, k)
    ref = gb[:, :, :1]
    fa = (gb - ref).exp()
    before = torch.arange(c, device=G.device) < torch.arange(nb, device=G.device)[:, None] * block
    fb = (ref - G[:, None]).masked_fill(~before[..., None], float("-inf")).exp()
    inside = torch.ones(block, block, dtype=torch.bool, device=G.device).tril()
    ed = (gb[:, :, :, None] - gb[:, :, None]).masked_fill(~inside[..., None], float("-inf")).exp()
    return fa, fb, ed


def _scalar_decay(G: torch.Tensor) -> torch.Tensor:
    g = G[..., 0]
    c = g.shape[-1]
    upper = torch.ones(c, c, dtype=torch.bool, device=G.device).triu(1)
    return (g[:, :, None] - g[:, None, :]).masked_fill(upper, float("-inf")).exp()


def decay_pairs(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, block: int = 8) -> torch.Tensor:
    if G.shape[-1] == 1:
        return (a @ b.transpose(-1, -2)) * _scalar_decay(G)
    s_, m, c, k = a.shape
    block = _block(c, block)
    nb = c // block
    fa, fb, ed = _row_factors(G, block)
    ab, bb = a.view(s_, m, nb, block, k), b.view(m, nb, block, k)
    x = ((ab * fa) @ (b[:, None] * fb).transpose(-1, -2)).view(s_, m, c, c)
    diag = torch.einsum("xmnid,mnijd,mnjd->xmnij", ab, ed, bb)
    torch.diagonal(x.view(s_, m, nb, block, nb, block), dim1=2, dim2=4).add_(diag.permute(0, 1, 3, 4, 2))
    return x


def decay_pairs_backward(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, dx: torch.Tensor, block: int = 8):
    """Gradients (da, db, dG) of sum(dx * X); dx must be zero above the diagonal. dG has G's shape."""
    if G.shape[-1] == 1:
        z = dx * _scalar_decay(G)
        da = z @ b
        db = (z.transpose(-1, -2) @ a).sum(0)
    else:
        s_, m, c, k = a.shape
        block = _block(c, block)
        nb = c // block
        fa, fb, ed = _row_factors(G, block)
        ab, bb = a.view(s_, m, nb, block, k), b.view(m, nb, block, k)
        rows = dx.view(s_, m, nb, block, c)
        # entries of dx on or above the diagonal block meet zero rows of fb, so no extra mask is needed
        da = (rows @ (b[:, None] * fb)) * fa
        # the S operands are summed inside one matmul by stacking them along the contracted dim
        lhs = rows.permute(1, 2, 4, 0, 3).reshape(m, nb, c, s_ * block)
        rhs = (ab * fa).permute(1, 2, 0, 3, 4).reshape(m, nb, s_ * block, k)
        db = ((lhs @ rhs) * fb).sum(1)
        dd = torch.diagonal(dx.view(s_, m, nb, block, nb, block), dim1=2, dim2=4).permute(0, 1, 4, 2, 3)
        da = da + torch.einsum("xmnij,mnijd,mnjd->xmnid", dd, ed, bb)
        db = db + torch.einsum("xmnij,mnijd,xmnid->mnjd", dd, ed, ab).reshape(m, c, k)
        da = da.reshape(s_, m, c, k)
    # dX_ij / dG_i = +X_ij terms, dX_ij / dG_j = -X_ij terms: both already sit in a * da and b * db
    dG = (a * da).sum(0) - b * db
    if G.shape[-1] == 1:
        dG = dG.sum(-1, keepdim=True)
    return da, db, dG
