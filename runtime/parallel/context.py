"""Context parallelism: each rank holds segments of every sequence; attention is computed across them exactly.

Softmax attention (causal, sliding window, chunked, packed documents) all-gathers the keys and values of the cp
group (`context_parallel_attention`): plain causal attention as flash passes merged by log-sum-exp
(`MergedCausal`), the rest with a mask from global positions; DeepSeek sparse attention likewise gathers the
index keys and picks each query's global top-k (`context_parallel_sparse_attention`); the short convolutions before
linear attention gather each segment's predecessor's tail (`context_parallel_conv1d`). Linear attention carries its
state (`carry`, for the gated delta rule and scalar-decay cores):

The gated delta rule (Gated DeltaNet; KDA with a decay per key channel) keeps a (K x V) state per head,

    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,      o_t = S_t^T q_t,

which is linear in the initial state and the values together. A share of tokens run from a state S_in therefore
splits into what it computes from zero and what the incoming state adds:

    o(S_in, v) = o(0, v) + o(S_in, 0),      final(S_in, v) = final(0, v) + A S_in,

where A = prod_t alpha_t (I - beta_t k_t k_t^T) (K x K) is the share's transition: the final state of the same
tokens run from the identity with zero values. So with the sequence cut into segments 0..n-1 held by the cp ranks
(contiguous, or zig-zag: segments r and 2cp-1-r on rank r, as the causal softmax layers balance it):

    1. every rank runs each of its segments once, from the state [0 | I] with the values [v | 0] (K more value
       columns: the recurrence treats each state column apart): outputs [o(0, v) | o(I, 0)], final [F_s | A_s];
    2. the ranks all-gather (F_s, A_s) of every segment (O(K^2 + K V) per head and segment, whatever the length);
    3. the state entering segment s is the exclusive scan  S_0 = 0,  S_{s+1} = A_s S_s + F_s;
    4. each rank adds o(S_s, 0) = o(I, 0) S_s (a (T x K) by (K x V) product per head), by linearity again.

So a segment costs one pass of width V + K where one process runs width V, and keeps what that pass keeps for the
backward: with K = V about twice one process's linear-attention activations per token, on 1 / cp of the tokens.

The backward pass is autograd's through the same steps: the all-gather's gradient is the sum over ranks of the
gradients of each gathered state (`_gather`), so a state's gradient travels back to the rank that made it.
Packed documents: a segment in which a document starts passes no state through that start (its transition is
zero there), and only its first document takes the incoming state; both follow from `cu_seqlens` (`_segment`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from runtime.attention.gated_delta import chunk_gated_delta_rule


class _Gather(torch.autograd.Function):
    """All-gather of one tensor per rank (the same shape on every rank); backward sums each slot's gradient over
    the ranks and returns this rank's slot (all-reduce: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty(dist.get_world_size(group), *x.shape)
        dist.all_gather(list(out.unbind(0)), x.contiguous(), group=group)  # straight into the result: no copy
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    return _Gather.apply(x, group)


def zigzag(cp: int) -> list[list[int]]:
    """The segments of each rank when a sequence is cut into 2 cp segments and balanced for causal attention:
    rank r holds segments r and 2 cp - 1 - r, so every rank has one early (cheap) and one late (costly) part."""
    return [[r, 2 * cp - 1 - r] for r in range(cp)]


def _segment(query, key, value, g, beta, bounds, *, initial_state, **kw):
    """One segment's (outputs, final state) from `initial_state` (None: zero); `bounds` are the
    document starts inside the segment (positions > 0), where the state restarts from zero."""
    if not bounds:
        return chunk_gated_delta_rule(query, key, value, g, beta, initial_state=initial_state,
                                      output_final_state=True, **kw)
    cu = torch.tensor([0, *bounds, query.shape[1]])
    states = None
    if initial_state is not None:  # only the first document continues the incoming state
        zero = torch.zeros_like(initial_state)
        states = torch.cat([initial_state, *[zero] * len(bounds)])
    out, finals = chunk_gated_delta_rule(query, key, value, g, beta, initial_state=states, output_final_state=True,
                                         cu_seqlens=cu, **kw)
    return out, finals[-1:]  # the last document's: a document start inside passes no earlier state on


