"""Chunk-parallel gated delta rule (Gated DeltaNet, KDA), forward and our own backward.

The recurrence (see `delta_reference`) is cut into chunks of C tokens. Inside a chunk, with G the cumulative
log decay from the chunk start (per head or per key channel), the C delta-rule updates collapse into one
unit-lower-triangular system (the WY / UT form of DeltaNet):

    A[i, j] = beta_i sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d])  (j < i)
    U = (I + A)^-1 (beta v),   W = (I + A)^-1 (beta k exp(G))

and only the (K x V) state crosses chunk boundaries:

    v_new = U - W S;   o = (q exp(G)) S + P v_new;   S' = exp(G_C) S + (k exp(G_C - G))^T v_new

with P[i, j] = sum_d q_i[d] k_j[d] exp(G_i[d] - G_j[d]) for j <= i. Everything but the state recurrence is
batched over all chunks; the recurrence is a loop over chunks (two small matmuls each), forward and backward.
The backward is written out (not autograd through the chunk loop): it keeps one state per chunk and the
intra-chunk matrices, and recomputes only the decay factors.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from runtime.attention import decay_pairs as pairs
from runtime.attention.decay_pairs import decay_exp, decay_pairs, decay_pairs_backward
from runtime.attention.delta_reference import prepare_qk
from runtime.attention.triangular import unit_lower_inverse
from runtime.kernels import registry


class ChunkGatedDelta(torch.autograd.Function):
    """Inputs flattened to N = batch x heads sequences, length a multiple of `chunk`, fp32: q (N, T, K)
    already scaled, k (N, T, K), v (N, T, V), g (N, T, 1 or K) log decay, beta (N, T), s0 (N, K, V) or None.
    Returns (o (N, T, V), final state (N, K, V))."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, s0, chunk: int):
        n_seq, length, kd = k.shape
        vd, n = v.shape[-1], length // chunk
        q, k, v = (x.reshape(n_seq * n, chunk, x.shape[-1]) for x in (q, k, v))
        beta = beta.reshape(n_seq * n, chunk)
        G = g.reshape(n_seq * n, chunk, g.shape[-1]).cumsum(1)
        kk, qk = decay_pairs([k, q], k, G)
        eg = decay_exp(G)
        inv = unit_lower_inverse(kk * beta[..., None], pairs.decay_zero(kk.dtype))
        r = inv @ torch.cat((v * beta[..., None], k * (beta[..., None] * eg)), -1)
        u, w = r.split([vd, kd], -1)
        last = G[:, -1:]
        k_end = k * decay_exp(last - G)
        decay = decay_exp(last).transpose(-1, -2)  # (M, K or 1, 1): scales the state's rows

        states, v_new, final = _scan_forward(u, w, k_end, decay, s0, n_seq, n)
        states = states.flatten(0, 1)  # (M, K, V): the state each chunk starts from
        o = (q * eg) @ states + qk @ v_new
        ctx.save_for_backward(q, k, v, beta, G, kk, qk, inv, r, states, v_new, g.reshape(G.shape))
        ctx.shape = (n_seq, n, chunk, s0 is not None)
        ctx.scan_backward = _scan_backward
        return o.reshape(n_seq, length, vd), final

    @staticmethod
    def backward(ctx, do, dfinal):
        q, k, v, beta, G, kk, qk, inv, r, states, v_new, g = ctx.saved_tensors
        n_seq, n, chunk, has_s0 = ctx.shape
        vd, kd = v.shape[-1], k.shape[-1]
        do = do.reshape(n_seq * n, chunk, vd)
        eg = decay_exp(G)
        last = G[:, -1:]
        to_end = decay_exp(last - G)
        k_end = k * to_end
        decay = decay_exp(last).transpose(-1, -2)
        q_dec = q * eg
        w = r[..., vd:]

        ds_next, dv_new, ds0 = ctx.scan_backward(qk.transpose(-1, -2) @ do, q_dec.transpose(-1, -2) @ do,
                                              w, k_end, decay, dfinal, n_seq, n)
        dstates = ds_next.flatten(0, 1)
        dq_dec = do @ states.transpose(-1, -2)
        dqk = (do @ v_new.transpose(-1, -2)).tril()
        dk_end = v_new @ dstates.transpose(-1, -2)
        ddecay = (states * dstates).sum(-1)  # (M, K)
        dr = torch.cat((dv_new, -(dv_new @ states.transpose(-1, -2))), -1)

        drhs = inv.transpose(-1, -2) @ dr
        da = -(drhs @ r.transpose(-1, -2)).tril(-1)
        dvb, dkb = drhs.split([vd, kd], -1)
        dv = dvb * beta[..., None]
        dbeta = (dvb * v).sum(-1) + (dkb * k * eg).sum(-1) + (da * kk).sum(-1)
        dk = dkb * (beta[..., None] * eg)

        dxs = [da * beta[..., None], dqk]
        if G.shape[-1] == 1:
            dpairs, dkey, weights, pair_decay = pairs.scalar_pairs_backward([k, q], k, G, dxs)
        else:
            dpairs, dkey, dg_pairs = decay_pairs_backward([k, q], k, G, dxs)
        dk = dk + dpairs[0] + dkey + dk_end * to_end
        dq = dpairs[1] + dq_dec * eg
        # the decay gradient, term by term, each summed over exactly the tokens whose decay it depends on
        # (never as the difference of two running sums, which cancels under strong decay):
        #   exp(G_i) in k beta (W) and in q (the state read): every token t <= i, a suffix sum;
        #   exp(G_C - G_i) in the keys written to the state: every token t > i, a prefix sum;
        #   exp(G_C) of the state carried over: every token of the chunk; the pairs: those that straddle t
        if G.shape[-1] == 1:  # one decay per head: each term's weight before its decay, the decays applied after
            after = (dkb * k * beta[..., None] + dq_dec * q).sum(-1, keepdim=True)
            before = (dk_end * k).sum(-1, keepdim=True)
            dg = pairs.scalar_decay_gradient(g, G, weights, pair_decay, after, before, ddecay.sum(-1, keepdim=True))
        else:
            after = dkb * (k * (beta[..., None] * eg)) + dq_dec * q_dec
            before = dk_end * k_end
            dg = pairs.from_here(after) + pairs.before(before) + (ddecay * decay[..., 0])[:, None] + dg_pairs

        length = n * chunk
        return (dq.reshape(n_seq, length, kd), dk.reshape(n_seq, length, kd), dv.reshape(n_seq, length, vd),
                dg.reshape(n_seq, length, -1), dbeta.reshape(n_seq, length), ds0 if has_s0 else None, None)


