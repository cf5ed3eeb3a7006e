"""The adapt decision: for each part of a model the runtime could take over, which runtime piece takes it,
with which parameters, or why it stays HuggingFace code.

    decision = decide(spec, twin)          # the only place that looks at the twin's modules; trial swaps once
    decision.refuse("moe:mlp", why)        # verification rejected a reading: that part falls back
    decision.to_json() / Decision.from_json(text)   # saved in the bundle as decision.json

Rendering (adapter, kernels, REVIEW.md), verification, `onboard verify` and the review read this one object;
none of them looks at the model again to decide anything.

Targets name what a refusal covers, `part:path` with the path below a decoder layer:
- `moe:<block>`: the runtime's whole MoE block (`runtime.moe.MoEBlock`) for every layer with that block;
  the layers fall back to the experts alone where they can, else stay HuggingFace code;
- `experts:<experts>`: the experts alone (`runtime.moe.RoutedExperts`) behind the model's own router;
- `attention:<module>`: a linear-attention / state-space core or DSA sparse attention;
- `loss`: the training loss from the decoder's last hidden state (`runtime.loss`);
- `generated:<module>`: a module the onboarding agent replaced with code it wrote (`onboard.agent`).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from dataclasses import dataclass, field

from torch import nn

from onboard.errors import one_line
from onboard.inspect.spec import MLP, Layer, ModelSpec
from onboard.inspect.summary import describe_mlp, describe_router, ranges
from onboard.twin import Twin
from runtime.moe.router import ORDERS, SCORES
from runtime.swap import EXPERTS as EXPERTS_SWAP
from runtime.swap import GENERATED, LINEAR_CORE, LOSS, MOE_BLOCK, SPARSE_ATTENTION

SCHEMA_VERSION = 1

# what takes a part: the runtime piece, as the adapter and REVIEW.md name it
BLOCK, EXPERTS, LINEAR, SPARSE = "block", "experts", "linear", "sparse"


@dataclass
class Experts:
    """How the runtime builds its experts around the model's own weight stacks (paths below the layer)."""
    path: str
    layout: str  # "fused" (3-D stacks) | "modules" (one sub-MLP per expert)
    weights: dict[str, str]  # role (gate_up, gate, up, down, *_bias) -> tensor path
    activation: str  # code: the experts' own act_fn, an ACTIVATIONS entry, or None (gate_fn applies it)
    gate_fn: str | None  # code: the experts' own gating function, when it is not act(gate) * up
    gated: bool
    transposed: bool
    interleaved: bool
    # stacks stored flat, (E·rows, cols) (DBRX): role -> "out_in" | "in_out", and the router weight whose rows
    # count the experts (a flat stack does not say how many it holds)
    flat: dict[str, str] = dataclasses.field(default_factory=dict)
    count_from: str | None = None


@dataclass
class RouterReading:
    """How the runtime routes like the model; sizes that differ between model and twin are config reads."""
    weight: str | None
    module: str | None  # the router module below the block (what router-logit losses observe)
    bias: str | None  # selection-only expert bias
    linear_bias: str | None
    score: str
    order: str
    renormalize: bool
    renorm_p: float | None  # renormalised by the chosen weights' p-norm (None: by their sum)
    top_k: str  # code: a config field or a literal
    group_limited: bool
    n_group: str
    topk_group: str
    group_score_top: int | None
    scaling: float | None
    table: str | None  # static routing: expert ids by token id
    token_input: str | None


