"""Token dispatch: sort (token, expert) assignments by expert, and bring results back weighted."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Dispatch:
    order: torch.Tensor  # (assignments,) flat assignment index, sorted by expert
    expert_ids: torch.Tensor  # (assignments,) expert of each sorted assignment
    counts: torch.Tensor  # (experts,) assignments per expert (after any dropping)
    keep: torch.Tensor | None  # (tokens * k,) False where capacity dropped the assignment
    top_k: int


def sort_by_expert(indices: torch.Tensor, num_experts: int, capacity_factor: float | None = None) -> Dispatch:
    """Sort assignments by expert (stable, so tokens keep their order inside an expert). Ids at or past
    `num_experts` (zero-compute experts) are left out of the computation, like capacity-dropped ones."""
    flat = indices.reshape(-1)
    keep = None
    if bool((flat >= num_experts).any()):
        keep = flat < num_experts
        flat = torch.where(keep, flat, torch.full_like(flat, num_experts))
    if capacity_factor is not None:
        tokens, k = indices.shape
        capacity = int(torch.ceil(torch.tensor(capacity_factor * tokens * k / num_experts)).item())
        one_hot = torch.nn.functional.one_hot(flat, num_experts + 1)[:, :num_experts]
        position = (torch.cumsum(one_hot, 0) * one_hot).sum(-1) - 1  # rank of each assignment in its expert
        keep = (position < capacity) if keep is None else keep & (position < capacity)
        flat = torch.where(keep, flat, torch.full_like(flat, num_experts))  # dropped go past the last expert
    order = torch.sort(flat, stable=True).indices
    expert_ids = flat[order]
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
    if keep is not None:
        order = order[: int(counts.sum())]
        expert_ids = expert_ids[: order.numel()]
    return Dispatch(order=order, expert_ids=expert_ids, counts=counts, keep=keep, top_k=indices.shape[1])


def permute(x: torch.Tensor, d: Dispatch) -> torch.Tensor:
    """(tokens, hidden) -> (assignments, hidden), grouped by expert."""
    return x.index_select(0, d.order // d.top_k)


def unpermute(y: torch.Tensor, d: Dispatch, tokens: int) -> torch.Tensor:
    """(assignments, hidden) expert outputs, already weighted -> (tokens, hidden), summed per token."""
    return y.new_zeros(tokens, y.shape[-1]).index_add_(0, d.order // d.top_k, y)
