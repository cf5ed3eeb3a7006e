"""The runtime MoE layer: route, dispatch, grouped expert MLPs, combine, shared experts.

Built around a HuggingFace model's own parameters (the same Parameter objects, no copies), so optimizer
state, checkpoints and parameter names of the rest of the model are unaffected.
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from runtime import recorders
from runtime.kernels import registry
from runtime.moe.dispatch import Dispatch, permute, sort_by_expert, unpermute
from runtime.moe.gating import is_silu, swiglu
from runtime.moe.grouped import grouped_mm
from runtime.moe.router import RouterSpec, Routing, route

ACTIVATIONS: dict[str, Callable] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}


class GroupedExperts(nn.Module):
    """Experts stored as 3-D stacks: (E, 2F, H) gate+up and (E, H, F) down, or their transposes; or stored flat,
    (E·rows, cols) matrices viewed (E, rows, cols) at each use (DBRX), each stack read as its `layouts` entry says."""

    STACKS = ("gate_up", "up", "down")

    def __init__(self, gate_up: nn.Parameter, down: nn.Parameter, *, activation: Callable | None, gated: bool = True,
                 num_experts: int | None = None,
                 transposed: bool = False, interleaved: bool = False, gate_up_bias: nn.Parameter | None = None,
                 down_bias: nn.Parameter | None = None, gate_fn: Callable | None = None,
                 up: nn.Parameter | None = None, layouts: dict[str, str] | None = None):
        super().__init__()
        self.gate_up, self.down = gate_up, down
        if down.dim() == 2 and not num_experts:
            raise ValueError("experts stored flat, (experts x rows, cols), need their count (num_experts)")
        # stacks may hold extra (unused) rows for zero experts: only the first `experts` are computed
        self.experts = num_experts or down.shape[0]
        self.up = up  # separate up stack (gate_up then holds the gate alone)
        self.gate_up_bias, self.down_bias = gate_up_bias, down_bias
        self.activation, self.gated = activation, gated
        self.transposed, self.interleaved = transposed, interleaved
        # per stack, "out_in" (nn.Linear's layout) or "in_out", where the stacks differ (DBRX's down is (in, out))
        self.layouts = dict(layouts or {})
        self.gate_fn = gate_fn  # a model-specific gating function (e.g. clamped SwiGLU), applied to gate+up
        # [gate; up] with SiLU: one fused node for the activation, the product and the routing weight
        self.fused_swiglu = gated and not interleaved and gate_fn is None and up is None and is_silu(activation)

    @property
    def num_experts(self) -> int:
        return self.experts

    def is_transposed(self, name: str) -> bool:
        """Whether stack `name` is (E, in, out) rather than nn.Linear's (E, out, in)."""
        return self.layouts.get(name, "in_out" if self.transposed else "out_in") == "in_out"

    def stack(self, name: str) -> torch.Tensor:
        """Stack `name` as (E, rows, cols): a flat (E·rows, cols) matrix is viewed so (no copy; its gradient
        reaches the stored parameter)."""
        w = getattr(self, name)
        return w.view(self.experts, -1, w.shape[-1]) if w.dim() == 2 else w

    def _mm(self, x: torch.Tensor, name: str, d: Dispatch) -> torch.Tensor:
        mm = registry.lookup("moe.grouped_mm", grouped_mm)
        w = self.stack(name)
        w = w[: self.experts] if w.shape[0] > self.experts else w
        return mm(x, w, d.counts, out_in=not self.is_transposed(name))

    def forward(self, x: torch.Tensor, d: Dispatch, scale: torch.Tensor | None = None) -> torch.Tensor:
        """Expert outputs for sorted tokens; `scale` (one per row) multiplies each row's output."""
        h = self._mm(x, "gate_up", d)
        if self.fused_swiglu and self.gate_up_bias is None and self.down_bias is None:
            return self._mm(swiglu(h, scale.to(h.dtype) if scale is not None else None), "down", d)
        if self.up is not None:
            h = torch.cat([h, self._mm(x, "up", d)], dim=-1)
        if self.gate_up_bias is not None:
            h = h + self.gate_up_bias.index_select(0, d.expert_ids)
        if self.gate_fn is not None:
            h = self.gate_fn(h)
        elif self.gated:
            gate, up = (h[..., ::2], h[..., 1::2]) if self.interleaved else h.chunk(2, dim=-1)
            h = self.activation(gate) * up
        else:
            h = self.activation(h)
        if scale is not None and self.down_bias is None:
            # the output projection is linear: scaling its (narrower) input is the same and cheaper
            return self._mm(h * scale.unsqueeze(-1).to(h.dtype), "down", d)
        y = self._mm(h, "down", d)
        if self.down_bias is not None:
            y = y + self.down_bias.index_select(0, d.expert_ids)
        return y if scale is None else y * scale.unsqueeze(-1).to(y.dtype)


class ModuleExperts(nn.Module):
    """Experts kept as one sub-module each (the model's own code), run on their slices of sorted tokens."""

    def __init__(self, experts: nn.ModuleList):
        super().__init__()
        self.experts = experts

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    def _sharded(self) -> bool:
        if not torch.distributed.is_available():
            return False
        from torch.distributed.fsdp import FSDPModule

        return isinstance(self, FSDPModule) or any(isinstance(e, FSDPModule) for e in self.experts)

    def forward(self, x: torch.Tensor, d: Dispatch, scale: torch.Tensor | None = None) -> torch.Tensor:
        outputs, start = [], 0
        # under FSDP2 the ranks reduce-scatter the gradients of the experts' parameters together, and a
        # parameter without a gradient on one rank (its expert got no tokens there) leaves it out of that rank's
        # reduce-scatter: the ranks' collectives stop matching. So every expert runs, empty slices included.
        every = self._sharded()
        for expert, n in zip(self.experts, d.counts.tolist()):
            if n or every:
                outputs.append(expert(x[start:start + n]))
            start += n
        y = torch.cat(outputs) if outputs else x.new_zeros(0, x.shape[-1])
        return y if scale is None else y * scale.unsqueeze(-1).to(y.dtype)