def _scan_forward(u, w, k_end, decay, s0, n_seq, n):
    """The state at the start of every chunk (n_seq, n, K, V), v_new (M, C, V) and the final state."""
    kd, vd = w.shape[-1], u.shape[-1]
    u, w, k_end, decay = (x.view(n_seq, n, *x.shape[1:]) for x in (u, w, k_end, decay))
    # chunk-major buffers: each step writes whole contiguous slices in place, three ops a chunk
    states = u.new_empty(n + 1, n_seq, kd, vd)
    v_new = u.new_empty(n, n_seq, *u.shape[2:])
    if s0 is None:
        states[0].zero_()
    else:
        states[0].copy_(s0)
    for c in range(n):
        torch.baddbmm(u[:, c], w[:, c], states[c], alpha=-1, out=v_new[c])
        torch.mul(states[c], decay[:, c], out=states[c + 1])
        states[c + 1].baddbmm_(k_end[:, c].transpose(-1, -2), v_new[c])
    return states[:n].transpose(0, 1), v_new.transpose(0, 1).flatten(0, 1), states[n]


def _scan_backward(p_do, q_do, w, k_end, decay, dfinal, n_seq, n):
    """Reverse scan: the state gradient after every chunk (n_seq, n, K, V), dv_new (M, C, V), d initial state."""
    kd, vd = w.shape[-1], p_do.shape[-1]
    p_do, q_do, w, k_end, decay = (x.view(n_seq, n, *x.shape[1:]) for x in (p_do, q_do, w, k_end, decay))
    ds = p_do.new_empty(n + 1, n_seq, kd, vd)  # ds[c + 1]: gradient of the state after chunk c
    dv_new = p_do.new_empty(n, n_seq, *p_do.shape[2:])
    if dfinal is None:
        ds[n].zero_()
    else:
        ds[n].copy_(dfinal)
    for c in reversed(range(n)):
        torch.baddbmm(p_do[:, c], k_end[:, c], ds[c + 1], out=dv_new[c])
        torch.mul(ds[c + 1], decay[:, c], out=ds[c])
        ds[c].add_(q_do[:, c]).baddbmm_(w[:, c].transpose(-1, -2), dv_new[c], alpha=-1)
    return ds[1:].transpose(0, 1), dv_new.transpose(0, 1).flatten(0, 1), ds[0]


