"""Decayed pair products inside a chunk, forward and backward:

    X[i, j] = sum_d a_i[d] b_j[d] exp(G_i[d] - G_j[d])   for j <= i, else 0

G is the cumulative log decay inside the chunk (non-increasing along i): one value per row (a scalar gate per
head, Gated DeltaNet) or one per channel (KDA). With one value per row the decay is a (C, C) matrix and
X = (a b^T) * decay.

Per channel, exp(G_i - G_j) cannot be split as exp(G_i) * exp(-G_j) over a whole chunk: one factor overflows
fp32 once the chunk decays by more than ~88 in log space, which real KDA gates reach. So X is built level by
level over a binary split of the chunk. At the level of blocks of `size` rows, each aligned range of 2 * size
rows pairs its right half (rows i) with its left half (columns j < i); split at r = G of the right half's
first row, exp(G_i - r) <= 1 and exp(r - G_j) <= 1, so the block is one matmul of rescaled rows with no
overflow whatever the decay. Every pair i > j is in exactly one such block; the diagonal is a_i . b_i.
log2(C) levels, each touching every row once: no elementwise (C, C, K) tensor is ever formed.

Shapes: a (S, M, C, K) (S left-hand operands share b and G: the key-key and query-key products of the
gated delta rule are computed together), b (M, C, K), G (M, C, 1) or (M, C, K). X is (S, M, C, C).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _scalar_decay(G: torch.Tensor) -> torch.Tensor:
    g = G[..., 0]
    c = g.shape[-1]
    upper = torch.ones(c, c, dtype=torch.bool, device=G.device).triu(1)
    return (g[:, :, None] - g[:, None, :]).masked_fill(upper, float("-inf")).exp()


def _pad_to_power_of_two(a, b, G):
    """Zero rows past the chunk (G repeats its last value there, so every factor stays <= 1)."""
    c = G.shape[-2]
    pad = (1 << (c - 1).bit_length()) - c
    if not pad:
        return a, b, G
    return F.pad(a, (0, 0, 0, pad)), F.pad(b, (0, 0, 0, pad)), F.pad(G, (0, 0, 0, pad), mode="replicate")


def _sibling_blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    """View (..., n, size, size) of x (..., C, C): rows of the right half, columns of the left half of each
    aligned range of 2 * size; writes go through to x."""
    *lead, c, _ = x.shape
    n = c // (2 * size)
    d = len(lead)
    blocks = torch.diagonal(x.view(*lead, n, 2, size, n, 2, size), dim1=d, dim2=d + 3)
    return blocks[..., 1, :, 0, :, :].movedim(-1, -3)


def _level(a, b, G, size: int):
    """Row factors of the right halves, column factors of the left halves, and the rescaled operands."""
    s_, m, c, k = a.shape
    n = c // (2 * size)
    g = G.view(m, n, 2, size, k)
    ref = g[:, :, 1, :1]
    right = (g[:, :, 1] - ref).exp()
    left = (ref - g[:, :, 0]).exp()
    a_right = a.view(s_, m, n, 2, size, k)[:, :, :, 1] * right
    b_left = b.view(m, n, 2, size, k)[:, :, 0] * left
    return right, left, a_right, b_left


def decay_pairs(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    if G.shape[-1] == 1:
        return (a @ b.transpose(-1, -2)) * _scalar_decay(G)
    c = G.shape[-2]
    a, b, G = _pad_to_power_of_two(a, b, G)
    x = a.new_zeros(*a.shape[:-1], a.shape[-2])
    x.diagonal(dim1=-2, dim2=-1).copy_((a * b).sum(-1))
    size = 1
    while size < x.shape[-1]:
        _, _, a_right, b_left = _level(a, b, G, size)
        _sibling_blocks(x, size).copy_(a_right @ b_left.transpose(-1, -2))
        size *= 2
    return x[..., :c, :c]


def decay_pairs_backward(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, dx: torch.Tensor):
    """Gradients (da, db, dG) of sum(dx * X); dx must be zero above the diagonal. dG has G's shape."""
    if G.shape[-1] == 1:
        z = dx * _scalar_decay(G)
        da = z @ b
        db = (z.transpose(-1, -2) @ a).sum(0)
    else:
        c = G.shape[-2]
        a, b, G = _pad_to_power_of_two(a, b, G)
        s_, m, p, k = a.shape
        dx = F.pad(dx, (0, p - c, 0, p - c))
        diag = dx.diagonal(dim1=-2, dim2=-1).unsqueeze(-1)
        da, db = diag * b, (diag * a).sum(0)
        size = 1
        while size < p:
            n = p // (2 * size)
            right, left, a_right, b_left = _level(a, b, G, size)
            blocks = _sibling_blocks(dx, size)
            da.view(s_, m, n, 2, size, k)[:, :, :, 1] += (blocks @ b_left) * right
            db.view(m, n, 2, size, k)[:, :, 0] += (blocks.transpose(-1, -2) @ a_right).sum(0) * left
            size *= 2
        a, b, da, db = a[..., :c, :], b[..., :c, :], da[..., :c, :], db[..., :c, :]
    # dX_ij / dG_i brings +X_ij terms and dX_ij / dG_j -X_ij terms: both already sit in a * da and b * db
    dG = (a * da).sum(0) - b * db
    if G.shape[-1] == 1:
        dG = dG.sum(-1, keepdim=True)
    return da, db, dG
