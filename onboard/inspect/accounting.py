"""Full-scale cost of a model, computed from its ModelSpec (never by allocating it).

Conventions (stated because published figures differ on them):
- ``params_active`` counts every parameter that does arithmetic for a token: all non-routed parameters,
  plus top_k / num_experts of the routed experts, plus the LM head; the input embedding table is a lookup
  and is left out (this matches the published active counts of DeepSeek-V3, Mixtral and gpt-oss).
- Training FLOPs per token = 3 x forward (backward costs twice the forward): 2 FLOPs per active
  matmul parameter, plus the token-mixing terms, averaged over the positions of a causal sequence. The
  formulas are `runtime.dims` (`Mixer.flops`), the one FLOP model the predictors use too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from onboard.inspect.spec import ModelSpec
from runtime.dims import Dims, mixers_of
from runtime.runlog import model_record

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def dims_of(spec: ModelSpec) -> Dims:
    """The spec's key dimensions: the record a run log carries (`runtime.runlog.model_record`), with the decoder
    stack in order (each layer's mixer and MLP kind), which a run log does not carry."""
    d = Dims.from_record(model_record(spec.to_dict()))
    layers = spec.to_dict().get("layers") or []
    shapes = [dataclasses.replace(m, layers=0) for m in d.mixers]
    stack = []
    for layer in layers:
        mixer = dataclasses.replace(mixers_of([layer.get("attention") or {}])[0], layers=0)
        if mixer not in shapes or len(layers) != d.layers:
            return d  # a stack that does not add up to the record's mixers: priced by layer counts
        stack.append((shapes.index(mixer), (layer.get("mlp") or {}).get("kind") == "moe"))
    return dataclasses.replace(d, stack=tuple(stack))


@dataclass
class Costs:
    seq_len: int
    params_total: int
    params_active: int
    flops_per_token_forward: float
    flops_per_token_training: float
    attention_share: float  # fraction of training FLOPs spent in token mixing


def costs(spec: ModelSpec, seq_len: int = 4096) -> Costs:
    d = dims_of(spec)  # the same FLOP model the predictors price run logs with
    mixing, forward = d.mixing_flops(seq_len), d.forward_flops_per_token(seq_len)
    return Costs(
        seq_len=seq_len, params_total=spec.params_total, params_active=spec.params_active,
        flops_per_token_forward=forward, flops_per_token_training=d.training_flops_per_token(seq_len),
        attention_share=mixing / forward if forward else 0.0,
    )


def memory_bytes(params: int, *, weights: str = "bf16", grads: str = "fp32", master: str | None = "fp32",
                 optimizer_states: int = 2, optimizer_dtype: str = "fp32") -> dict[str, int]:
    """Bytes for weights, gradients and optimizer state (AdamW: two moments) of `params` parameters."""
    out = {
        "weights": params * DTYPE_BYTES[weights],
        "gradients": params * DTYPE_BYTES[grads],
        "master_weights": params * DTYPE_BYTES[master] if master else 0,
        "optimizer": params * optimizer_states * DTYPE_BYTES[optimizer_dtype],
    }
    out["total"] = sum(out.values())
    return out
