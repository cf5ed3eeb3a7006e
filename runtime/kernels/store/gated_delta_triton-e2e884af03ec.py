"""Triton forward of the chunked gated delta rule for qwen3-next-80b-a3b: per-head (Gated DeltaNet) gate.

Rendered by onboard from templates/kernels/gated_delta_triton.py.j2 for key head dim 128, value head dim
128, chunks of 64 tokens (sub-blocks of 16, key slices of 64), bf16 inputs computed in fp32:
regenerate rather than edit. Three forward kernels, the pieces of `runtime.attention.gated_delta` in the same order:

- `_pairs_kernel`, one program per (chunk, row sub-block, column sub-block): the decayed key-key and
  query-key products inside a chunk; across sub-blocks as one matmul around the decay at the row block's
  first token (both factors <= 1), inside a sub-block elementwise;
- `_solve_kernel`, one program per chunk: (I + beta kk)^-1 by forward substitution on registers, then the
  WY terms U and W;
- `_scan_kernel`, one program per (sequence, value block): the state recurrence over chunks, with each
  chunk's output computed as soon as its incoming state is known.

Shapes must be powers of two with every block >= 16 (tl.dot): head dims, chunk, `block` (divides chunk),
`block_k` (divides the key head dim), `block_v` (divides the value head dim).

The backward is the runtime's own (`ChunkGatedDelta.backward`: batched matmuls and elementwise ops over all
chunks) from the tensors these kernels save, with its one sequential part, the reverse scan of the state
gradient over chunks, as a fourth kernel (`_scan_backward_kernel`).
`register()` puts the op in the runtime's kernel registry under the "triton" backend (CUDA, or the CPU
interpreter with TRITON_INTERPRET=1); shapes it was not rendered for fall through to the PyTorch path.
"""

import torch
import triton
import triton.language as tl

from runtime.attention.gated_delta import ChunkGatedDelta, chunk_core
from runtime.kernels import registry

HEAD_K = 128
HEAD_V = 128
CHUNK = 64
BLOCK = 16
BLOCK_V = 64
BLOCK_K = 64
PER_CHANNEL = False
DTYPE = "bf16"


@triton.jit
def _pairs_kernel(q_ptr, k_ptr, g_ptr, kk_ptr, qk_ptr, CHUNK: tl.constexpr, BC: tl.constexpr, K: tl.constexpr,
                  BK: tl.constexpr, PER_CHANNEL: tl.constexpr):
    m = tl.program_id(0)
    bi = tl.program_id(1)
    bj = tl.program_id(2)
    if bj <= bi:
        ri = m * CHUNK + bi * BC + tl.arange(0, BC)
        rj = m * CHUNK + bj * BC + tl.arange(0, BC)
        keep = ri[:, None] >= rj[None, :]
        kk = tl.zeros((BC, BC), dtype=tl.float32)
        qk = tl.zeros((BC, BC), dtype=tl.float32)
        if PER_CHANNEL:
            # key channels in slices of BK: the elementwise decay of a sub-block is (BC, BC, BK) on registers
            for d0 in tl.static_range(0, K, BK):
                d = d0 + tl.arange(0, BK)
                q_i = tl.load(q_ptr + ri[:, None] * K + d[None, :]).to(tl.float32)
                k_i = tl.load(k_ptr + ri[:, None] * K + d[None, :]).to(tl.float32)
                k_j = tl.load(k_ptr + rj[:, None] * K + d[None, :]).to(tl.float32)
                g_i = tl.load(g_ptr + ri[:, None] * K + d[None, :])
                g_j = tl.load(g_ptr + rj[:, None] * K + d[None, :])
                if bj < bi:
                    # every column is before the row block: split exp(G_i - G_j) at its first token
                    ref = tl.load(g_ptr + (m * CHUNK + bi * BC) * K + d)
                    row = tl.exp(g_i - ref[None, :])
                    col = k_j * tl.exp(ref[None, :] - g_j)
                    kk += tl.dot(k_i * row, tl.trans(col), input_precision="ieee")
                    qk += tl.dot(q_i * row, tl.trans(col), input_precision="ieee")
                else:
                    decay = tl.exp(tl.where(keep[:, :, None], g_i[:, None, :] - g_j[None, :, :], float("-inf")))
                    kk += tl.sum(k_i[:, None, :] * k_j[None, :, :] * decay, axis=2)
                    qk += tl.sum(q_i[:, None, :] * k_j[None, :, :] * decay, axis=2)
        else:
            for d0 in tl.static_range(0, K, BK):
                d = d0 + tl.arange(0, BK)
                q_i = tl.load(q_ptr + ri[:, None] * K + d[None, :]).to(tl.float32)
                k_i = tl.load(k_ptr + ri[:, None] * K + d[None, :]).to(tl.float32)
                k_j = tl.load(k_ptr + rj[:, None] * K + d[None, :]).to(tl.float32)
                kk += tl.dot(k_i, tl.trans(k_j), input_precision="ieee")
                qk += tl.dot(q_i, tl.trans(k_j), input_precision="ieee")
            decay = tl.exp(tl.where(keep, tl.load(g_ptr + ri)[:, None] - tl.load(g_ptr + rj)[None, :], float("-inf")))
            kk = kk * decay
            qk = qk * decay
        out = m * CHUNK * CHUNK + (ri - m * CHUNK)[:, None] * CHUNK + (rj - m * CHUNK)[None, :]
        tl.store(kk_ptr + out, kk)
        tl.store(qk_ptr + out, qk)