@dataclass
class MoEEntry:
    """MoE layers that need the same construction code."""
    layers: list[int]
    block: str  # the MoE block below the decoder layer
    num_experts: int
    summary: str
    why_not_block: str | None  # None: the runtime can take the block whole
    why_not_experts: str | None  # None: the runtime can take the experts alone, keeping the model's routing
    experts: Experts | None = None
    routing: RouterReading | None = None
    shared: list[str] = field(default_factory=list)  # shared experts inside the block
    shared_gate_weight: str | None = None
    outputs: int = 1
    weight_on_input: bool = False
    post_norm: str | None = None
    output_bias: str | None = None
    zero_experts: int = 0
    refused_block: str | None = None  # why verification rejected the whole-block reading
    refused_experts: str | None = None

    @property
    def takes(self) -> str | None:
        """BLOCK, EXPERTS or None (the block stays HuggingFace code)."""
        if self.why_not_block is None and self.refused_block is None:
            return BLOCK
        if self.why_not_experts is None and self.refused_experts is None:
            return EXPERTS
        return None

    @property
    def why(self) -> str | None:
        """Why the block is not taken whole (None when it is)."""
        return None if self.takes == BLOCK else self.refused_block or self.why_not_block

    @property
    def path(self) -> str | None:
        """The module the adapter replaces, below the decoder layer."""
        return {BLOCK: self.block, EXPERTS: self.experts and self.experts.path}.get(self.takes)

    @property
    def target(self) -> str:
        """What `Decision.refuse` names to drop what the runtime takes here (the block, else its experts)."""
        return f"experts:{self.experts.path}" if self.takes == EXPERTS else f"moe:{self.block}"

    @property
    def reused(self) -> list[str]:
        """Tensors and modules of the model the runtime piece holds in place."""
        routing = self.routing if self.takes == BLOCK else None
        names = [*(self.experts.weights.values() if self.experts else ()),
                 *((routing.weight, routing.bias, routing.linear_bias) if routing else ()),
                 *((self.output_bias, self.shared_gate_weight, *self.shared) if self.takes == BLOCK else ())]
        return sorted({n for n in names if n})


@dataclass
class AttentionEntry:
    """Attention layers of one kind at one path."""
    layers: list[int]
    path: str
    kind: str  # the spec's attention kind
    reading: str | None  # what the runtime can take (the trial swap's verdict): LINEAR, SPARSE, or None
    cores: list[str] = field(default_factory=list)  # runtime cores a linear swap runs
    why_not: str | None = None  # why the runtime cannot (None for softmax attention: nothing to take)
    refused: str | None = None  # why verification rejected the reading

    @property
    def takes(self) -> str | None:
        return self.reading if self.refused is None else None

    @property
    def why(self) -> str | None:
        """Why it stays HuggingFace code (None when the runtime takes it, and for softmax attention)."""
        return self.refused or self.why_not

    @property
    def target(self) -> str:
        return f"attention:{self.path}"


@dataclass
class LossEntry:
    reading: bool  # the loss can be computed from the decoder's last hidden state
    head: str | None = None
    decoder: str | None = None  # the module whose output is the last hidden state
    softcap: float | None = None
    scale: float | None = None
    why_not: str | None = None
    refused: str | None = None

    @property
    def takes(self) -> bool:
        return self.reading and self.refused is None

    @property
    def why(self) -> str | None:
        return self.refused or self.why_not

    @property
    def target(self) -> str:
        return "loss"


@dataclass
class GeneratedEntry:
    """A module no pattern matched, taken on by the onboarding agent (`onboard.agent`): replaced by the code it
    wrote and probed (the bundle's generated/<file>, class Replacement, at `path` below each of `layers`), or
    left as HuggingFace code with what was tried."""
    layers: list[int]
    path: str
    file: str  # below the bundle's generated/ ("" when no candidate passed)
    replaces: str  # the HuggingFace class it replaces
    policy: str  # what wrote it: "rules" or "llm"
    reading: str  # the policy's name for the reading that passed ("" when none did)
    hypothesis: str  # what the module computes, in words
    probe: dict = field(default_factory=dict)  # the passing probe's result against the live module
    rounds: list[dict] = field(default_factory=list)  # every round tried: reading, hypothesis, outcome
    refused: str | None = None  # why it stays HuggingFace code: no candidate passed, or verification refused it

    @property
    def takes(self) -> str | None:
        return GENERATED if self.refused is None else None

    @property
    def why(self) -> str | None:
        return self.refused

    @property
    def target(self) -> str:
        return f"generated:{self.path}"


@dataclass
class Taken:
    """What the runtime takes in one render-and-verify trial (`Decision.taken`): the entries the adapter is
    rendered from, and the swaps it must make, as the decoder layers each handle kind is made in (-1: one for
    the whole model, the loss)."""

    moe: list[MoEEntry]
    attention: list[AttentionEntry]
    loss: LossEntry
    generated: list[GeneratedEntry]
    swaps: dict[str, list[int]]