def carry(run, *, group, segments: list[int], n_segments: int, key_dim: int, value_dim: int,
          owners: dict[int, tuple[int, int]] | None = None) -> torch.Tensor:
    """This rank's outputs of a linear recurrence over a sequence cut into `n_segments` segments, of which it holds
    `segments` (increasing), given `run(i, key_dim) -> (outputs (1, T, H, V + K), final state (1, H, K, V + K))`:
    its i-th segment run with K = key_dim zero value columns after its own values, from the state [0 | I] per head
    (`_widened`). The recurrence must be linear in the state and the values together (module docstring); steps 1-4
    there. `owners` (segment -> (rank, index among its segments)): where every segment lives, when the caller knows
    it (`context_split.Split.owners`); otherwise all-gathered from the ranks' `segments`."""
    owners = owners or _segment_owners(group, segments, n_segments)
    outputs, finals, moves, from_eye = [], [], [], []
    for i in range(len(segments)):
        out, final = run(i, key_dim)
        outputs.append(out[..., :value_dim])
        from_eye.append(out[..., value_dim:])
        finals.append(final[..., :value_dim])
        moves.append(final[..., value_dim:])
    # one gather of both (ranks, segments of a rank, 1, H, K, V + K): a single collective in the backward as well,
    # so no two ranks can meet different ones
    gathered = _gather(torch.cat([torch.stack(finals), torch.stack(moves)], -1), group)
    all_finals, all_moves = gathered.split([value_dim, key_dim], -1)
    state = torch.zeros_like(finals[0])
    incoming = {}
    for s in range(n_segments):  # the exclusive scan over segments
        rank, i = owners[s]
        incoming[s] = state
        state = torch.einsum("bhkj,bhjv->bhkv", all_moves[rank, i], state) + all_finals[rank, i]
    # every rank's backward must reach the gather's (an all-reduce), also a rank whose outputs take no state
    result, anchor = [], 0 * gathered.sum()
    for i, (segment, out) in enumerate(zip(segments, outputs)):
        if segment == 0:
            result.append(out + anchor)
        else:
            result.append(out + torch.einsum("bthj,bhjv->bthv", from_eye[i], incoming[segment]))
    return torch.cat(result, 1)


def _widened(value: torch.Tensor, key_dim: int, fresh: bool):
    """[v | 0] (K zero value columns) and the initial state [0 | I] per head, [0 | 0] for a segment a document
    starts with (no state enters it)."""
    batch, _, heads, value_dim = value.shape
    state = value.new_zeros(batch, heads, key_dim, value_dim + key_dim)
    if not fresh:
        state[..., value_dim:] = torch.eye(key_dim, dtype=value.dtype, device=value.device)
    return torch.cat([value, value.new_zeros(*value.shape[:-1], key_dim)], -1), state


def _pieces(length: int, segments: list[int], n_segments: int, group) -> int:
    """Tokens per segment; ValueError unless this rank's tokens are equal segments of a sequence the group shares."""
    per = length // len(segments)
    if per * len(segments) != length or n_segments % dist.get_world_size(group):
        raise ValueError(f"{length} tokens in {len(segments)} segments of {n_segments} over "
                         f"{dist.get_world_size(group)} ranks: the segments must be equal")
    return per