@triton.jit
def _solve_kernel(kk_ptr, beta_ptr, g_ptr, k_ptr, v_ptr, inv_ptr, r_ptr,
                  CHUNK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, PER_CHANNEL: tl.constexpr):
    m = tl.program_id(0)
    base = m * CHUNK
    i = tl.arange(0, CHUNK)
    d = tl.arange(0, K)
    e = tl.arange(0, V)
    beta = tl.load(beta_ptr + base + i).to(tl.float32)
    a = tl.load(kk_ptr + m * CHUNK * CHUNK + i[:, None] * CHUNK + i[None, :]) * beta[:, None]
    a = tl.where(i[:, None] > i[None, :], a, 0.0)
    inv = tl.where(i[:, None] == i[None, :], 1.0, 0.0)
    # row r of (I + A)^-1 is e_r - A[r, :r] @ rows above it, which are final by then
    for r in range(1, CHUNK):
        a_row = tl.sum(tl.where(i[:, None] == r, a, 0.0), axis=0)
        inv = tl.where(i[:, None] == r, inv - tl.sum(a_row[:, None] * inv, axis=0)[None, :], inv)
    k = tl.load(k_ptr + (base + i)[:, None] * K + d[None, :]).to(tl.float32)
    v = tl.load(v_ptr + (base + i)[:, None] * V + e[None, :]).to(tl.float32)
    if PER_CHANNEL:
        decay = tl.exp(tl.load(g_ptr + (base + i)[:, None] * K + d[None, :]))
    else:
        decay = tl.exp(tl.load(g_ptr + base + i))[:, None]
    u = tl.dot(inv, v * beta[:, None], input_precision="ieee")
    w = tl.dot(inv, k * beta[:, None] * decay, input_precision="ieee")
    tl.store(inv_ptr + m * CHUNK * CHUNK + i[:, None] * CHUNK + i[None, :], inv)
    tl.store(r_ptr + (base + i)[:, None] * (V + K) + e[None, :], u)
    tl.store(r_ptr + (base + i)[:, None] * (V + K) + V + d[None, :], w)


