"""Take over only a model's experts, leaving its own block and router in charge of the routing.

Some routers are not something the runtime reproduces: a sparse mixer that picks experts in arg-max
rounds with its own gradient estimator (PhiMoE), a router that is a small network fed by the previous
layer's router state (ZAYA), a router that also scores shared or identity experts. The expert
computation is still the expensive part, and transformers gives experts modules one interface,
`experts(hidden_states, top_k_index, top_k_weights)`, so the runtime can take that part alone: dispatch
by expert, grouped GEMM, weighted combine. Indices at or past the number of experts (identity or skip
slots the block handles itself) contribute nothing here, as in transformers' own experts.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.kernels import registry
from runtime.moe.dispatch import permute, sort_by_expert, unpermute


class RoutedExperts(nn.Module):
    """Drop-in replacement for an experts module called as `experts(hidden, top_k_index, top_k_weights)`."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.experts = experts  # GroupedExperts around the model's own weight stacks
        self.tokens_per_expert: torch.Tensor | None = None  # last step's counts, for run logs

    @property
    def num_experts(self) -> int:
        return self.experts.num_experts

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        indices = top_k_index.reshape(x.shape[0], -1)
        d = sort_by_expert(indices, self.experts.num_experts)
        tokens = registry.lookup("moe.permute", permute)(x, d)
        weights = top_k_weights.reshape(-1).index_select(0, d.order)
        out = self.experts(tokens, d, scale=weights)
        self.tokens_per_expert = d.counts.detach()
        return registry.lookup("moe.unpermute", unpermute)(out, d, x.shape[0]).to(x.dtype).reshape(shape)
