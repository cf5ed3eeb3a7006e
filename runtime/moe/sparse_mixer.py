"""Sparse-mixer routing (SparseMixer-v2, as PhiMoE routes): two experts chosen in rounds, each weighted by its
share of a softmax over the scores near the best, with a Heun-style gradient estimate in training.

    weights, experts = sparse_mixer(scores, jitter_eps, training)     # scores (T, E) -> (T, 2), (T, 2)

Round r (r = 1, 2) over scores s (round 2 with round 1's expert's score set to -inf, giving s'):

    m_r    = max s'                                          (s' = s in round 1)
    keep_j = (m_r - s_j) / max(|s_j|, m_r) <= 2 eps          (scores within a relative band of the best)
    g      = softmax over the kept s'_j                      (others -inf)
    e_r    = argmax s'  (eval)  |  argmax (log g - log Exp(1)) (training: a Gumbel sample among the kept)
    w_r    = g[e_r]

In eval w_r is differentiated as written. In training the forward value is w_r * c with c = 1 where the
sample was the argmax of g or with probability 1/4, else 1/3 (the midpoint weights of Heun's third-order
method), and the gradient reaching the scores is w_r * (onehot(e_r) - g) times the incoming gradient: the
derivative of g[e_r] with respect to the kept scores, used as the estimate for the sampled choice (the paper:
Liu et al., "GRIN: GRadient-INformed MoE", arXiv 2409.12136). Nothing flows through c or through the masks.

Random numbers are drawn with the same calls, shapes and order as transformers' `sparsemixer`, so under one
seed both choose the same experts: that is what lets verification compare the two in training mode.
"""

from __future__ import annotations

import torch

ROUNDS = 2  # the mixer's choice count is fixed by its construction (PhiMoE's top_k is 2)


class _HeunMultiplier(torch.autograd.Function):
    """Forward: w * c. Backward to the scores only: w * (onehot(e) - g) * grad (module docstring)."""

    @staticmethod
    def forward(ctx, scores, weight, experts, gates, midpoint):
        ctx.save_for_backward(weight, experts, gates)
        return weight * midpoint

    @staticmethod
    def backward(ctx, grad):
        weight, experts, gates = ctx.saved_tensors
        scaled = grad * weight
        grad_scores = gates * -scaled
        grad_scores.scatter_add_(-1, experts, scaled)
        return grad_scores, None, None, None, None


def _outside_band(candidates: torch.Tensor, scores: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask of scores more than 2 eps below the best of `candidates`, relative; the best's index)."""
    with torch.no_grad():
        best, best_index = candidates.max(dim=-1, keepdim=True)
        factor = scores.abs().clamp(min=best)
        return (best - scores) / factor > 2 * eps, best_index


def _round(scores, candidates, eps: float, training: bool):
    """One round over `candidates` (scores with earlier choices at -inf): (weight (T, 1), expert (T, 1))."""
    outside, best_index = _outside_band(candidates, scores, eps)
    masked = candidates.masked_fill(outside, float("-inf"))
    if training:
        noise = torch.empty_like(masked, memory_format=torch.legacy_contiguous_format).exponential_().log()
        expert = (masked - noise).max(dim=-1)[1].unsqueeze(-1)
    else:
        expert = best_index
    gates = torch.softmax(masked, dim=-1)
    weight = gates.gather(-1, expert)
    return weight, expert, gates


def _midpoint(gates, expert, first_round: bool):
    """c of the module docstring: 1 for the argmax choice or with probability 1/4, else 1/3."""
    top, top_index = gates.max(dim=-1, keepdim=True)
    draw = torch.rand_like(top) if first_round else torch.rand_like(top).uniform_()  # transformers' draws
    keep = torch.logical_or(expert == top_index, draw > 0.75)
    return torch.add(0.3333, keep, alpha=0.6667).type_as(gates)


def sparse_mixer(scores: torch.Tensor, jitter_eps: float, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (T, 2), experts (T, 2)) for router scores (T, E) (module docstring)."""
    weights, experts = [], []
    candidates = scores
    for r in range(ROUNDS):
        if r:
            candidates = torch.scatter(scores, -1, experts[0], float("-inf"))
        weight, expert, gates = _round(scores, candidates, jitter_eps, training)
        if training:
            weight = _HeunMultiplier.apply(scores, weight, expert, gates, _midpoint(gates, expert, r == 0))
        weights.append(weight)
        experts.append(expert)
    return torch.cat(weights, dim=-1), torch.cat(experts, dim=-1)


def jitter_input_(hidden: torch.Tensor, noise: float) -> torch.Tensor:
    """Multiply `hidden` in place by uniform noise in [1 - noise, 1 + noise] (training-time input jitter, as
    PhiMoE's router applies it: in place, so the experts see the jittered tokens too)."""
    return hidden.mul_(torch.empty_like(hidden).uniform_(1.0 - noise, 1.0 + noise))
