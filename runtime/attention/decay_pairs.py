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

Shapes: `lhs` a list of (M, C, K) (left-hand operands that share b and G: the key-key and query-key
products of the gated delta rule are computed together, the decay factors once), b (M, C, K), G (M, C, 1) or
(M, C, K). Returns one (M, C, C) X per left-hand operand.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from runtime.subnormals import exp_or_zero, exp_or_zero_, floor_for

# Decays exp(x) with log x below LOG_DECAY_ZERO are exact zeros. What they would scale is below fp32's resolution
# next to the unit decay every token's own term carries (e^-24 ~ 4e-11), so dropping them moves no result; and
# every decay that stays is at least e^-24, so a product of up to three of them is at least e^-72 (~5e-32), still
# a normal float. Tiny nonzero decays (a clamp, or exp down to e^-87) make subnormal products, which this CPU computes ~6x slower.
LOG_DECAY_ZERO = -24.0  # for fp32 (fp64: see runtime.subnormals.floor_for)


def decay_zero(dtype: torch.dtype) -> float:
    """The smallest decay kept, as a value: products of decays below it are dropped too."""
    return math.exp(floor_for(dtype, LOG_DECAY_ZERO))


def decay_exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for log decays x <= 0, exactly 0 where x < LOG_DECAY_ZERO (differentiable: zero gradient there)."""
    return exp_or_zero(x, LOG_DECAY_ZERO)


def _scalar_decay(G: torch.Tensor) -> torch.Tensor:
    g = G[..., 0]
    c = g.shape[-1]
    # above the diagonal the exponent is >= 0 and the pair does not exist: exp there would overflow, slowly
    upper = torch.ones(c, c, dtype=torch.bool, device=G.device).triu(1)
    diff = g[:, :, None] - g[:, None, :]
    return exp_or_zero_(diff.masked_fill_(upper, -math.inf), LOG_DECAY_ZERO)


def _pad_to_power_of_two(lhs, b, G):
    """Zero rows past the chunk (G repeats its last value there, so every factor stays <= 1)."""
    c = G.shape[-2]
    pad = (1 << (c - 1).bit_length()) - c
    if not pad:
        return lhs, b, G
    rows = (0, 0, 0, pad)
    return [F.pad(a, rows) for a in lhs], F.pad(b, rows), F.pad(G, rows, mode="replicate")


def _sibling_blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    """View (M, n, size, size) of x (M, C, C): rows of the right half, columns of the left half of each
    aligned range of 2 * size; writes go through to x."""
    m, c, _ = x.shape
    n = c // (2 * size)
    blocks = torch.diagonal(x.view(m, n, 2, size, n, 2, size), dim1=1, dim2=4)
    return blocks[:, 1, :, 0, :, :].movedim(-1, 1)


def _levels(G: torch.Tensor):
    """For each level (block size 1, 2, 4, ...): (size, row factors of the right halves (M, n, size, K),
    column factors of the left halves)."""
    m, c, k = G.shape
    size = 1
    while size < c:
        g = G.view(m, c // (2 * size), 2, size, k)
        ref = g[:, :, 1, :1]
        yield size, decay_exp(g[:, :, 1] - ref), decay_exp(ref - g[:, :, 0])
        size *= 2


def _right(x: torch.Tensor, size: int) -> torch.Tensor:
    m, c, k = x.shape
    return x.view(m, c // (2 * size), 2, size, k)[:, :, 1]


def _left(x: torch.Tensor, size: int) -> torch.Tensor:
    m, c, k = x.shape
    return x.view(m, c // (2 * size), 2, size, k)[:, :, 0]


def decay_pairs(lhs: list[torch.Tensor], b: torch.Tensor, G: torch.Tensor) -> list[torch.Tensor]:
    if G.shape[-1] == 1:
        decay = _scalar_decay(G)
        bt = b.transpose(-1, -2)
        return [(a @ bt).mul_(decay) for a in lhs]
    c = G.shape[-2]
    lhs, b, G = _pad_to_power_of_two(lhs, b, G)
    xs = [a.new_zeros(*a.shape[:-1], a.shape[-2]) for a in lhs]
    for x, a in zip(xs, lhs):
        x.diagonal(dim1=-2, dim2=-1).copy_((a * b).sum(-1))
    for size, right, left in _levels(G):
        b_left = (_left(b, size) * left).transpose(-1, -2)
        for x, a in zip(xs, lhs):
            _sibling_blocks(x, size).copy_((_right(a, size) * right) @ b_left)
    return [x[:, :c, :c] for x in xs]


def straddling(y: torch.Tensor) -> torch.Tensor:
    """d_t = sum over pairs j < t <= i of y[i, j], for y (M, C, C) zero above the diagonal: the gradient of
    sum(y-weighted pair terms exp(G_i - G_j)) with respect to the per-token log decay g_t (G = cumsum g).
    Summed directly over the pairs that straddle t, never as a difference of two running sums: with strong
    decays those sums are large and the gradient small, and their difference would be rounding noise."""
    below = y.flip(-2).cumsum(-2).flip(-2)  # below[t, j] = sum_{i >= t} y[i, j]
    c = y.shape[-1]
    left_of = torch.ones(c, c, dtype=torch.bool, device=y.device).tril(-1)  # j < t
    return (below * left_of).sum(-1)


def before(x: torch.Tensor) -> torch.Tensor:
    """Along dim -2 (the tokens of a chunk), the sum of the elements strictly before each one: a shifted running
    sum, never the total minus a suffix or the running sum minus the element, which cancel under strong decay."""
    return F.pad(x.cumsum(-2)[..., :-1, :], (0, 0, 1, 0))


def from_here(x: torch.Tensor) -> torch.Tensor:
    """Along dim -2, the sum of each element and those after it."""
    return x.flip(-2).cumsum(-2).flip(-2)


def scalar_pairs_backward(lhs: list[torch.Tensor], b: torch.Tensor, G: torch.Tensor, dxs: list[torch.Tensor]):
    """`decay_pairs_backward` for one decay per row (G (M, C, 1)), with each pair's weight before its decay in
    place of dg: (das, db, W) with W[i, j] = sum_s dx_s[i, j] (a_s[i] . b[j]), so that the pairs' part of dg
    is sum over straddling pairs of W[i, j] exp(G_i - G_j) (`scalar_decay_gradient` forms it)."""
    decay = _scalar_decay(G)
    zs = [dx * decay for dx in dxs]
    das = [z @ b for z in zs]
    db = zs[0].transpose(-1, -2) @ lhs[0]
    for z, a in zip(zs[1:], lhs[1:]):
        db.baddbmm_(z.transpose(-1, -2), a)
    bt = b.transpose(-1, -2)
    weights = sum(dx * (a @ bt) for dx, a in zip(dxs, lhs))
    return das, db, weights, decay


# The decay gradient of a token is exp(g_t) times a sum whose largest factor is one (see scalar_decay_gradient); the
# factor exp(g_t) is kept down to e^-60 (~9e-27): the gradient it makes, times the moderate operands of what
# follows (the decay rate's chain rule, the projection's matmul), stays a normal float. Below, it is an exact zero:
# transformers' own chunked scans lose the whole decay gradient far sooner (once decays pass ~e^-24 a token).
LOG_GRADIENT_ZERO = -60.0


def previous_rows(decay: torch.Tensor) -> torch.Tensor:
    """Row t: E[t-1, :] (the decays from each earlier token to the one before t); row 0 zero, no token before it."""
    return F.pad(decay[..., :-1, :], (0, 0, 1, 0))


def straddling_rescaled(weights: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """R_t = sum_{i >= t > j} W[i, j] E[i, t] E[t-1, j] for W, E (..., C, C): the pairs' part of dL/dg_t with the
    token's own decay exp(g_t) taken out, so that `straddling(W * E) = exp(g) * straddling_rescaled(W, E)` and the
    sum keeps its digits however strong the decays (see `scalar_decay_gradient`). W must be zero on pairs that
    may not interact (across a sequence start): the factors E[i, t] E[t-1, j] are not."""
    return (decay * (weights @ previous_rows(decay).transpose(-1, -2))).sum(-2)


def scalar_decay_gradient(g, G, weights, decay, after, before, carried):
    """dL/dg_t for one decay per row, with g the per-token log decays (M, C, 1) and G = cumsum g along the chunk.
    Every term of it holds the decay of token t itself, exp(g_t), since it differentiates a product of decays
    that includes it; the rest of each term is a product of decays of other tokens, at most one:

        dg_t = exp(g_t) R_t
        R_t  = sum_{i >= t > j} W[i, j] E[i, t] E[t-1, j]          (the pairs that straddle t; `weights` W)
             + E_{t-1} sum_{i >= t} after_i E[i, t]                (exp(G_i) in the state read and in W's keys)
             + exp(G_C - G_t) sum_{j < t} before_j E[t-1, j]       (exp(G_C - G_j) in the keys written)
             + E_{t-1} exp(G_C - G_t) carried                      (exp(G_C) of the state carried over)

    with E[i, j] = exp(G_i - G_j) (`decay`, zero above the diagonal) and E_{t-1} = exp(G_{t-1}) (1 at the
    chunk's first token). `after`, `before` (M, C, 1) and `carried` (M, 1) are the terms' weights before their
    decays. Formed this way the sum R_t keeps its digits however strong the decays are (its largest term has
    factor one, the pair (t, t-1)), and only the factor exp(g_t) is small; formed as a sum of decayed terms,
    as the forward's factors give them, every term of a token decayed by more than e^-24 would be an exact
    zero (`LOG_DECAY_ZERO`), and with them the whole gradient."""
    shifted = previous_rows(decay)
    pairs = straddling_rescaled(weights, decay).unsqueeze(-1)
    previous = F.pad(G[:, :-1], (0, 0, 1, 0))  # G_{t-1}, 0 before the first token
    last = G[:, -1:]
    to_end = decay_exp(last - G)
    rest = (decay_exp(previous) * (decay.transpose(-1, -2) @ after) + to_end * (shifted @ before)
            + decay_exp(previous + (last - G)) * carried[:, None])
    return exp_or_zero(g, LOG_GRADIENT_ZERO) * (pairs + rest)


def decay_pairs_backward(lhs: list[torch.Tensor], b: torch.Tensor, G: torch.Tensor, dxs: list[torch.Tensor]):
    """Gradients (list of da, db, dg) of sum_s sum(dx_s * X_s); each dx must be zero above the diagonal.
    dg is the gradient with respect to the per-token log decay g (G = cumsum g along the chunk), with g's shape
    (M, C, 1 or K), formed from the pairs that straddle each token (see `straddling`)."""
    if G.shape[-1] == 1:
        das, db, weights, decay = scalar_pairs_backward(lhs, b, G, dxs)
        return das, db, straddling(weights * decay).unsqueeze(-1)
    c = G.shape[-2]
    lhs, b, G = _pad_to_power_of_two(lhs, b, G)
    p = G.shape[-2]
    dxs = [F.pad(dx, (0, p - c, 0, p - c)) for dx in dxs]
    diags = [dx.diagonal(dim1=-2, dim2=-1).unsqueeze(-1) for dx in dxs]
    das = [d * b for d in diags]
    db = sum(d * a for d, a in zip(diags, lhs))
    dg = torch.zeros_like(G)
    for size, right, left in _levels(G):
        # a block's pairs straddle token t when t is in its right half at or after row i, or in its left half
        # after column j: a suffix sum over the right rows' terms, an exclusive prefix sum over the left's
        b_left = _left(b, size) * left
        db_left, rows = 0, 0
        for a, da, dx in zip(lhs, das, dxs):
            blocks = _sibling_blocks(dx, size)
            right_terms = (blocks @ b_left) * right
            _right(da, size).add_(right_terms)
            rows = rows + _right(a, size) * right_terms
            db_left = db_left + blocks.transpose(-1, -2) @ (_right(a, size) * right)
        _left(db, size).add_(db_left * left)
        columns = b_left * db_left
        _right(dg, size).add_(from_here(rows))
        _left(dg, size).add_(before(columns))
    return [da[:, :c] for da in das], db[:, :c], dg[:, :c]
