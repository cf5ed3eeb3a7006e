"""Context parallelism for linear attention: each rank runs its shares of the sequence, and the states are carried.

The gated delta rule (Gated DeltaNet; KDA with a decay per key channel) keeps a (K x V) state per head,

    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,      o_t = S_t^T q_t,

which is linear in the initial state and the values together. A share of tokens run from a state S_in therefore
splits into what it computes from zero and what the incoming state adds:

    o(S_in, v) = o(0, v) + o(S_in, 0),      final(S_in, v) = final(0, v) + A S_in,

where A = prod_t alpha_t (I - beta_t k_t k_t^T) (K x K) is the share's transition: the final state of the same
tokens run from the identity with zero values. So with the sequence cut into segments 0..n-1 held by the cp ranks
(contiguous, or zig-zag: segments r and 2cp-1-r on rank r, as the causal softmax layers balance it):

    1. every rank runs each of its segments from zero: outputs o_0, final state F_s, and the transition A_s;
    2. the ranks all-gather (F_s, A_s) of every segment (O(K^2 + K V) per head and segment, whatever the length);
    3. the state entering segment s is the exclusive scan  S_0 = 0,  S_{s+1} = A_s S_s + F_s;
    4. each rank adds o(S_s, 0), its segments run from their incoming state with zero values.

The backward pass is autograd's through the same steps: the all-gather's gradient is the sum over ranks of the
gradients of each gathered state (`_gather`), so a state's gradient travels back to the rank that made it.
Packed documents: a segment in which a document starts passes no state through that start (its transition is
zero there), and only its first document takes the incoming state; both follow from `cu_seqlens` (`_segment`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from runtime.attention.gated_delta import chunk_gated_delta_rule


class _Gather(torch.autograd.Function):
    """All-gather of one tensor per rank (the same shape on every rank); backward sums each slot's gradient over
    the ranks and returns this rank's slot (all-reduce: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

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
    """One segment's (outputs, final state, transition) from `initial_state` (None: zero); `bounds` are the
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
    return out, finals[-1:]


def context_parallel_gated_delta(query, key, value, g, beta, *, group, segments: list[int], n_segments: int,
                                 starts: list[list[int]] | None = None, **kw) -> torch.Tensor:
    """This rank's outputs of the gated delta rule over a sequence cut into `n_segments` segments, of which it
    holds `segments` (in increasing order; their tokens concatenated in that order along dim 1, equal lengths).
    query/key (1, T, Hk, K), value (1, T, H, V), g (1, T, H[, K]), beta (1, T, H), as `chunk_gated_delta_rule`
    takes them (`kw`: chunk_size, scale, use_qk_l2norm_in_kernel). `starts[i]`: the document starts inside this
    rank's i-th segment (packed documents). Every rank of `group` calls it with the same n_segments."""
    if query.shape[0] != 1:
        raise ValueError(f"context parallelism takes one (packed) sequence per call, got batch {query.shape[0]}")
    per = query.shape[1] // len(segments)
    if per * len(segments) != query.shape[1] or n_segments % dist.get_world_size(group):
        raise ValueError(f"{query.shape[1]} tokens in {len(segments)} segments of {n_segments} over "
                         f"{dist.get_world_size(group)} ranks: the segments must be equal")
    starts = starts or [[] for _ in segments]
    pieces = [slice(i * per, (i + 1) * per) for i in range(len(segments))]
    heads, kd = value.shape[2], query.shape[-1]
    outputs, finals, moves = [], [], []
    for piece, bounds in zip(pieces, starts):
        args = [x[:, piece] for x in (query, key, value, g, beta)]
        out, final = _segment(*args, bounds, initial_state=None, **kw)
        # the transition: the same tokens from the identity with zero values; a document start inside cuts it
        q, k, _, gate, b = args
        eye = torch.eye(kd, dtype=final.dtype).expand(1, heads, kd, kd)
        zeros = value.new_zeros(1, per, heads, kd)
        _, move = _segment(q, k, zeros, gate, b, bounds, initial_state=eye, **kw)
        if bounds:
            move = torch.zeros_like(move)
        outputs.append(out)
        finals.append(final)
        moves.append(move)
    # one gather of both (ranks, segments of a rank, 1, H, K, V + K): a single collective in the backward as well,
    # so no two ranks can meet different ones
    gathered = _gather(torch.cat([torch.stack(finals), torch.stack(moves)], -1), group)
    all_finals, all_moves = gathered.split([value.shape[-1], kd], -1)
    order = _segment_owners(group, segments, n_segments)
    state = torch.zeros_like(finals[0])
    incoming = {}
    for s in range(n_segments):  # the exclusive scan over segments
        rank, i = order[s]
        incoming[s] = state
        state = torch.einsum("bhkj,bhjv->bhkv", all_moves[rank, i], state) + all_finals[rank, i]
    # every rank's backward must reach the gather's (an all-reduce), also a rank whose outputs take no state
    result, anchor = [], 0 * gathered.sum()
    for segment, piece, bounds, out in zip(segments, pieces, starts, outputs):
        if segment == 0:
            result.append(out + anchor)
            continue
        q, k, _, gate, b = (x[:, piece] for x in (query, key, value, g, beta))
        carried, _ = _segment(q, k, torch.zeros_like(value[:, piece]), gate, b, bounds,
                              initial_state=incoming[segment], **kw)
        result.append(out + carried)
    return torch.cat(result, 1)


def _segment_owners(group, segments: list[int], n_segments: int) -> dict[int, tuple[int, int]]:
    """Segment -> (rank, index among that rank's segments), from every rank's own list (all-gathered)."""
    mine = torch.tensor(segments, dtype=torch.long)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    owners = {int(s): (rank, i) for rank, held in enumerate(everyone) for i, s in enumerate(held.tolist())}
    if sorted(owners) != list(range(n_segments)) or sum(len(h) for h in everyone) != n_segments:
        raise ValueError(f"the ranks hold segments {sorted(owners)}, not each of 0..{n_segments - 1} once")
    return owners
