"""LoRA: low-rank adapters on attention projections (nn.Linear) and on expert stacks (one A/B pair per expert).

The base weights stay the same Parameter objects under the same names, frozen; adapters are new parameters
named `lora_*` beside them, so a checkpoint of the adapters alone is `lora_state_dict(model)`. Expert
adapters are stacks with one row per expert, so expert parallelism splits them exactly like the experts.
Apply LoRA before `runtime.parallel.parallelize` shards anything (it does so itself when `plan.lora` is set).
Applying it is one swap (`runtime.swap`, kind LORA): its handle's `undo()` gives back the base model (modules,
classes, parameters and which of them train), before anything sharded it.
"""

from __future__ import annotations

import fnmatch
import math

import torch
import torch.nn.functional as F
from torch import nn

from runtime.moe.block import GroupedExperts, ModuleExperts
from runtime.moe.grouped import grouped_mm
from runtime.plan import LoRA
from runtime.swap import LORA, Swap

PREFIX = "lora_"


class LoRALinear(nn.Module):
    """y = x W^T + b + (alpha / r) x A^T B^T, with W and b the wrapped nn.Linear's own parameters."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.scaling = alpha / rank
        self.lora_a = nn.Parameter(base.weight.new_empty(rank, base.in_features))
        self.lora_b = nn.Parameter(base.weight.new_zeros(base.out_features, rank))  # starts as the base model
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scaling


class LoRAGroupedExperts(GroupedExperts):
    """GroupedExperts whose stacks each get a per-expert low-rank update, computed as two grouped matmuls.

    An existing GroupedExperts becomes one in place (its class is changed, as FSDP2 does, through the swap's
    handle), so its parameters keep their names and identities."""

    def _mm(self, x: torch.Tensor, name: str, d) -> torch.Tensor:
        y = super()._mm(x, name, d)
        a, b = getattr(self, f"{PREFIX}{name}_a"), getattr(self, f"{PREFIX}{name}_b")
        low = grouped_mm(x, a, d.counts, out_in=True)
        return y + grouped_mm(low, b, d.counts, out_in=True) * self.lora_scaling

    @classmethod
    def convert(cls, experts: GroupedExperts, rank: int, alpha: float, swap: Swap | None = None) -> Swap:
        """Make `experts` one, adapters added; the handle that undoes it (`swap`'s, when given)."""
        swap = swap if swap is not None else Swap(LORA)
        swap.set_class(experts, cls)
        swap.set(experts, "lora_scaling", alpha / rank)
        e = experts.experts
        for name in cls.STACKS:
            if getattr(experts, name) is None:
                continue
            w = experts.stack(name)
            out_dim, in_dim = (w.shape[2], w.shape[1]) if experts.is_transposed(name) else (w.shape[1], w.shape[2])
            a = nn.Parameter(w.new_empty(e, rank, in_dim))
            for row in a.data:  # each expert's A initialised as an nn.Linear's weight
                nn.init.kaiming_uniform_(row, a=math.sqrt(5))
            swap.set(experts, f"{PREFIX}{name}_a", a)
            swap.set(experts, f"{PREFIX}{name}_b", nn.Parameter(w.new_zeros(e, out_dim, rank)))
        return swap


def _is_attention(name: str) -> bool:
    return any("attn" in part or "attention" in part for part in name.split("."))


def apply_lora(model: nn.Module, lora: LoRA) -> Swap:
    """Add adapters to the targets of `lora` and freeze everything else; returns the handle (kind LORA) whose
    `parts` are the adapted module names, each "linear" or "experts", and whose `calls` count each kind's
    forward passes.

    Targets: "attention" (every nn.Linear under a module named *attn* / *attention*), "experts" (runtime
    expert stacks, and the nn.Linear layers of per-module experts), or fnmatch patterns of module names."""
    if lora.rank < 1:
        raise ValueError(f"LoRA rank must be at least 1, got {lora.rank}")
    known = {"attention", "experts"}
    patterns = [t for t in lora.targets if t not in known]
    expert_roots = [name for name, m in model.named_modules() if isinstance(m, (GroupedExperts, ModuleExperts))]
    swap = Swap(LORA)
    for name, module in list(model.named_modules()):
        if isinstance(module, GroupedExperts) and "experts" in lora.targets:
            LoRAGroupedExperts.convert(module, lora.rank, lora.alpha, swap)
            swap.count_calls(module, "experts")
            swap.parts[name] = "experts"
            continue
        if not isinstance(module, nn.Linear):
            continue
        in_experts = any(name.startswith(root + ".") for root in expert_roots)
        wanted = (("attention" in lora.targets and _is_attention(name) and not in_experts)
                  or ("experts" in lora.targets and in_experts)
                  or any(fnmatch.fnmatch(name, p) for p in patterns))
        if wanted:
            swap.replace(model, name, LoRALinear(module, lora.rank, lora.alpha), "linear")
            swap.parts[name] = "linear"
    if not swap.parts:  # nothing changed
        raise ValueError(f"LoRA targets {lora.targets} match no module of {type(model).__name__}")
    trained = {p: p.requires_grad for p in model.parameters()}

    def unfreeze():
        for p, flag in trained.items():
            p.requires_grad_(flag)

    swap.on_undo(unfreeze)
    for pname, p in model.named_parameters():
        p.requires_grad_(is_lora_name(pname))
    return swap


def is_lora_name(name: str) -> bool:
    return name.rpartition(".")[2].startswith(PREFIX)


def has_lora(model: nn.Module) -> bool:
    return any(is_lora_name(name) for name, _ in model.named_parameters())


def reset_lora(model: nn.Module) -> None:
    """Start every adapter afresh: B = 0 (the model computes what its base weights do) and A uniform in
    +-1 / sqrt(fan_in) per expert row, as `nn.Linear` (kaiming, a = sqrt(5)) initialises a weight. For adapters
    made on the meta device and allocated later (sharded or not)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not is_lora_name(name):
                continue
            if name.endswith("_b"):
                p.zero_()
            else:
                p.uniform_(-1 / math.sqrt(p.shape[-1]), 1 / math.sqrt(p.shape[-1]))


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters alone, as full tensors (FSDP2 shards and expert-parallel slices gathered).
    Under torch.distributed this is collective: every rank must call it."""
    import torch.distributed as dist

    state = {k: v for k, v in model.state_dict().items() if is_lora_name(k)}
    if dist.is_initialized() and dist.get_world_size() > 1:
        from runtime.parallel.state import gather_experts

        state = gather_experts(model, state)
    return {k: v.detach().clone() for k, v in state.items()}


def load_lora_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load full adapter tensors (as `lora_state_dict` wrote them) into a model, sharded or not."""
    from runtime.parallel.state import load_full_state

    own = {k for k in model.state_dict() if is_lora_name(k)}
    if not set(state) <= own or not all(is_lora_name(k) for k in state):
        raise ValueError(f"not adapters of this model: {sorted(set(state) - own)[:3]}")
    if own - set(state):
        raise ValueError(f"adapters missing from the state: {sorted(own - set(state))[:3]}")
    load_full_state(model, state, strict=False)