@dataclass
class Decision:
    moe: list[MoEEntry]
    attention: list[AttentionEntry]
    loss: LossEntry
    refused: dict[str, str] = field(default_factory=dict)  # target -> why verification rejected it
    generated: list[GeneratedEntry] = field(default_factory=list)  # the agent's replacements (onboard.agent)
    schema_version: int = SCHEMA_VERSION

    # -- refinement ---------------------------------------------------------------------------------
    def _entries(self, target: str) -> list:
        """The entries whose current swap `target` names."""
        part, _, path = target.partition(":")
        if part == "moe":
            return [e for e in self.moe if e.block == path and e.takes == BLOCK]
        if part == "experts":
            return [e for e in self.moe if e.takes == EXPERTS and e.experts.path == path]
        if part == "attention":
            return [e for e in self.attention if e.path == path and e.takes]
        if part == "generated":
            return [e for e in self.generated if e.path == path and e.takes]
        return [self.loss] if target == "loss" and self.loss.takes else []

    def refuse(self, target: str, why: str) -> None:
        """Verification rejected the reading behind `target`: that part falls back (see the module docstring)."""
        entries = self._entries(target)
        if not entries:
            raise ValueError(f"nothing in this decision is taken at {target!r}")
        for entry in entries:
            if target.startswith("moe:"):
                entry.refused_block = why
            elif target.startswith("experts:"):
                entry.refused_experts = why
            else:
                entry.refused = why
        self.refused[target] = why

    def admit(self, target: str) -> None:
        """Take back the refusal of `target` (to check whether it was needed)."""
        if self.refused.pop(target, None) is None:
            raise ValueError(f"{target!r} was not refused")
        part, _, path = target.partition(":")
        for entry in self.moe:
            if part == "moe" and entry.block == path:
                entry.refused_block = None
            if part == "experts" and entry.experts and entry.experts.path == path:
                entry.refused_experts = None
        for entry in [*self.attention, *self.generated]:
            if entry.target == target:
                entry.refused = None
        if target == "loss":
            self.loss.refused = None

    def suspects(self) -> list[str]:
        """What the runtime takes, in the order to give it back when a bundle fails verification: the agent's
        generated modules first (the least established code), then readings that only verification can
        confirm (extra routing slots as identity experts; the loss from the last hidden state), then whole MoE
        blocks (their experts alone may still verify), experts alone, attention."""
        zero = [e.target for e in self.moe if e.takes == BLOCK and e.zero_experts]
        blocks = [e.target for e in self.moe if e.takes == BLOCK and not e.zero_experts]
        experts = [e.target for e in self.moe if e.takes == EXPERTS]
        attention = [e.target for e in self.swapped_attention()]
        generated = [e.target for e in self.generated if e.takes]
        return list(dict.fromkeys([*generated, *zero, *(["loss"] if self.loss.takes else []), *blocks, *experts,
                                   *attention]))

    def reading(self, target: str) -> str:
        """What the runtime's reading behind `target` is, in words (for the reason a refusal records)."""
        entry = self._entries(target)[0]
        if target == "loss":
            return "computing the loss from the decoder's last hidden state through the LM head"
        if target.startswith("generated:"):
            return f"the agent's {entry.reading} replacement of {entry.replaces} at {entry.path}"
        if target.startswith("attention:"):
            what = ", ".join(entry.cores) if entry.cores else "indexer and sparse attention"
            return f"running the {entry.kind} attention at {entry.path} on the runtime's {what}"
        if target.startswith("experts:"):
            return f"running the experts at {entry.experts.path} in the runtime behind the model's own router"
        if entry.zero_experts:
            return (f"the router scores {entry.num_experts + entry.zero_experts} slots for {entry.num_experts} "
                    f"experts; taking the extra {entry.zero_experts} as identity (zero) experts")
        return f"taking the MoE block at {entry.block} whole ({entry.summary.split('; ', 1)[-1]})"

    # -- views --------------------------------------------------------------------------------------
    def swapped_moe(self) -> list[MoEEntry]:
        return [e for e in self.moe if e.takes]

    def kept_moe(self) -> dict[int, str]:
        """{layer: why its MoE block stays HuggingFace code}."""
        return {i: e.why for e in self.moe if not e.takes for i in e.layers}

    def swapped_attention(self) -> list[AttentionEntry]:
        return [e for e in self.attention if e.takes]

    def kept_attention(self) -> dict[int, str]:
        """{layer: why its linear / sparse attention stays HuggingFace code}."""
        return {i: f"{e.kind}: {e.why}" for e in self.attention if not e.takes and e.why for i in e.layers}

    def still_unmatched(self, spec: ModelSpec) -> list:
        """The spec's unmatched modules that no generated module of the agent replaced."""
        taken = [e.path for e in self.generated if e.takes]
        prefix = f"{spec.layers_path}."

        def replaced(path: str) -> bool:  # the module or one inside it (`conv` inside a generated `short_conv`)
            below = path[len(prefix):].partition(".")[2] if path.startswith(prefix) else ""
            return any(below == t or below.startswith(t + ".") for t in taken)

        return [u for u in spec.unmatched if not replaced(u.path)]

    def taken(self) -> Taken:
        """What the runtime takes as the decision stands now: what one adapter is rendered from and verified
        against."""
        swaps = {MOE_BLOCK: [], EXPERTS_SWAP: [], LINEAR_CORE: [], SPARSE_ATTENTION: [],
                 LOSS: [-1] if self.loss.takes else [], GENERATED: []}
        moe, attention = self.swapped_moe(), self.swapped_attention()
        generated = [e for e in self.generated if e.takes]
        for e in moe:
            swaps[MOE_BLOCK if e.takes == BLOCK else EXPERTS_SWAP] += e.layers
        for e in attention:
            swaps[LINEAR_CORE if e.takes == LINEAR else SPARSE_ATTENTION] += e.layers
        for e in generated:
            swaps[GENERATED] += e.layers
        return Taken(moe, attention, self.loss, generated, swaps)

    # -- JSON ---------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        # derived, written for readers of the file
        for raw, entry in zip([*data["moe"], *data["attention"], *data["generated"], data["loss"]],
                              [*self.moe, *self.attention, *self.generated, self.loss]):
            raw["takes"], raw["why"] = entry.takes, entry.why
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict) -> Decision:
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"decision schema version {data.get('schema_version')} is not {SCHEMA_VERSION}")
        def stored(raw: dict) -> dict:
            return {k: v for k, v in raw.items() if k not in ("takes", "why")}

        moe = []
        for raw in data["moe"]:
            raw = stored(raw)
            experts, routing = raw.pop("experts"), raw.pop("routing")
            moe.append(MoEEntry(**raw, experts=Experts(**experts) if experts else None,
                                routing=RouterReading(**routing) if routing else None))
        return cls(moe=moe, attention=[AttentionEntry(**stored(a)) for a in data["attention"]],
                   loss=LossEntry(**stored(data["loss"])), refused=dict(data.get("refused", {})),
                   generated=[GeneratedEntry(**stored(g)) for g in data.get("generated", [])],
                   schema_version=data["schema_version"])

    @classmethod
    def from_json(cls, text: str) -> Decision:
        return cls.from_dict(json.loads(text))


