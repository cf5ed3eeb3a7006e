"""Load-balancing losses that MoE models train with."""

from __future__ import annotations

import torch

from runtime.moe.router import Routing


def load_balancing_loss(routing: Routing, num_experts: int) -> torch.Tensor:
    """Switch / GShard auxiliary loss over the batch: E * sum_e(fraction of tokens to e * mean prob of e)."""
    probs = torch.softmax(routing.logits.float(), dim=-1)
    counts = torch.zeros(num_experts, device=probs.device).index_add_(
        0, routing.indices.flatten(), torch.ones(routing.indices.numel(), device=probs.device))
    fraction = counts / routing.indices.numel()
    return num_experts * (fraction * probs.mean(0)).sum()


def sequence_balancing_loss(routing: Routing, num_experts: int, batch: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss: the same product, averaged per sequence."""
    probs = routing.scores.float()
    probs = probs / probs.sum(-1, keepdim=True)
    tokens, k = routing.indices.shape
    seq = tokens // batch
    one_hot = torch.zeros(tokens, num_experts, device=probs.device).scatter_(1, routing.indices, 1.0)
    fraction = one_hot.view(batch, seq, num_experts).sum(1) * num_experts / (k * seq)
    return (fraction * probs.view(batch, seq, num_experts).mean(1)).sum(-1).mean()


def router_z_loss(routing: Routing) -> torch.Tensor:
    """ST-MoE's z-loss: mean squared log-sum-exp of the router logits (keeps logits small)."""
    return torch.logsumexp(routing.logits.float(), dim=-1).square().mean()