@triton.jit
def _scan_kernel(q_ptr, k_ptr, g_ptr, r_ptr, qk_ptr, s0_ptr, o_ptr, states_ptr, v_new_ptr, final_ptr, n_chunks,
                 CHUNK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                 PER_CHANNEL: tl.constexpr, HAS_S0: tl.constexpr):
    seq = tl.program_id(0)
    vb = tl.program_id(1)
    i = tl.arange(0, CHUNK)
    d = tl.arange(0, K)
    e = vb * BV + tl.arange(0, BV)
    state_at = d[:, None] * V + e[None, :]
    if HAS_S0:
        s = tl.load(s0_ptr + seq * K * V + state_at).to(tl.float32)
    else:
        s = tl.zeros((K, BV), dtype=tl.float32)
    for c in range(n_chunks):
        m = seq * n_chunks + c
        rows = m * CHUNK + i
        tl.store(states_ptr + m * K * V + state_at, s)
        u = tl.load(r_ptr + rows[:, None] * (V + K) + e[None, :])
        w = tl.load(r_ptr + rows[:, None] * (V + K) + V + d[None, :])
        v_new = u - tl.dot(w, s, input_precision="ieee")
        tl.store(v_new_ptr + rows[:, None] * V + e[None, :], v_new)
        q = tl.load(q_ptr + rows[:, None] * K + d[None, :]).to(tl.float32)
        k = tl.load(k_ptr + rows[:, None] * K + d[None, :]).to(tl.float32)
        if PER_CHANNEL:
            g = tl.load(g_ptr + rows[:, None] * K + d[None, :])
            last = tl.load(g_ptr + (m * CHUNK + CHUNK - 1) * K + d)
            q_dec = q * tl.exp(g)
            k_end = k * tl.exp(last[None, :] - g)
            carry = tl.exp(last)[:, None]
        else:
            g = tl.load(g_ptr + rows)
            last = tl.load(g_ptr + m * CHUNK + CHUNK - 1)
            q_dec = q * tl.exp(g)[:, None]
            k_end = k * tl.exp(last - g)[:, None]
            carry = tl.exp(last)
        p = tl.load(qk_ptr + m * CHUNK * CHUNK + i[:, None] * CHUNK + i[None, :])
        p = tl.where(i[:, None] >= i[None, :], p, 0.0)
        o = tl.dot(q_dec, s, input_precision="ieee") + tl.dot(p, v_new, input_precision="ieee")
        tl.store(o_ptr + rows[:, None] * V + e[None, :], o.to(o_ptr.dtype.element_ty))
        s = s * carry + tl.dot(tl.trans(k_end), v_new, input_precision="ieee")
    tl.store(final_ptr + seq * K * V + state_at, s)


@triton.jit
def _scan_backward_kernel(p_do_ptr, q_do_ptr, w_ptr, k_end_ptr, decay_ptr, dfinal_ptr, ds_next_ptr, dv_new_ptr,
                          ds0_ptr, n_chunks, stride_wm, stride_wc, CHUNK: tl.constexpr, K: tl.constexpr,
                          V: tl.constexpr, BV: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_DFINAL: tl.constexpr):
    seq = tl.program_id(0)
    vb = tl.program_id(1)
    i = tl.arange(0, CHUNK)
    d = tl.arange(0, K)
    e = vb * BV + tl.arange(0, BV)
    state_at = d[:, None] * V + e[None, :]
    if HAS_DFINAL:
        ds = tl.load(dfinal_ptr + seq * K * V + state_at).to(tl.float32)
    else:
        ds = tl.zeros((K, BV), dtype=tl.float32)
    for back in range(n_chunks):
        m = seq * n_chunks + n_chunks - 1 - back
        rows = m * CHUNK + i
        tl.store(ds_next_ptr + m * K * V + state_at, ds)
        k_end = tl.load(k_end_ptr + rows[:, None] * K + d[None, :])
        dv_new = tl.load(p_do_ptr + rows[:, None] * V + e[None, :]) + tl.dot(k_end, ds, input_precision="ieee")
        tl.store(dv_new_ptr + rows[:, None] * V + e[None, :], dv_new)
        w = tl.load(w_ptr + m * stride_wm + i[:, None] * stride_wc + d[None, :])
        if PER_CHANNEL:
            carry = tl.load(decay_ptr + m * K + d)[:, None]
        else:
            carry = tl.load(decay_ptr + m)
        ds = (tl.load(q_do_ptr + m * K * V + state_at) + ds * carry
              - tl.dot(tl.trans(w), dv_new, input_precision="ieee"))
    tl.store(ds0_ptr + seq * K * V + state_at, ds)