# ------------------------------------------------------------------------------------------------------
# deciding


def decide(spec: ModelSpec, twin: Twin) -> Decision:
    """What the adapter swaps, from the spec and (for what only the modules tell) the twin's modules."""
    return Decision(moe=_moe_entries(spec, twin), attention=_attention_entries(spec, twin),
                    loss=_loss_entry(spec, twin))


def why_not_block(mlp: MLP) -> str | None:
    """Why the runtime cannot take a matched MoE block whole (None when it can)."""
    if mlp.kind != "moe":
        return "not an MoE block"
    r = mlp.router
    if r is None or r.score == "static" or (r.order == "static" and not r.table):
        return "experts chosen without a learned router, and no token-id table found to reproduce the choice"
    if r.score not in SCORES:
        return f"router score function {r.score!r} is not in the runtime yet"
    if r.order not in ORDERS:
        return (f"experts chosen by {r.order.replace('_', ' ')} (a sparse mixer): the runtime's MoE block does not "
                f"route this way")
    if not r.direct:
        return ("the router is more than one projection of the tokens (a small network): the runtime's MoE block "
                "does not route this way")
    if not mlp.path:
        return "the MoE block is the whole decoder layer; nothing to swap it into"
    if mlp.expert_layout == "fused" and not _roles_known(mlp):
        return "the expert weight stacks could not be told apart"
    return _why_not_flat(mlp)


