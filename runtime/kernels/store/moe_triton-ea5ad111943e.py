"""Triton MoE kernels for mixtral-8x7b: token permute / unpermute and the grouped expert GEMM.

Rendered by onboard from templates/kernels/moe_triton.py.j2 for hidden 4096, top-2,
expert FFN 14336, bf16: regenerate rather than edit. `register()` puts these kernels in the
runtime's kernel registry under the "triton" backend (CUDA, or the CPU interpreter with TRITON_INTERPRET=1).
"""

import torch
import triton
import triton.language as tl

from runtime.kernels import registry

HIDDEN = 4096
TOP_K = 2
FFN = 14336
BLOCK_COLS = 1024
BM, BN, BK = 64, 64, 32


@triton.jit
def _permute_kernel(x_ptr, order_ptr, out_ptr, width, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    # one program per sorted assignment: copy its token's row
    row = tl.program_id(0)
    src = tl.load(order_ptr + row) // TOP_K
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < width
        tl.store(out_ptr + row * width + cols, tl.load(x_ptr + src * width + cols, mask=mask), mask=mask)


@triton.jit
def _combine_kernel(y_ptr, slot_ptr, out_ptr, width, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    # one program per token: sum the rows of its k assignments (slot -1: dropped); no atomics, deterministic
    token = tl.program_id(0)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < width
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in range(TOP_K):
            slot = tl.load(slot_ptr + token * TOP_K + j) + tl.zeros((BLOCK,), dtype=tl.int64)
            keep = mask & (slot >= 0)
            acc += tl.load(y_ptr + tl.maximum(slot, 0) * width + cols, mask=keep, other=0.0).to(tl.float32)
        tl.store(out_ptr + token * width + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grouped_gemm_kernel(x_ptr, w_ptr, y_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, K, N,
                         stride_we, stride_wk, stride_wn,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # y[rows of expert e] = x[rows] @ w[e]; a tile of BM rows never spans two experts
    tile = tl.program_id(0)
    col_block = tl.program_id(1)
    e = tl.load(tile_expert_ptr + tile)
    r0 = tl.load(tile_start_ptr + tile)
    r1 = tl.load(tile_end_ptr + tile)
    rows = r0 + tl.arange(0, BM)
    cols = col_block * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        a = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < r1) & (ks[None, :] < K), other=0.0)
        b = tl.load(w_ptr + e * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                    mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
        acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < r1) & (cols[None, :] < N))


@triton.jit
def _grouped_wgrad_kernel(x_ptr, dy_ptr, dw_ptr, starts_ptr, ends_ptr, K, N,
                          stride_we, stride_wk, stride_wn,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # dw[e] = x[rows of e]^T @ dy[rows of e], written in the weight's own layout (strides)
    e = tl.program_id(0)
    k_block = tl.program_id(1)
    n_block = tl.program_id(2)
    r0 = tl.load(starts_ptr + e)
    r1 = tl.load(ends_ptr + e)
    ks = k_block * BK + tl.arange(0, BK)
    cols = n_block * BN + tl.arange(0, BN)
    acc = tl.zeros((BK, BN), dtype=tl.float32)
    for m0 in range(r0, r1, BM):
        rows = m0 + tl.arange(0, BM)
        a = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < r1) & (ks[None, :] < K), other=0.0)
        b = tl.load(dy_ptr + rows[:, None] * N + cols[None, :], mask=(rows[:, None] < r1) & (cols[None, :] < N),
                    other=0.0)
        acc += tl.dot(tl.trans(a.to(tl.float32)), b.to(tl.float32), input_precision="ieee")
    tl.store(dw_ptr + e * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
             acc.to(dw_ptr.dtype.element_ty), mask=(ks[:, None] < K) & (cols[None, :] < N))


def _tiles(counts: torch.Tensor):
    """Row tiles of BM that stay inside one expert's slice."""
    experts, starts, ends = [], [], []
    start = 0
    for e, n in enumerate(counts.tolist()):
        for r in range(start, start + n, BM):
            experts.append(e)
            starts.append(r)
            ends.append(start + n)
        start += n
    device = counts.device
    as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    return as_tensor(experts), as_tensor(starts), as_tensor(ends)


