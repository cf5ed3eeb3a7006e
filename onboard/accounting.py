"""Full-scale cost of a model, computed from its ModelSpec (never by allocating it).

Conventions (stated because published figures differ on them):
- ``params_active`` counts every parameter that does arithmetic for a token: all non-routed parameters,
  plus top_k / num_experts of the routed experts, plus the LM head; the input embedding table is a lookup
  and is left out (this matches the published active counts of DeepSeek-V3, Mixtral and gpt-oss).
- Training FLOPs per token = 3 x forward (backward costs twice the forward): 2 FLOPs per active
  matmul parameter, plus the token-mixing terms, averaged over the positions of a causal sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

from onboard.spec import Attention, ModelSpec

LINEAR_CHUNK = 64  # chunk length of chunk-parallel linear attention (flash-linear-attention's default)

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def _avg_context(seq_len: int, window: int | None) -> float:
    """Mean number of keys a causal query sees, with an optional sliding window."""
    if not window or window >= seq_len:
        return (seq_len + 1) / 2
    # positions < window see i+1 keys, the rest see `window`
    head = window * (window + 1) / 2
    return (head + (seq_len - window) * window) / seq_len


def mixer_flops(attn: Attention, seq_len: int) -> float:
    """Forward FLOPs per token of the token-mixing part (scores and weighted sums, not projections)."""
    h = attn.num_heads or 0
    dk = attn.head_dim or 0
    dv = attn.v_head_dim or dk
    kind = attn.kind
    if kind in ("softmax", "mla", "sliding"):
        return 2 * h * (dk + dv) * _avg_context(seq_len, attn.window)
    if kind == "chunked":
        return 2 * h * (dk + dv) * ((attn.window or seq_len) + 1) / 2
    if kind == "sparse:dsa":
        selected = _avg_context(seq_len, attn.index_topk)
        indexer = 2 * (attn.index_heads or 0) * (attn.index_head_dim or 0) * _avg_context(seq_len, None)
        return 2 * h * (dk + dv) * selected + indexer
    if kind.startswith("linear") or kind.startswith("ssm"):
        d = attn.head_dim or 0
        dk = attn.state_size or d  # a state-space head's state is (state size x head dim)
        # state update + readout (2 dk x d products) and the intra-chunk quadratic part
        return 2 * h * (2 * dk * d + LINEAR_CHUNK * (dk + d))
    return 0.0


@dataclass
class Costs:
    seq_len: int
    params_total: int
    params_active: int
    flops_per_token_forward: float
    flops_per_token_training: float
    attention_share: float  # fraction of training FLOPs spent in token mixing


def costs(spec: ModelSpec, seq_len: int = 4096) -> Costs:
    matmul_active = spec.params_active  # already excludes the input embedding
    mixing = sum(mixer_flops(layer.attention, seq_len) for layer in spec.layers)
    forward = 2 * matmul_active + mixing
    return Costs(
        seq_len=seq_len, params_total=spec.params_total, params_active=spec.params_active,
        flops_per_token_forward=forward, flops_per_token_training=3 * forward,
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
