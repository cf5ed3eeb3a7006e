"""A model as the cost model sees it: the run-log key dimensions (`runtime.runlog.MODEL_FIELDS`).

Run logs written by the runtime carry parameter counts taken from the ModelSpec; published runs carry
only shapes, so the counts are rebuilt from them here (gated MLPs, untied embeddings unless told).
"""

from __future__ import annotations

from dataclasses import dataclass

SPARSE_TOPK = 2048  # keys a sparse-attention query attends to when the record does not say (DSA default)
LINEAR_CHUNK = 64  # chunk length of chunk-parallel linear attention


@dataclass(frozen=True)
class Dims:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    experts: int
    top_k: int
    expert_ffn: int
    shared_experts: int
    moe_layers: int
    linear_layers: int
    sparse_layers: int
    params_total: int
    params_active: int

    @classmethod
    def from_record(cls, m: dict) -> Dims:
        def num(key, default=0):
            v = m.get(key)
            return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else default

        layers, hidden = num("layers"), num("hidden")
        if not layers or not hidden:
            raise ValueError(f"model {m.get('name')!r} needs positive layers and hidden")
        heads = num("heads", max(1, hidden // 128))
        experts = num("experts")
        moe_layers = m.get("moe_layers")
        moe_layers = layers if experts and moe_layers is None else num("moe_layers") if experts else 0
        base = {
            "name": str(m.get("name") or "unnamed"), "layers": layers, "hidden": hidden, "heads": heads,
            "kv_heads": num("kv_heads", heads), "head_dim": num("head_dim", hidden // heads), "ffn": num("ffn", 4 * hidden),
            "vocab": num("vocab", 32000), "experts": experts, "top_k": num("top_k", 1) if experts else 0,
            "expert_ffn": num("expert_ffn"), "shared_experts": num("shared_experts"), "moe_layers": moe_layers,
            "linear_layers": num("linear_attention_layers"), "sparse_layers": num("sparse_attention_layers"),
        }
        total, active = count_params(**base)
        return cls(**base, params_total=num("params_total", total), params_active=num("params_active", active))

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    @property
    def expert_params(self) -> int:
        """Routed-expert parameters (gated: three matrices each); the part expert parallelism splits."""
        return self.moe_layers * self.experts * 3 * self.hidden * self.expert_ffn

    @property
    def attention_params_per_layer(self) -> int:
        return 2 * self.hidden * self.head_dim * (self.heads + self.kv_heads)

    def mixing_flops(self, seq_len: int) -> float:
        """Forward FLOPs per token of token mixing (scores and weighted sums), summed over layers."""
        causal = (seq_len + 1) / 2
        per_key = 2 * self.heads * 2 * self.head_dim
        softmax = self.layers - self.linear_layers - self.sparse_layers
        linear = 2 * self.heads * (2 * self.head_dim ** 2 + LINEAR_CHUNK * 2 * self.head_dim)
        return (softmax * per_key * causal + self.sparse_layers * per_key * min(causal, SPARSE_TOPK)
                + self.linear_layers * linear)

    def training_flops_per_token(self, seq_len: int) -> float:
        """Forward + backward (twice the forward) FLOPs per token."""
        return 3 * (2 * self.params_active + self.mixing_flops(seq_len))


def count_params(*, layers, hidden, heads, kv_heads, head_dim, ffn, vocab, experts, top_k, expert_ffn,
                 shared_experts, moe_layers, gated: bool = True, tied: bool = False, **_) -> tuple[int, int]:
    """(total, active) parameters; active leaves out the input embedding and the unchosen experts."""
    mats = 3 if gated else 2
    attn = 2 * hidden * head_dim * (heads + kv_heads)
    routed = experts * 3 * hidden * expert_ffn
    moe = routed + shared_experts * 3 * hidden * expert_ffn + hidden * experts
    dense = mats * hidden * ffn
    body = layers * attn + (layers - moe_layers) * dense + moe_layers * moe
    embed = vocab * hidden
    total = body + embed * (1 if tied else 2)
    unused = moe_layers * (experts - top_k) * 3 * hidden * expert_ffn if experts else 0
    return int(total), int(body - unused + embed)  # the LM head does arithmetic whether tied or not