class MoEBlock(nn.Module):
    """Drop-in replacement for a model's MoE block."""

    def __init__(self, router_weight: nn.Parameter, spec: RouterSpec, experts: nn.Module, *,
                 router_bias: torch.Tensor | None = None, shared: list[nn.Module] | None = None,
                 shared_gate_weight: nn.Parameter | None = None, capacity_factor: float | None = None,
                 outputs: int = 1, weight_on_input: bool = False, router_linear_bias: torch.Tensor | None = None,
                 post_norm: nn.Module | None = None, output_bias: torch.Tensor | None = None,
                 zero_experts: int = 0, table: torch.Tensor | None = None, token_input: str | None = None,
                 router_module: nn.Module | None = None, router_name: str = "router_module"):
        super().__init__()
        # the model's own router module, kept under its own name (recorders match module names such as
        # "mlp.gate") so that whatever records its outputs still sees them: transformers collects router
        # logits this way for the auxiliary loss. It only runs when something observes it.
        self.router_name = router_name if router_module is not None else None
        self._observe_extra: tuple = ()
        if router_module is not None:
            self.add_module(router_name, router_module)
            # some routers take the selection bias as a second argument (MiniMax-M2)
            required = [p for p in inspect.signature(router_module.forward).parameters.values()
                        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            if len(required) > 1 and router_bias is not None:
                self._observe_extra = (router_bias,)
        self.table, self.token_input = table, token_input  # static routing: expert ids by token id
        self.zero_experts = zero_experts  # routing slots past the real experts: identity (zero-compute) experts
        self.output_bias = output_bias  # added to the routed output (JetMoE)
        self.post_norm = post_norm  # the model's own norm on the block output
        self.router_weight = router_weight
        self.router_linear_bias = router_linear_bias
        self.router_bias = router_bias  # selection-only expert bias (aux-loss-free balancing); a buffer upstream
        self.spec = spec
        self.experts = experts
        self.shared = nn.ModuleList(shared or [])
        self.shared_gate_weight = shared_gate_weight
        self.capacity_factor = capacity_factor
        self.outputs = outputs  # how many values the replaced block returned (logits ride second)
        self.weight_on_input = weight_on_input
        self.tokens_per_expert: torch.Tensor | None = None  # last step's counts, for run logs
        self.last_routing: Routing | None = None
        # set by runtime.parallel: runs the experts across an expert-parallel group (a plain callable, not a
        # module, so it adds no parameters or state-dict entries)
        self.expert_parallel: Callable | None = None

    @property
    def num_experts(self) -> int:
        """Routed experts of the whole model (all ranks together under expert parallelism)."""
        if self.expert_parallel is not None:
            return self.expert_parallel.num_experts
        return self.experts.num_experts

    def _run_experts(self, tokens: torch.Tensor, d: Dispatch, scale: torch.Tensor | None) -> torch.Tensor:
        if self.expert_parallel is not None:
            return self.expert_parallel(self.experts, tokens, d, scale)
        return self.experts(tokens, d, scale=scale)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        bias = self.router_linear_bias.float() if self.router_linear_bias is not None else None
        logits = F.linear(x.float(), self.router_weight.float(), bias)
        observed = getattr(self, self.router_name) if self.router_name else None
        if observed is not None and recorders.observed(observed):
            observed(x, *self._observe_extra)  # as the model's own blocks call it: one row per token
        fixed = None
        if self.table is not None:
            fixed = self.table[kwargs[self.token_input].reshape(-1)].long()
        routing = route(logits, self.spec, self.router_bias, fixed)
        d = sort_by_expert(routing.indices, self.num_experts, self.capacity_factor)
        tokens = registry.lookup("moe.permute", permute)(x, d)
        weights = routing.weights.reshape(-1).index_select(0, d.order)  # in sorted order
        if self.weight_on_input:  # e.g. Llama 4: scale the token before the expert, sum outputs unweighted
            tokens = tokens * weights.unsqueeze(-1).to(tokens.dtype)
            expert_out = self._run_experts(tokens, d, None)
        else:
            expert_out = self._run_experts(tokens, d, weights)
        # assignments dropped by a capacity limit contribute nothing; the residual stream carries the token
        out = registry.lookup("moe.unpermute", unpermute)(expert_out, d, x.shape[0]).to(x.dtype)
        if self.zero_experts:  # a zero expert returns its input: it adds weight * token
            identity = (routing.indices >= self.num_experts).to(routing.weights.dtype)
            out = out + (routing.weights * identity).sum(-1, keepdim=True).to(x.dtype) * x
        if self.output_bias is not None:
            out = out + self.output_bias
        for module in self.shared:
            s = module(x)
            if self.shared_gate_weight is not None:
                s = torch.sigmoid(F.linear(x, self.shared_gate_weight)) * s
            out = out + s
        self.tokens_per_expert = d.counts.detach()
        self.last_routing = routing
        out = out.reshape(shape)
        if self.post_norm is not None:
            out = self.post_norm(out)
        return out if self.outputs == 1 else (out, logits) + (None,) * (self.outputs - 2)
