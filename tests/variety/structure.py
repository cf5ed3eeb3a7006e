"""What a model is made of, per decoder layer, read from the instantiated model's module tree and its config.

This is the yardstick a spec is checked against, so it must not share a reading with what it checks: it never
imports the matchers (onboard.inspect.patterns), inspection or the twin, and it uses what they never use: class names of
the model's own modules and the config's own fields. Per layer it says:

- the token mixer's class: "linear" (linear attention, state-space, recurrent or short-convolution mixers),
  "sparse" (attention whose module holds an indexer that picks keys, or whose layer type the config calls
  indexed / sparse), "softmax", or "none";
- whether the layer is MoE (it holds an E-way stack of expert weights, E the config's expert count) and, for
  MoE layers, E and the top-k where the config states it;
- the window of sliding / chunked layers where the config states one.

`disagreements(spec, expected)` lists, one line each, where a spec says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

EXPERT_NAMES = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOPK_NAMES = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "moe_top_k")
WINDOW_NAMES = {"sliding": ("sliding_window", "sliding_window_size"), "chunked": ("attention_chunk_size",)}
LAYER_TYPE_NAMES = ("layer_types", "layers_block_type")
LAYER_COUNT_NAMES = ("num_hidden_layers", "num_layers", "n_layers")
SPARSE_TYPE_WORDS = ("index", "sparse")  # a layer type that says attention over picked keys

# words in a module's class name (after the family's own prefix) that say what kind of token mixer it is, by
# priority: a linear or recurrent mixer (KimiDeltaAttention and MiniMaxLightningAttention are attention by name
# but linear mixers), then attention, then a short convolution (Inkling's convolutions beside its attention do
# not make the layer linear; LFM's convolution layers hold nothing else)
MIXER_WORDS = (("linear", ("mamba", "mixer", "deltanet", "deltaattention", "lightning", "recurrent", "rglru", "ssm")),
               ("attention", ("attention", "attn", "mla")),
               ("linear", ("shortconv",)))

# the spec's attention kinds by class
KIND_CLASS = {"softmax": "softmax", "sliding": "softmax", "chunked": "softmax", "mla": "softmax", "none": "none",
              "conv": "linear"}


@dataclass
class LayerExpect:
    index: int
    mixer: str  # "linear" | "sparse" | "softmax" | "none" | "either" (linear or softmax: a layer holding both)
    moe: bool
    num_experts: int | None
    top_k: int | None
    window: int | None  # stated window of a sliding / chunked layer
    why: str = ""  # what the mixer class was read from


def kind_class(kind: str) -> str:
    """The class of a spec attention kind: linear:* / ssm:* / conv are linear, sparse:* sparse."""
    if kind.startswith(("linear:", "ssm:")):
        return "linear"
    if kind.startswith("sparse:"):
        return "sparse"
    return KIND_CLASS.get(kind, kind)


def config_value(config, names) -> int | None:
    """The first whole-number field of these names, in the config or in a nested part of it that is no model of
    its own (DBRX's ffn_config; not a multimodal text_config, which is a family of its own)."""
    parts = [config] + [v for v in vars(config).values() if hasattr(v, "to_dict") and not getattr(v, "model_type", "")]
    for part in parts:
        for name in names:
            value = getattr(part, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def decoder_layers(model: nn.Module, config) -> nn.ModuleList:
    """The shallowest ModuleList with one entry per decoder layer (LongCat's config counts its layers twice in
    num_hidden_layers, once per attention sublayer, and once in num_layers)."""
    counts = [v for name in LAYER_COUNT_NAMES if isinstance(v := getattr(config, name, None), int)]
    for _, module in sorted(model.named_modules(), key=lambda item: item[0].count(".")):
        if isinstance(module, nn.ModuleList) and len(module) in counts:
            return module
    raise ValueError(f"no list of {' or '.join(map(str, counts))} decoder layers in {type(model).__name__}")


def expected(config, model: nn.Module) -> list[LayerExpect]:
    """Per decoder layer, what the spec must say (`model` may live on the meta device)."""
    layers = decoder_layers(model, config)
    num_layers = len(layers)
    experts = config_value(config, EXPERT_NAMES)
    moe_declared = bool(experts and experts > 1) and getattr(config, "is_moe", True) is not False
    top_k = config_value(config, TOPK_NAMES)
    types = next((t for name in LAYER_TYPE_NAMES if isinstance(t := getattr(config, name, None), list)
                  and len(t) == num_layers), None)
    prefix = type(model).__name__.removesuffix("ForCausalLM")
    out = []
    for i, layer in enumerate(layers):
        mixer, why = mixer_class(layer, prefix)
        if mixer == "softmax" and types and any(w in str(types[i]) for w in SPARSE_TYPE_WORDS):
            # attention on keys an indexer picked, its own or an earlier layer's (HY-V4's shared indexers)
            mixer, why = "sparse", f"layer type {types[i]}"
        moe = moe_declared and holds_experts(layer, experts)
        window = stated_window(config, types[i]) if types else None
        out.append(LayerExpect(i, mixer, moe, experts if moe else None, top_k if moe else None, window, why))
    return out


def mixer_class(layer: nn.Module, prefix: str = "") -> tuple[str, str]:
    """The token mixer of a layer by its modules' class names (`prefix`, the family's own, stripped first): the
    outermost module whose name says a mixer, by the priority of MIXER_WORDS."""
    found = []
    for path, module in layer.named_modules():
        name = _own_name(type(module).__name__, prefix).lower()
        for priority, (kind, words) in enumerate(MIXER_WORDS):
            if path and any(w in name for w in words):
                found.append((path.count("."), priority, kind, module))
                break
    if not found:
        return "none", "no attention or mixer module"
    depth, priority, kind, module = min(found, key=lambda f: f[:2])
    cls = type(module).__name__
    if {p for d, p, _, _ in found if d == depth} >= {0, 1}:  # Zamba's hybrid layers: a shared attention block
        # and a Mamba block side by side (a short convolution beside attention is not a mixer of its own)
        return "either", f"{cls} beside an attention module: the spec, one mixer per layer, may name either"
    if kind == "linear":
        return "linear", cls
    if any("indexer" in type(m).__name__.lower() for m in module.modules()):
        return "sparse", f"{cls} holds an indexer"
    return "softmax", cls


def _own_name(name: str, prefix: str) -> str:
    """A class name without the family prefix it shares with the model's class (RecurrentGemmaRecurrentBlock ->
    RecurrentBlock, so the family's name is no evidence)."""
    common = 0
    while common < min(len(name), len(prefix)) and name[common] == prefix[common]:
        common += 1
    return name[common:]


def holds_experts(layer: nn.Module, experts: int) -> bool:
    """An E-way stack of expert weights: a parameter of E leading rows of matrices, E identical sub-modules, or an
    experts module (DBRX keeps its experts as (E x ffn, hidden) matrices, viewed per expert)."""
    for module in layer.modules():
        if isinstance(module, nn.ModuleList) and len(module) == experts and len(module) > 1:
            return True
        if type(module).__name__.endswith("Experts"):
            return True
    return any(p.dim() == 3 and p.shape[0] == experts for p in layer.parameters())


def stated_window(config, layer_type: str) -> int | None:
    for kind, names in WINDOW_NAMES.items():
        if kind in str(layer_type):
            return config_value(config, names)
    return None


def disagreements(spec, expect: list[LayerExpect]) -> list[str]:
    """Where the spec differs from the model's own structure, one line each."""
    if spec.num_layers != len(expect):
        return [f"spec has {spec.num_layers} layers, the model {len(expect)}"]
    out = []
    for layer, e in zip(spec.layers, expect):
        got = kind_class(layer.attention.kind)
        if got != e.mixer and not (e.mixer == "either" and got in ("linear", "softmax")):
            out.append(f"layer {e.index}: mixer {layer.attention.kind} ({got}), the model's is {e.mixer} ({e.why})")
        if (layer.mlp.kind == "moe") != e.moe:
            out.append(f"layer {e.index}: mlp {layer.mlp.kind}, the model's layer is {'MoE' if e.moe else 'not MoE'}")
        elif e.moe and layer.mlp.num_experts != e.num_experts:
            out.append(f"layer {e.index}: {layer.mlp.num_experts} experts, the config says {e.num_experts}")
        elif e.moe and e.top_k and layer.mlp.top_k != e.top_k:
            out.append(f"layer {e.index}: top-{layer.mlp.top_k}, the config says top-{e.top_k}")
        if e.window and layer.attention.window != e.window:
            out.append(f"layer {e.index}: window {layer.attention.window}, the config says {e.window}")
    return out
