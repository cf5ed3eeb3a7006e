"""Top-k routing: which experts each token goes to, and with what weight.

Covers the routers of current MoE families: softmax or sigmoid scores, chosen before or after the top-k;
group-limited top-k (DeepSeek: keep the best `topk_group` of `n_group` expert groups, each scored by the
sum of its best `group_score_top` experts); an expert bias added for selection only (aux-loss-free
balancing); renormalisation of the chosen weights (by their sum, or by their p-norm: DBRX's
moe_normalize_expert_weights); a routed scaling factor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RouterSpec:
    num_experts: int
    top_k: int
    score: str = "softmax"  # "softmax" | "sigmoid" | "sqrtsoftplus"
    order: str = "score_then_topk"  # or "topk_then_score" (score the chosen logits), or "static" (given ids)
    renormalize: bool = False
    n_group: int | None = None
    topk_group: int | None = None
    group_score_top: int = 2
    scaling: float | None = None
    renormalize_eps: float = 0.0
    renorm_p: float | None = None  # renormalise by the p-norm of the chosen weights instead of their sum


@dataclass
class Routing:
    weights: torch.Tensor  # (tokens, k) combine weights
    indices: torch.Tensor  # (tokens, k) expert ids
    logits: torch.Tensor  # (tokens, experts) router logits, for auxiliary losses
    scores: torch.Tensor  # (tokens, experts) scores before bias and selection

    def tokens_per_expert(self, num_experts: int) -> torch.Tensor:
        return torch.bincount(self.indices.flatten(), minlength=num_experts)


_SCORE_FNS = {
    "softmax": lambda x: torch.softmax(x, dim=-1, dtype=torch.float32),
    "sigmoid": lambda x: torch.sigmoid(x.float()),
    "sqrtsoftplus": lambda x: torch.sqrt(torch.nn.functional.softplus(x.float())),  # DeepSeek-V4
}
SCORES = tuple(_SCORE_FNS)  # the score functions the runtime routes with
ORDERS = ("score_then_topk", "topk_then_score", "static")  # score all then pick, pick then score, given ids


def _score(x: torch.Tensor, fn: str) -> torch.Tensor:
    if fn not in _SCORE_FNS:
        raise ValueError(f"unknown router score function {fn!r}")
    return _SCORE_FNS[fn](x)


def _group_mask(choice: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """Keep only experts in the best `topk_group` groups (others get -inf for selection)."""
    tokens = choice.shape[0]
    grouped = choice.view(tokens, spec.n_group, spec.num_experts // spec.n_group)
    group_scores = grouped.topk(min(spec.group_score_top, grouped.shape[-1]), dim=-1).values.sum(-1)
    keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(spec.topk_group, dim=-1).indices, 1.0)
    keep = keep.unsqueeze(-1).expand_as(grouped).reshape(tokens, -1)
    return choice.masked_fill(keep == 0, float("-inf"))


def route(logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None = None,
          indices: torch.Tensor | None = None) -> Routing:
    """Route `(tokens, experts)` logits. Gradients flow into the weights of the chosen experts.
    With `order="static"` the expert ids are given (`indices`, e.g. looked up from a token-id table)."""
    if spec.order == "static":
        scores = _score(logits, spec.score)
        weights = scores.gather(1, indices)
        if spec.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + spec.renormalize_eps)
    elif spec.order == "topk_then_score":
        choice = logits if bias is None else logits + bias.float()
        indices = choice.topk(spec.top_k, dim=-1).indices
        weights = _score(logits.gather(1, indices), spec.score)
        scores = weights
        if spec.renormalize and spec.score != "softmax":
            weights = weights / (weights.sum(dim=-1, keepdim=True) + spec.renormalize_eps)
    else:
        scores = _score(logits, spec.score)
        choice = scores if bias is None else scores + bias.float()
        if spec.n_group and spec.n_group > 1 and spec.topk_group and spec.topk_group < spec.n_group:
            choice = _group_mask(choice, spec)
        indices = choice.topk(spec.top_k, dim=-1).indices
        weights = scores.gather(1, indices)
        if spec.renormalize and spec.renorm_p is not None:
            weights = weights / torch.linalg.vector_norm(weights, spec.renorm_p, dim=-1, keepdim=True)
        elif spec.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + spec.renormalize_eps)
    if spec.scaling is not None:
        weights = weights * spec.scaling
    return Routing(weights=weights, indices=indices, logits=logits, scores=scores)


def update_expert_bias(bias: torch.Tensor, tokens_per_expert: torch.Tensor, rate: float = 1e-3) -> None:
    """Aux-loss-free balancing (DeepSeek-V3): raise the bias of under-loaded experts, lower over-loaded ones.

    Called after each optimizer step with the step's token counts (summed over data-parallel ranks)."""
    load = tokens_per_expert.float()
    with torch.no_grad():
        bias.add_(rate * torch.sign(load.mean() - load))