def context_parallel_gated_delta(query, key, value, g, beta, *, group, segments: list[int], n_segments: int,
                                 starts: list[list[int]] | None = None, owners: dict | None = None,
                                 **kw) -> torch.Tensor:
    """This rank's outputs of the gated delta rule over a sequence cut into `n_segments` segments, of which it
    holds `segments` (in increasing order; their tokens concatenated in that order along dim 1, equal lengths).
    query/key (1, T, Hk, K), value (1, T, H, V), g (1, T, H[, K]), beta (1, T, H), as `chunk_gated_delta_rule`
    takes them (`kw`: chunk_size, scale, use_qk_l2norm_in_kernel). `starts[i]`: the document starts inside this
    rank's i-th segment (packed documents; 0 when one starts with the segment, which then takes no state). Every
    rank of `group` calls it with the same n_segments (`owners`: as `carry` takes it)."""
    if query.shape[0] != 1:
        raise ValueError(f"context parallelism takes one (packed) sequence per call, got batch {query.shape[0]}")
    per = _pieces(query.shape[1], segments, n_segments, group)
    starts = starts or [[] for _ in segments]
    fresh = [0 in s for s in starts]  # a document starts with the segment: no earlier state enters it
    starts = [[b for b in s if b > 0] for s in starts]

    def run(i, key_dim):
        piece = slice(i * per, (i + 1) * per)
        q, k, v, gate, b = (x[:, piece] for x in (query, key, value, g, beta))
        v, state = _widened(v, key_dim, fresh[i])
        return _segment(q, k, v, gate, b, starts[i], initial_state=state, **kw)

    return carry(run, group=group, segments=segments, n_segments=n_segments, key_dim=query.shape[-1],
                 value_dim=value.shape[-1], owners=owners)


def context_parallel_scalar_decay(q, k, v, g, *, group, segments: list[int], n_segments: int,
                                  reset: torch.Tensor | None = None, chunk_size: int = 64,
                                  owners: dict | None = None) -> torch.Tensor:
    """The same for linear attention with one decay per head and token (Mamba2's SSD, lightning attention:
    `runtime.attention.scalar_decay.chunk_scalar_decay`'s q, k (1, T, Hk, K), v (1, T, H, V), g (1, T, H) and
    `reset` (1, T): a document starts at this token). Its transition is exp(sum g) I until the last reset, 0 after
    one; `carry` finds it as for any recurrence linear in state and values."""
    from runtime.attention.scalar_decay import chunk_scalar_decay

    if q.shape[0] != 1:
        raise ValueError(f"context parallelism takes one (packed) sequence per call, got batch {q.shape[0]}")
    per = _pieces(q.shape[1], segments, n_segments, group)

    def run(i, key_dim):
        piece = slice(i * per, (i + 1) * per)
        values, state = _widened(v[:, piece], key_dim, False)  # a reset at the first token drops [0 | I] itself
        return chunk_scalar_decay(q[:, piece], k[:, piece], values, g[:, piece], chunk_size=chunk_size,
                                  initial_state=state, output_final_state=True,
                                  reset=None if reset is None else reset[:, piece])

    return carry(run, group=group, segments=segments, n_segments=n_segments, key_dim=q.shape[-1],
                 value_dim=v.shape[-1], owners=owners)


def gathered_along(tensors: list[torch.Tensor], group, seq_dims: list[int]) -> list[torch.Tensor]:
    """Each tensor's pieces from every rank of `group`, concatenated along its sequence dim: one collective for all
    of them, forward and backward (flattened side by side)."""
    both = _gather(torch.cat([t.flatten() for t in tensors]), group)  # (ranks, total size)
    parts = both.split([t.numel() for t in tensors], -1)
    return [torch.cat([x.view(t.shape) for x in part], dim=dim) for part, t, dim in zip(parts, tensors, seq_dims)]


def gathered_in_order(tensors: list[torch.Tensor], group, seq_dims: list[int], positions: torch.Tensor,
                      kpos: torch.Tensor | None = None) -> list[torch.Tensor]:
    """`gathered_along`, each tensor then put in the unsplit sequence's order (this rank's tokens are at global
    `positions`; `kpos`, every rank's positions in rank order, when the caller knows them): what ranks keys by
    score sees them as one process does, so exact ties (the DSA indexer's ReLU makes them) are broken alike."""
    order = torch.argsort(positions_of(positions, group) if kpos is None else kpos)
    return [x.index_select(d, order.to(x.device)) for x, d in zip(gathered_along(tensors, group, seq_dims), seq_dims)]