def _scan_backward(p_do, q_do, w, k_end, decay, dfinal, n_seq, n):
    """The contract of runtime.attention.gated_delta._scan_backward, as one kernel launch."""
    chunk, vd = p_do.shape[1:]
    kd = w.shape[-1]
    ds_next = torch.empty(n_seq, n, kd, vd, dtype=torch.float32, device=p_do.device)
    dv_new = torch.empty_like(p_do)
    ds0 = torch.empty(n_seq, kd, vd, dtype=torch.float32, device=p_do.device)
    has_dfinal = dfinal is not None
    _scan_backward_kernel[(n_seq, vd // BLOCK_V)](
        p_do.contiguous(), q_do.contiguous(), w, k_end.contiguous(), decay.contiguous(),
        dfinal.contiguous() if has_dfinal else ds0, ds_next, dv_new, ds0, n, w.stride(0), w.stride(1),
        CHUNK=chunk, K=kd, V=vd, BV=BLOCK_V, PER_CHANNEL=PER_CHANNEL, HAS_DFINAL=has_dfinal)
    return ds_next, dv_new, ds0


class TritonChunkGatedDelta(ChunkGatedDelta):
    """Forward by the kernels above; saves what `ChunkGatedDelta.backward` reads, in its layout, and has it
    run its reverse scan over chunks as `_scan_backward_kernel`."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, s0, chunk: int):
        n_seq, length, kd = k.shape
        vd, n = v.shape[-1], length // chunk
        chunks = n_seq * n
        q, k, v, beta = q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous()
        cum = g.reshape(chunks, chunk, g.shape[-1]).float().cumsum(1).contiguous()
        kk = torch.zeros(chunks, chunk, chunk, dtype=torch.float32, device=k.device)
        qk = torch.zeros_like(kk)
        nb = chunk // BLOCK
        _pairs_kernel[(chunks, nb, nb)](q, k, cum, kk, qk, CHUNK=chunk, BC=BLOCK, K=kd, BK=BLOCK_K,
                                        PER_CHANNEL=PER_CHANNEL)
        inv = torch.empty_like(kk)
        r = torch.empty(chunks, chunk, vd + kd, dtype=torch.float32, device=k.device)
        _solve_kernel[(chunks,)](kk, beta, cum, k, v, inv, r, CHUNK=chunk, K=kd, V=vd, PER_CHANNEL=PER_CHANNEL)
        o = torch.empty(n_seq, length, vd, dtype=q.dtype, device=q.device)
        states = torch.empty(n_seq, n, kd, vd, dtype=torch.float32, device=k.device)
        v_new = torch.empty(chunks, chunk, vd, dtype=torch.float32, device=k.device)
        final = torch.empty(n_seq, kd, vd, dtype=torch.float32, device=k.device)
        has_s0 = s0 is not None
        _scan_kernel[(n_seq, vd // BLOCK_V)](q, k, cum, r, qk, s0.contiguous() if has_s0 else final, o, states,
                                             v_new, final, n, CHUNK=chunk, K=kd, V=vd, BV=BLOCK_V,
                                             PER_CHANNEL=PER_CHANNEL, HAS_S0=has_s0)
        ctx.save_for_backward(q.view(chunks, chunk, kd), k.view(chunks, chunk, kd), v.view(chunks, chunk, vd),
                              beta.view(chunks, chunk), cum, kk, qk, inv, r, states.view(chunks, kd, vd), v_new)
        ctx.shape = (n_seq, n, chunk, has_s0)
        ctx.scan_backward = _scan_backward
        return o, final


def rendered_for(q, k, v, g, chunk: int) -> bool:
    """Whether these inputs have the shapes this module was rendered for."""
    return (k.shape[-1] == HEAD_K and v.shape[-1] == HEAD_V and chunk == CHUNK
            and (g.shape[-1] == HEAD_K) == PER_CHANNEL and (g.shape[-1] == 1) != PER_CHANNEL)


def chunk_gated_delta(q, k, v, g, beta, s0, chunk: int, block: int | None = None):
    """The registry op "linear_attention.chunk_gated_delta" (contract of runtime.attention.gated_delta)."""
    if not rendered_for(q, k, v, g, chunk):
        return chunk_core(q, k, v, g, beta, s0, chunk)
    return TritonChunkGatedDelta.apply(q, k, v, g, beta, s0, chunk)


def register():
    registry.register("linear_attention.chunk_gated_delta", "triton", chunk_gated_delta)
