"""ModelSpec: what a model is made of, at full scale, as JSON with a schema version.

Field names read by other tools (keep them stable): model_type, num_layers, params_total, params_active,
layers[i].attention.kind, layers[i].mlp.kind, and for MoE layers mlp.num_experts, mlp.top_k,
mlp.num_shared_experts, mlp.router.score.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

SCHEMA_VERSION = 1


@dataclass
class Router:
    score: str = "softmax"  # "softmax" | "sigmoid" | other op name
    order: str = "score_then_topk"  # or "topk_then_score" (softmax over the chosen logits)
    renormalize: bool = False
    renorm_p: float | None = None  # renormalised by the chosen weights' p-norm, not their sum (DBRX: p = 2 possible)
    group_limited: bool = False
    n_group: int | None = None
    topk_group: int | None = None
    bias_correction: bool = False  # aux-loss-free balancing: a per-expert bias added only for selection
    scaling: float | None = None  # routed scaling factor
    group_score_top: int | None = None  # a group is scored by the sum of its best N experts
    path: str = ""
    weight: str | None = None  # parameter path (relative to the layer) of the router projection
    bias: str | None = None  # parameter / buffer path of the selection-only expert bias
    linear_bias: str | None = None  # bias of the router projection itself (added to every logit)
    logit_width: int | None = None  # router outputs; more than num_experts when zero / shared experts are routed
    direct: bool = True  # the router is one projection of the tokens the experts receive
    table: str | None = None  # static routing: (vocab, k) table of expert ids indexed by token id
    token_input: str | None = None  # the layer input that carries the token ids for a static table
    config_fields: dict = field(default_factory=dict)  # top_k / n_group / topk_group -> config attribute


@dataclass
class MLP:
    kind: str = "dense"  # "dense" | "moe" | "none"
    path: str = ""
    activation: str | None = None
    gated: bool | None = None
    ffn: int | None = None  # dense MLP inner width
    num_experts: int | None = None
    top_k: int | None = None
    expert_ffn: int | None = None
    expert_layout: str | None = None  # "fused" (3-D weights) | "modules" (one sub-MLP per expert)
    experts_path: str | None = None
    num_shared_experts: int = 0
    shared_expert_ffn: int | None = None
    shared_expert_gated: bool = False  # shared output scaled by sigmoid(linear(x))
    shared_path: str | None = None
    shared_gate_weight: str | None = None
    expert_weights: dict = field(default_factory=dict)  # role (gate_up, gate, up, down, *_bias) -> param path
    expert_interleaved: bool = False  # gate and up rows alternate instead of [gate; up]
    expert_transposed: bool = False  # stacks stored (E, in, out) rather than (E, out, in)
    # stacks stored flat, (E·rows, cols), and viewed per expert in the forward (DBRX): role -> "out_in" | "in_out",
    # how each expert's (rows, cols) matrix is read (DBRX reads its gate and up as (out, in), its down as (in, out))
    expert_flat: dict = field(default_factory=dict)
    weight_on_input: bool = False  # routing weight scales the token before the experts (Llama 4)
    outputs: int = 1  # how many values the block returns (router logits ride second)
    post_norm: str | None = None  # module normalising the block's output
    output_bias: str | None = None  # vector added to the combined routed output
    zero_experts: int = 0  # routing slots beyond the routed experts (identity / zero-compute experts)
    router: Router | None = None


@dataclass
class Attention:
    kind: str = "softmax"
    path: str = ""
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    v_head_dim: int | None = None
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    rope_head_dim: int | None = None
    window: int | None = None
    sinks: bool = False
    output_gate: bool = False
    qk_norm: bool = False
    index_topk: int | None = None
    index_heads: int | None = None
    index_head_dim: int | None = None
    conv_kernel: int | None = None
    gate: str | None = None  # linear attention decay: "scalar" per head or "channel" per key channel
    state_size: int | None = None  # state-space mixers: the state dim per head (Mamba's d_state / N)


@dataclass
class Layer:
    index: int
    attention: Attention
    mlp: MLP
    norms: list[str] = field(default_factory=list)
    params: int = 0
    params_active: int = 0
    twin_layer: int = 0


@dataclass
class Unmatched:
    path: str
    reason: str


@dataclass
class ModelSpec:
    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    tie_embeddings: bool
    layers: list[Layer]
    layers_path: str = ""  # module path of the decoder layer list
    params_total: int = 0
    params_active: int = 0
    params_active_with_embedding: int = 0  # the convention some model cards use (Qwen, Mistral)
    params_embedding: int = 0
    params_head: int = 0
    max_position_embeddings: int | None = None
    head: dict = field(default_factory=dict)  # path, loss, logit softcap
    capture: dict = field(default_factory=dict)  # how each graph was captured
    unmatched: list[Unmatched] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict) -> "ModelSpec":
        """A spec from its JSON form; ValueError (one line) for anything that is not one."""
        if not isinstance(data, dict):
            raise ValueError(f"a spec is a JSON object, got {type(data).__name__}")
        try:
            spec = cls._build(data)
        except (TypeError, AttributeError, KeyError) as exc:
            raise ValueError(f"not a ModelSpec: {type(exc).__name__}: {' '.join(str(exc).split())}") from None
        problems = spec.problems()
        if problems:
            raise ValueError("; ".join(problems[:3]))
        return spec

    def problems(self) -> list[str]:
        """Sizes that cannot describe a model, one phrase each (empty when the spec is sound)."""
        def whole(value, low=1):
            return isinstance(value, int) and not isinstance(value, bool) and value >= low

        out = [f"{name} must be a whole number of at least 1, got {getattr(self, name)!r}"
               for name in ("vocab_size", "hidden_size", "num_layers") if not whole(getattr(self, name))]
        out += [f"{name} must be a whole number of at least 0, got {getattr(self, name)!r}"
                for name in ("params_total", "params_active") if not whole(getattr(self, name), 0)]
        for layer in self.layers:
            a, m = layer.attention, layer.mlp
            sizes = {"attention.num_heads": a.num_heads, "attention.head_dim": a.head_dim,
                     "mlp.num_experts": m.num_experts, "mlp.top_k": m.top_k, "mlp.ffn": m.ffn,
                     "mlp.expert_ffn": m.expert_ffn}
            out += [f"layer {layer.index}: {k} must be a whole number of at least 1 or null, got {v!r}"
                    for k, v in sizes.items() if v is not None and not whole(v)]
            if whole(m.num_experts) and whole(m.top_k) and m.top_k > m.num_experts + m.zero_experts:
                out.append(f"layer {layer.index}: top-{m.top_k} of {m.num_experts} experts")
        return out

    @classmethod
    def _build(cls, data: dict) -> "ModelSpec":
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"spec schema version {data.get('schema_version')} is not {SCHEMA_VERSION}")
        data = dict(data)
        layers = []
        for raw in data.pop("layers"):
            raw = dict(raw)
            mlp = dict(raw.pop("mlp"))
            router = mlp.pop("router")
            layers.append(Layer(
                attention=Attention(**raw.pop("attention")),
                mlp=MLP(**mlp, router=Router(**router) if router else None),
                **raw,
            ))
        unmatched = [Unmatched(**u) for u in data.pop("unmatched", [])]
        return cls(layers=layers, unmatched=unmatched, **data)

    @classmethod
    def from_json(cls, text: str) -> "ModelSpec":
        return cls.from_dict(json.loads(text))

    # -- summaries --------------------------------------------------------------------------------
    def layer_pattern(self) -> list[tuple[str, int]]:
        """Run-length encoding of per-layer (attention kind / mlp kind) labels."""
        out: list[tuple[str, int]] = []
        for layer in self.layers:
            label = f"{layer.attention.kind}+{layer.mlp.kind}"
            if out and out[-1][0] == label:
                out[-1] = (label, out[-1][1] + 1)
            else:
                out.append((label, 1))
        return out