def _why_not_flat(mlp: MLP) -> str | None:
    """Flat (E·rows, cols) stacks are counted by the router's rows: not where zero experts widen it."""
    if mlp.expert_flat and (mlp.zero_experts or not mlp.router or not mlp.router.weight):
        return "the experts' matrices are flat, (experts x rows, cols), and the router's rows do not count them"
    return None


def _roles_known(mlp: MLP) -> bool:
    roles = set(mlp.expert_weights)
    return {"gate_up", "down"} <= roles or {"gate", "up", "down"} <= roles


def _twin_module(twin: Twin, path: str, layer: int | None = None) -> nn.Module | None:
    """The twin's module at `path` (below its decoder layer `layer`, the layer itself for path ""), or None."""
    if layer is not None:
        path = f"{twin.layers_path}.{layer}.{path}" if path else f"{twin.layers_path}.{layer}"
    try:
        return twin.model.get_submodule(path)
    except AttributeError:
        return None


def why_not_experts(layer: Layer, twin: Twin) -> str | None:
    """Why the runtime cannot take a block's experts alone behind the model's own router (None when it can):
    a fused weight stack with known roles behind transformers' experts interface
    `experts(hidden_states, top_k_index, top_k_weights)`."""
    mlp = layer.mlp
    if mlp.kind != "moe" or mlp.expert_layout != "fused" or not mlp.experts_path:
        return "the experts are not one fused weight stack"
    if not _roles_known(mlp):
        return "the expert weight stacks could not be told apart"
    if _twin_module(twin, mlp.experts_path, layer.twin_layer) is None:
        return "the experts module is not in the tiny twin"
    if _experts_module(mlp, twin, layer.twin_layer) is None:
        return "the experts module is not called as experts(hidden_states, top_k_index, top_k_weights)"
    return _why_not_flat(mlp)


def _experts_module(mlp: MLP, twin: Twin, twin_layer: int) -> str | None:
    """The module that runs the experts behind the router: the one holding the stacks, or the nearest one above it
    inside the block (DBRX's experts call a sub-module with each expert's matrices), called as
    experts(hidden_states, top_k_index, top_k_weights); None when there is none."""
    path = mlp.experts_path or ""
    while path and path != mlp.path:
        module = _twin_module(twin, path, twin_layer)
        if module is not None and len([p for p in inspect.signature(module.forward).parameters.values()
                                       if p.default is p.empty
                                       and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) == 3:
            return path
        path = path.rpartition(".")[0]
    return None


# MLP fields that make two MoE layers need different construction code
_BUILD_FIELDS = ("path", "activation", "gated", "expert_layout", "experts_path", "shared_path", "shared_gate_weight",
                 "expert_weights", "expert_interleaved", "expert_transposed", "expert_flat", "weight_on_input",
                 "outputs", "top_k", "router", "post_norm", "output_bias", "zero_experts")


def why_not_block_in_training(layer: Layer, twin: Twin) -> str | None:
    """Why the runtime's block cannot stand in for a block that draws random numbers in training (a router's
    input jitter: DBRX's moe_jitter_eps, Mixtral's router_jitter_noise), told by running the twin's block in
    training mode twice on the same tokens; verification runs in evaluation mode and would not see it. The
    model's own router keeps its jitter when the experts alone are swapped."""
    import torch

    module = _twin_module(twin, layer.mlp.path, layer.twin_layer)
    if module is None:
        return None
    tokens = torch.randn(2, 8, twin.hidden_size, generator=torch.Generator().manual_seed(0))
    outputs, was = [], module.training
    state = {k: v.clone() for k, v in module.state_dict().items()}  # a training forward may update buffers
    try:
        module.train()
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            for seed in (1, 2):
                torch.manual_seed(seed)
                out = module(tokens.clone())
                outputs.append(out[0] if isinstance(out, tuple) else out)
    except Exception:  # a block that needs more than its tokens (a token-id table): nothing to tell
        return None
    finally:
        module.train(was)
        module.load_state_dict(state)
    if torch.equal(outputs[0], outputs[1]):
        return None
    settings = [f"`{k}` = {v}" for k, v in sorted(_flat_settings(twin.config).items())
                if "jitter" in k.lower() and isinstance(v, int | float) and v]
    return ("the block draws random numbers in training" + (f" ({', '.join(settings)})" if settings else "")
            + ": the runtime's MoE block does not")


def _flat_settings(config) -> dict:
    """A config's plain values, nested configs (DBRX's ffn_config) as dotted names."""
    out = {}
    for key, value in config.to_dict().items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items() if not isinstance(v, dict)})
        else:
            out[key] = value
    return out