def positions_of(positions: torch.Tensor, group) -> torch.Tensor:
    where = [torch.empty_like(positions) for _ in range(dist.get_world_size(group))]
    dist.all_gather(where, positions.contiguous(), group=group)
    return torch.cat(where)


def visible(positions, kpos, documents=None, window=None, chunk=None) -> torch.Tensor:
    """(queries, keys) True where a query at global position p sees the key at position j, as on the unsplit
    sequence: j <= p, within `window` (p - j < window), in the same `chunk` and the same document."""
    qpos = positions[:, None]
    mask = kpos[None, :] <= qpos
    if window is not None:
        mask &= qpos - kpos[None, :] < window
    if chunk is not None:
        mask &= qpos // chunk == kpos[None, :] // chunk
    if documents is not None:
        mask &= documents[positions][:, None] == documents[kpos][None, :]
    return mask


def context_parallel_sparse_attention(query, key, value, index_query, index_key, index_weights, *, group,
                                      positions: torch.Tensor, top_k: int, scale: float,
                                      index_scale: float | None = None,
                                      documents: torch.Tensor | None = None) -> torch.Tensor:
    """DeepSeek sparse attention (DSA) of this rank's queries: the lightning indexer scores them against the index
    keys of the whole sequence (all-gathered with the attention's keys and values, one collective), keeps each
    query's global top-k among the keys it may see (causal and same-document, by global positions), and attends
    to those wherever they lived. query (B, H, Tl, Dk), key / value (B, Hkv, Tl, D), index_query (B, Tl, Hi, Di),
    index_key (B, Tl, Di), index_weights (B, Tl, Hi) fp32, at this rank's tokens (`positions`, (Tl,)). Returns
    (B, H, Tl, Dv). Per rank it holds the sequence's keys (as softmax context parallelism does) and
    Tl x top_k picks."""
    from runtime.attention.dsa import visible_picks
    from runtime.attention.indexer import indexer_topk
    from runtime.attention.sparse import sparse_attention

    k, v, ik = gathered_in_order([key, value, index_key], group, [2, 2, 1], positions)
    mask = visible(positions, torch.arange(k.shape[2], device=positions.device), documents)[None]  # (1, Tl, T)
    picks = indexer_topk(index_query, ik, index_weights, mask, top_k, index_scale)
    return sparse_attention(query, k, v, visible_picks(picks, mask[:, None], k.shape[2]), scale)