def _gemm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x (rows, K) sorted by expert; w viewed as (E, K, N) through its strides."""
    x = x.contiguous()
    rows, K = x.shape
    N = w.shape[2]
    y = torch.empty(rows, N, dtype=x.dtype, device=x.device)
    experts, starts, ends = _tiles(counts)
    if len(experts):
        grid = (len(experts), triton.cdiv(N, BN))
        _grouped_gemm_kernel[grid](x, w, y, experts, starts, ends, K, N, w.stride(0), w.stride(1), w.stride(2),
                                   BM=BM, BN=BN, BK=BK)
    return y


def _wgrad(x: torch.Tensor, dy: torch.Tensor, counts: torch.Tensor, like: torch.Tensor, transposed: bool):
    """Gradient of w (stored like `like`); `transposed` when the GEMM used like^T, i.e. (E, N, K) storage."""
    dw = torch.zeros_like(like)
    view = dw.transpose(-2, -1) if transposed else dw  # (E, K, N) view of the stored layout
    K, N = x.shape[1], dy.shape[1]
    ends = torch.cumsum(counts, 0)
    starts = ends - counts
    grid = (counts.numel(), triton.cdiv(K, BK), triton.cdiv(N, BN))
    _grouped_wgrad_kernel[grid](x.contiguous(), dy.contiguous(), view, starts, ends, K, N,
                                view.stride(0), view.stride(1), view.stride(2), BM=BM, BN=BN, BK=BK)
    return dw


class GroupedGEMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, counts, out_in: bool):
        ctx.save_for_backward(x, w, counts)
        ctx.out_in = out_in
        return _gemm(x, w.transpose(-2, -1) if out_in else w, counts)

    @staticmethod
    def backward(ctx, dy):
        x, w, counts = ctx.saved_tensors
        dy = dy.contiguous()
        dx = _gemm(dy, w if ctx.out_in else w.transpose(-2, -1), counts) if ctx.needs_input_grad[0] else None
        dw = _wgrad(x, dy, counts, w, ctx.out_in) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None


def _permute_rows(x: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty(order.numel(), x.shape[1], dtype=x.dtype, device=x.device)
    if order.numel():
        _permute_kernel[(order.numel(),)](x, order, out, x.shape[1], TOP_K=top_k, BLOCK=BLOCK_COLS)
    return out


def _combine_rows(y: torch.Tensor, slots: torch.Tensor, tokens: int, top_k: int) -> torch.Tensor:
    y = y.contiguous()
    out = torch.empty(tokens, y.shape[1], dtype=y.dtype, device=y.device)
    _combine_kernel[(tokens,)](y, slots, out, y.shape[1], TOP_K=top_k, BLOCK=BLOCK_COLS)
    return out


def _slots(order: torch.Tensor, assignments: int) -> torch.Tensor:
    """slot[a] = position of assignment a in sorted order, -1 where it was dropped."""
    slots = torch.full((assignments,), -1, dtype=torch.int64, device=order.device)
    slots[order] = torch.arange(order.numel(), device=order.device)
    return slots


class Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, order, top_k: int):
        ctx.save_for_backward(order)
        ctx.tokens, ctx.top_k = x.shape[0], top_k
        return _permute_rows(x, order, top_k)

    @staticmethod
    def backward(ctx, dout):
        (order,) = ctx.saved_tensors
        slots = _slots(order, ctx.tokens * ctx.top_k)
        return _combine_rows(dout, slots, ctx.tokens, ctx.top_k), None, None


class Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, order, tokens: int, top_k: int):
        ctx.save_for_backward(order)
        ctx.top_k = top_k
        return _combine_rows(y, _slots(order, tokens * top_k), tokens, top_k)

    @staticmethod
    def backward(ctx, dout):
        (order,) = ctx.saved_tensors
        return _permute_rows(dout, order, ctx.top_k), None, None, None


def grouped_mm(x, w, counts, *, out_in: bool = False):
    return GroupedGEMM.apply(x, w, counts, out_in)


def permute(x, d):
    return Permute.apply(x, d.order, d.top_k)


def unpermute(y, d, tokens):
    return Combine.apply(y, d.order, tokens, d.top_k)


def register():
    registry.register("moe.grouped_mm", "triton", grouped_mm)
    registry.register("moe.permute", "triton", permute)
    registry.register("moe.unpermute", "triton", unpermute)