def _moe_entries(spec: ModelSpec, twin: Twin) -> list[MoEEntry]:
    groups: dict[str, list[Layer]] = {}
    reasons: dict[str, tuple] = {}
    in_training: dict[tuple[int, str], str | None] = {}  # the twin's block runs once per twin layer, not per layer
    for layer in spec.layers:
        if layer.mlp.kind != "moe":
            continue
        block_why = why_not_block(layer.mlp)
        if block_why is None:
            key = (layer.twin_layer, layer.mlp.path)
            if key not in in_training:
                in_training[key] = why_not_block_in_training(layer, twin)
            block_why = in_training[key]
        why = (block_why, why_not_experts(layer, twin))
        raw = dataclasses.asdict(layer.mlp)
        key = json.dumps({"why": why, **{f: raw[f] for f in _BUILD_FIELDS}}, sort_keys=True)
        groups.setdefault(key, []).append(layer)
        reasons[key] = why
    return [_moe_entry(layers, *reasons[key], twin) for key, layers in groups.items()]


def _moe_entry(layers: list[Layer], block_why: str | None, experts_why: str | None, twin: Twin) -> MoEEntry:
    first = layers[0]
    mlp = first.mlp
    entry = MoEEntry(layers=[layer.index for layer in layers], block=mlp.path, num_experts=mlp.num_experts or 0,
                     summary=describe_mlp(mlp) + "; " + describe_router(mlp),
                     why_not_block=block_why, why_not_experts=experts_why)
    if block_why is not None and experts_why is not None:
        return entry
    entry.experts = _experts(mlp, twin, first.twin_layer)
    if block_why is None:
        entry.routing = _routing(mlp)
        # shared experts outside the block (an MLP beside it in the layer) keep running where they are
        entry.shared = [p for p in (mlp.shared_path or "").split(",") if p and p.startswith(mlp.path + ".")]
        entry.shared_gate_weight, entry.outputs = mlp.shared_gate_weight, mlp.outputs
        entry.weight_on_input, entry.post_norm = mlp.weight_on_input, mlp.post_norm
        entry.output_bias, entry.zero_experts = mlp.output_bias, mlp.zero_experts
    return entry


def _experts(mlp: MLP, twin: Twin, twin_layer: int) -> Experts:
    """The experts' construction, with code for their activation (the experts' own act_fn where they have
    one) and for a gating function of their own (transformers' default one is plain act(gate) * up)."""
    module = _twin_module(twin, mlp.experts_path, twin_layer)
    own = f"layer.get_submodule({json.dumps(mlp.experts_path)})"
    has_act = callable(getattr(module, "act_fn", None))
    activation = f"{own}.act_fn" if has_act else f"ACTIVATIONS[{json.dumps(mlp.activation)}]"
    gate = getattr(type(module), "_apply_gate", None)
    gate_fn = f"{own}._apply_gate" if gate is not None and gate.__module__ != "transformers.integrations.moe" else None
    if gate_fn and not has_act:
        activation = "None"  # the model's gating function applies its own activation
    path = (_experts_module(mlp, twin, twin_layer) if mlp.expert_layout == "fused" else None) or mlp.experts_path
    return Experts(path=path, layout=mlp.expert_layout, weights=dict(mlp.expert_weights),
                   activation=activation, gate_fn=gate_fn, gated=bool(mlp.gated),
                   transposed=mlp.expert_transposed, interleaved=mlp.expert_interleaved,
                   flat=dict(mlp.expert_flat), count_from=mlp.router.weight if mlp.expert_flat and mlp.router else None)