class MergedCausal(torch.autograd.Function):
    """Softmax attention of one segment's queries over the keys of every earlier segment (all visible) and its own
    (causal), as two flash-attention passes merged by their log-sum-exps: no (queries x keys) score or mask is
    ever materialised. The backward runs each pass's flash backward with the merged output and log-sum-exp, which
    is exactly each key block's share of the gradient (the blocks of ring attention's backward)."""

    @staticmethod
    def forward(ctx, q, k_before, v_before, k_own, v_own, scale):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out, lse = flash(q, k_own, v_own, 0.0, True, scale=scale)
        if k_before.shape[2]:
            out_b, lse_b = flash(q, k_before, v_before, 0.0, False, scale=scale)
            merged = torch.logaddexp(lse, lse_b)
            out = out * torch.exp(lse - merged).unsqueeze(-1) + out_b * torch.exp(lse_b - merged).unsqueeze(-1)
            lse = merged
        ctx.save_for_backward(q, k_before, v_before, k_own, v_own, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k_before, v_before, k_own, v_own, out, lse = ctx.saved_tensors
        back = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        grad = grad.contiguous()
        dq, dk_own, dv_own = back(grad, q, k_own, v_own, out, lse, 0.0, True, scale=ctx.scale)
        if k_before.shape[2]:
            dq_b, dk_before, dv_before = back(grad, q, k_before, v_before, out, lse, 0.0, False, scale=ctx.scale)
            dq = dq + dq_b
        else:
            dk_before, dv_before = torch.zeros_like(k_before), torch.zeros_like(v_before)
        return dq, dk_before, dv_before, dk_own, dv_own, None


def _whole_segments(positions: torch.Tensor) -> list[tuple[int, int]]:
    """(block, tokens) of aligned equal blocks that tile this rank's runs of consecutive positions: the largest
    size dividing every run's start and length (a rank's two zig-zag segments may be neighbours and make one run,
    as segments 1 and 2 of cp 2 do); block b covers positions [b * tokens, (b + 1) * tokens)."""
    breaks = [0, *((positions[1:] != positions[:-1] + 1).nonzero().flatten() + 1).tolist(), len(positions)]
    runs = [(int(positions[a]), b - a) for a, b in zip(breaks, breaks[1:])]
    per = math.gcd(*(x for run in runs for x in run))
    return [(start // per + i, per) for start, n in runs for i in range(n // per)]


def context_parallel_attention(query, key, value, *, group, positions: torch.Tensor, kpos: torch.Tensor | None = None,
                               documents: torch.Tensor | None = None, window: int | None = None,
                               chunk: int | None = None, scale: float | None = None,
                               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of this rank's queries over the keys of the whole sequence, the keys and values
    all-gathered from the cp group (Llama 3's all-gather context parallelism: one exchange per layer, forward and
    backward, O(T) keys on each rank while the layer runs; the ranks' queries, whose cost grows with their
    positions, are balanced by holding zig-zag segments).

    query (B, H, Tl, D), key / value (B, Hkv, Tl, D) at this rank's tokens, whose global positions are `positions`
    (Tl,); equal Tl on every rank. The mask is computed from global positions as on the unsplit sequence:
    causal (key position <= query position), within `window` tokens (sliding: query - key < window), within the
    same `chunk` (chunked attention: position // chunk equal), and within the same document (`documents` (T,):
    each global position's document id, for packed sequences). Rotary embeddings are the caller's, applied at
    `positions` before this. `sinks` (H,): one attention-sink logit per head (gpt-oss), a column every query's
    softmax sees and whose weight goes nowhere. `kpos`: every rank's positions in rank order, when the caller knows
    them (else all-gathered)."""
    k, v = gathered_along([key, value], group, [2, 2])
    kpos = positions_of(positions, group) if kpos is None else kpos
    if query.device.type == "cpu" and documents is None and window is None and chunk is None and sinks is None:
        runs = _whole_segments(positions)
        head, value_head = query.shape[-1], value.shape[-1]
        if value_head == head:
            return _by_segments(query, key, value, k, v, kpos, runs, scale)
        # the flash pass takes one head size: MLA's narrower values padded with zero columns (the scores are the
        # queries' and keys'), their outputs cut back
        scale = head ** -0.5 if scale is None else scale
        pad = [0, head - value_head] if value_head < head else None
        if pad is not None:
            value, v = (torch.nn.functional.pad(x, pad) for x in (value, v))
            return _by_segments(query, key, value, k, v, kpos, runs, scale)[..., :value_head]
    if query.shape[1] != k.shape[1]:  # grouped-query attention: each key head serves a group of query heads
        k = k.repeat_interleave(query.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(query.shape[1] // v.shape[1], dim=1)
    mask = visible(positions, kpos, documents, window, chunk)
    if sinks is None:
        return torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale)
    scores = (query @ k.transpose(-1, -2)) * (query.shape[-1] ** -0.5 if scale is None else scale)
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1] @ v


def context_parallel_conv1d(x, weight, bias=None, activation: str | None = None, *, group, segments: list[int],
                            n_segments: int, documents: torch.Tensor | None = None,
                            owners: dict | None = None) -> torch.Tensor:
    """The short depthwise causal convolution of linear attention and Mamba blocks (`runtime.attention.conv.
    causal_conv1d`: x (B, C, Tl), weight (C, W)) over this rank's segments, each seeing the W - 1 tokens before it
    wherever they live: every segment's last W - 1 tokens are all-gathered (one collective, forward and backward)
    and each segment runs with its predecessor's in front, whose outputs are dropped. `documents` (T,): each global
    position's document id; a tap never reaches into the previous document, nor before the sequence's start."""
    from runtime.attention.conv import causal_conv1d

    width = (weight.squeeze(1) if weight.dim() == 3 else weight).shape[-1]
    per = _pieces(x.shape[-1], segments, n_segments, group)
    halo = width - 1
    if halo > per:
        raise ValueError(f"segments of {per} tokens are shorter than the convolution's {halo} earlier taps")
    owners = owners or _segment_owners(group, segments, n_segments)
    tails = gathered_along([torch.stack([x[..., (i + 1) * per - halo:(i + 1) * per] for i in range(len(segments))])],
                      group, [0])[0] if halo else None  # (ranks * segments of a rank, B, C, halo)
    out = []
    for i, segment in enumerate(segments):
        own = x[..., i * per:(i + 1) * per]
        if not halo:
            out.append(causal_conv1d(own, weight, bias, activation))
            continue
        start = segment * per
        if segment == 0:
            before, before_ids = torch.zeros_like(own[..., :halo]), torch.full((halo,), -1, dtype=torch.long)
        else:
            rank, j = owners[segment - 1]
            before = tails[rank * len(segments) + j]
            before_ids = (documents[start - halo:start] if documents is not None
                          else torch.zeros(halo, dtype=torch.long))
        ids = torch.cat([before_ids, documents[start:start + per] if documents is not None
                         else torch.zeros(per, dtype=torch.long)])
        extended = torch.cat([before, own], -1)
        seq_idx = ids.unsqueeze(0).expand(x.shape[0], -1)
        out.append(causal_conv1d(extended, weight, bias, activation, seq_idx=seq_idx)[..., halo:])
    anchor = 0 * tails.sum() if halo else 0  # every rank's backward meets the gather's all-reduce
    return torch.cat(out, -1) + anchor


def _by_segments(query, key, value, k, v, kpos, runs, scale):
    """Plain causal attention of whole segments (`MergedCausal` per local segment): each over the gathered keys of
    the segments before it and its own, causal; O(tokens) memory per rank, no mask."""
    group = query.shape[1] // key.shape[1]

    def heads(x):  # grouped-query attention: the flash pass takes as many key heads as query heads
        return x.repeat_interleave(group, dim=1) if group > 1 else x

    per = runs[0][1]
    out, at = [], 0
    for segment, _ in runs:
        q = query[:, :, at:at + per]
        earlier = (kpos < segment * per).nonzero().flatten()
        k_before, v_before = (heads(x.index_select(2, earlier)) for x in (k, v))
        k_own, v_own = (heads(x[:, :, at:at + per]) for x in (key, value))
        out.append(MergedCausal.apply(q, k_before, v_before, k_own, v_own, scale))
        at += per
    return torch.cat(out, 2)


def _segment_owners(group, segments: list[int], n_segments: int) -> dict[int, tuple[int, int]]:
    """Segment -> (rank, index among that rank's segments), from every rank's own list (all-gathered)."""
    mine = torch.tensor(segments, dtype=torch.long)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    owners = {int(s): (rank, i) for rank, held in enumerate(everyone) for i, s in enumerate(held.tolist())}
    if sorted(owners) != list(range(n_segments)) or sum(len(h) for h in everyone) != n_segments:
        raise ValueError(f"the ranks hold segments {sorted(owners)}, not each of 0..{n_segments - 1} once")
    return owners