def chunk_core(q, k, v, g, beta, s0, chunk: int, block: int | None = None):
    """The op that backend dispatch replaces (the contract of ChunkGatedDelta.forward). `block` is accepted for
    older callers and unused: rendered kernels fix their sub-block size when rendered."""
    return ChunkGatedDelta.apply(q, k, v, g, beta, s0, chunk)


def chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, chunk_size: int = 64, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           scale: float | None = None, cu_seqlens: torch.Tensor | None = None,
                           **_ignored):
    """Gated delta rule over a whole sequence, chunk-parallel; the signature of transformers'
    `torch_chunk_gated_delta_rule` / `chunk_kimi_delta_attention` (and flash-linear-attention's).

    query/key (B, T, Hk, K); value (B, T, H, V) with H a multiple of Hk; g (B, T, H) for one decay per head
    or (B, T, H, K) for one per key channel, in log space (<= 0); beta (B, T, H); initial_state (B, H, K, V).
    `cu_seqlens` (with B == 1) marks packed sequences, each starting from `initial_state[i]` or zeros.
    Returns (out (B, T, H, V) in the query dtype, final state (B or sequences, H, K, V) or None).
    """
    if cu_seqlens is not None:
        return _packed(query, key, value, g, beta, cu_seqlens, chunk_size=chunk_size, initial_state=initial_state,
                       output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                       scale=scale)
    batch, length, heads, vd = value.shape
    if g.shape[:3] != (batch, length, heads) or beta.shape != (batch, length, heads):
        raise ValueError(f"g {tuple(g.shape)} and beta {tuple(beta.shape)} must start with (batch, tokens, "
                         f"value heads) = {(batch, length, heads)}")
    q, k = prepare_qk(query, key, heads, use_qk_l2norm_in_kernel, scale)
    kd = k.shape[-1]
    if g.dim() == 4 and g.shape[-1] != kd:
        raise ValueError(f"per-channel gate has {g.shape[-1]} channels, keys have {kd}")
    pad = -length % chunk_size
    gate = g.to(q.dtype) if g.dim() == 4 else g.to(q.dtype).unsqueeze(-1)

    def heads_first(x):  # (B, T, H, D) -> (B*H, T+pad, D), zero padded: padded tokens leave the state unchanged
        x = x.transpose(1, 2)
        return F.pad(x, (0, 0, 0, pad)).reshape(batch * heads, length + pad, x.shape[-1])

    q, k, v, gate = (heads_first(x) for x in (q, k, value.to(q.dtype), gate))
    b = F.pad(beta.to(q.dtype).transpose(1, 2), (0, pad)).reshape(batch * heads, length + pad)
    s0 = None if initial_state is None else initial_state.to(q.dtype).reshape(batch * heads, kd, vd)
    core = registry.lookup("linear_attention.chunk_gated_delta", chunk_core)
    o, final = core(q.contiguous(), k.contiguous(), v.contiguous(), gate.contiguous(), b.contiguous(), s0,
                    chunk_size)
    o = o.view(batch, heads, length + pad, vd)[:, :, :length].transpose(1, 2).to(query.dtype)
    return o, (final.view(batch, heads, kd, vd) if output_final_state else None)


def _packed(query, key, value, g, beta, cu_seqlens, *, initial_state, output_final_state, **kw):
    if query.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs the packed sequences in one batch row, got batch {query.shape[0]}")
    bounds = cu_seqlens.tolist()
    outs, finals = [], []
    for i, (start, end) in enumerate(itertools.pairwise(bounds)):
        s0 = None if initial_state is None else initial_state[i:i + 1]
        o, final = chunk_gated_delta_rule(query[:, start:end], key[:, start:end], value[:, start:end],
                                          g[:, start:end], beta[:, start:end], initial_state=s0,
                                          output_final_state=True, **kw)
        outs.append(o)
        finals.append(final)
    return torch.cat(outs, 1), (torch.cat(finals) if output_final_state else None)
