"""Inverse of a batch of unit lower-triangular matrices, (I + strict_lower(a))^-1, by block doubling.

Batched `torch.linalg.solve_triangular` runs one small LAPACK call per matrix on CPU, an order of
magnitude slower than the matmuls around it. Block forward substitution is the same arithmetic arranged as
matmuls: once the diagonal blocks of size b are inverted, each pair of them is merged with

    [T11  0 ]     T21 = -T22 A21 T11
    [T21 T22]

so log2(C) rounds of batched matmuls invert the whole matrix (no Python loop over rows). Unlike a Neumann
series it never forms powers of A, so it is as stable as substitution.
"""

from __future__ import annotations

import torch


def _diagonal_blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    """View (M, n, size, size) of the diagonal blocks of x (M, n*size, n*size); writes go through to x."""
    m, c, _ = x.shape
    n = c // size
    return torch.diagonal(x.view(m, n, size, n, size), dim1=1, dim2=3).permute(0, 3, 1, 2)


def _drop_small(x: torch.Tensor, negligible: float) -> torch.Tensor:
    """x with entries smaller than `negligible` in magnitude set to zero, in place (x as it is when 0)."""
    return x.masked_fill_(x.abs() < negligible, 0.0) if negligible else x


def unit_lower_inverse(a: torch.Tensor, negligible: float = 0.0) -> torch.Tensor:
    """(I + strict_lower(a))^-1 for a (M, C, C); the diagonal and upper part of `a` are not read. Entries of
    `a`, and of each product as blocks are merged, smaller than `negligible` in magnitude become exact zeros:
    next to the unit diagonal they cannot move a result, and with decayed entries (a_ij carrying
    exp(G_i - G_j)) the products of several small ones would end as subnormal floats, which slow every matmul
    they enter. With negligible = e^-24 a product of three kept factors is still above e^-72, a normal float."""
    m, c, _ = a.shape
    size = 1 << (c - 1).bit_length()
    if size != c:  # pad to a power of two with identity rows: the leading block's inverse is unchanged
        a = torch.nn.functional.pad(a, (0, size - c, 0, size - c))
    if negligible:  # a padded `a` is a copy already; the caller's is not written
        a = _drop_small(a.clone() if size == c else a, negligible)
    inv = torch.eye(size, dtype=a.dtype, device=a.device).expand(m, size, size).contiguous()
    b = 1
    while b < size:
        t = _diagonal_blocks(inv, 2 * b)
        a21 = _diagonal_blocks(a, 2 * b)[..., b:, :b]
        t[..., b:, :b] = -_drop_small(_drop_small(t[..., b:, b:] @ a21, negligible) @ t[..., :b, :b], negligible)
        b *= 2
    return inv[:, :c, :c]