def _routing(mlp: MLP) -> RouterReading:
    r = mlp.router
    fields = r.config_fields

    def from_config(meaning, value) -> str:
        return f"config.{fields[meaning]}" if meaning in fields else repr(value)

    # the router as the block holds it (its outermost module below the block): what transformers observes
    below = (r.weight or "")[len(mlp.path) + 1:].split(".")
    return RouterReading(weight=r.weight, module=f"{mlp.path}.{below[0]}" if len(below) > 1 and not r.table else None,
                   bias=r.bias, linear_bias=r.linear_bias, score=r.score, order=r.order, renormalize=r.renormalize,
                   renorm_p=r.renorm_p,
                   top_k=from_config("top_k", mlp.top_k), group_limited=r.group_limited,
                   n_group=from_config("n_group", r.n_group), topk_group=from_config("topk_group", r.topk_group),
                   group_score_top=r.group_score_top, scaling=r.scaling, table=r.table, token_input=r.token_input)


def _loss_entry(spec: ModelSpec, twin: Twin) -> LossEntry:
    """How the adapter computes the training loss without full logits (or why it does not)."""
    head = spec.head or {}
    if head.get("loss") != "cross_entropy":
        return LossEntry(False, why_not="no cross-entropy loss found after the LM head")
    path = head.get("path")
    module = _twin_module(twin, path) if path else None
    if module is None or getattr(module, "weight", None) is None or module.weight.dim() != 2:
        return LossEntry(False, why_not="the LM head is not one linear projection")
    if "." not in twin.layers_path:
        return LossEntry(False, why_not="the decoder layers sit on the model itself: no decoder module returns "
                                        "the last hidden state")
    softcap = head.get("logit_softcap")
    if softcap is True:
        return LossEntry(False, why_not="the logits are soft-capped by a value the graph does not show")
    decoder = twin.layers_path.rpartition(".")[0]  # the module holding the layer stack returns the last hidden state
    return LossEntry(True, head=path, decoder=decoder or None, softcap=softcap, scale=head.get("logit_scale"))


def _attention_entries(spec: ModelSpec, twin: Twin) -> list[AttentionEntry]:
    """Attention layers grouped by what the runtime does with them. Whether the runtime takes a linear or
    sparse attention module is decided by swapping it in the twin and undoing the swap: a family whose
    functions only look right stays as it is. Once per distinct twin layer."""
    trials: dict[tuple, tuple] = {}
    groups: dict[tuple, list[int]] = {}
    for layer in spec.layers:
        attn = layer.attention
        key = (layer.twin_layer, attn.path, attn.kind)
        if key not in trials:
            trials[key] = _trial_swap(twin, layer)
        takes, cores, why = trials[key]
        groups.setdefault((attn.path, attn.kind, takes, tuple(cores), why), []).append(layer.index)
    return [AttentionEntry(layers=indices, path=path, kind=kind, reading=takes, cores=list(cores), why_not=why)
            for (path, kind, takes, cores, why), indices in groups.items()]


def _trial_swap(twin: Twin, layer: Layer) -> tuple[str | None, list[str], str | None]:
    """(what takes the layer's attention, the cores it runs, why nothing does)."""
    from runtime.attention import swap_linear_core, swap_sparse_attention

    kind = layer.attention.kind
    if kind.startswith(("linear:", "ssm:", "conv")):
        takes, swap = LINEAR, swap_linear_core
    elif kind == "sparse:dsa":
        takes, swap = SPARSE, swap_sparse_attention
    else:
        return None, [], None  # softmax-family attention: transformers' own sdpa / flash paths serve it
    module = _twin_module(twin, layer.attention.path, layer.twin_layer)
    if module is None:
        return None, [], "the attention module is not in the tiny twin"
    try:
        handle = swap(module)
    except ValueError as exc:
        return None, [], one_line(exc)
    handle.undo()
    if takes == SPARSE:
        kept = handle.parts.get("indexer", "runtime")
        return (SPARSE, [], None) if kept == "runtime" else (None, [], kept)
    return LINEAR, sorted(set(handle.parts.values())), None


def by_reason(reasons: dict[int, str]) -> list[tuple[str, str]]:
    """{layer: why} as [(layer ranges, why)], one entry per distinct reason, in layer order."""
    grouped: dict[str, list[int]] = {}
    for index, why in sorted(reasons.items()):
        grouped.setdefault(why, []).append(index)
    return [(ranges(indices), why) for why, indices in grouped.items()]
