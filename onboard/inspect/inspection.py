"""`onboard inspect`: source -> twin -> capture -> patterns -> full-scale ModelSpec.

Patterns run on the twin's graphs and give structure plus twin-scale numbers. Full-scale numbers come
from two places that never allocate the model: parameter shapes of the full model built on the meta
device (at the same module paths the matchers found), and the twin's record of which config fields it
shrank, which maps a number seen in the twin graph (top-k 4, window 8) back to its full value.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from onboard.inspect.capture import Capture, Graph, capture
from onboard.inspect.graph import GraphView, op_name
from onboard.inspect.graph import parent as parent_path
from onboard.inspect.patterns.attention import AttentionMatch, match_attention
from onboard.inspect.patterns.dense import DenseMatch, match_dense_mlp, norm_kinds
from onboard.inspect.patterns.moe import MoEMatch, match_moe
from onboard.inspect.spec import MLP, Attention, Layer, ModelSpec, Unmatched
from onboard.source import ModelSource, resolve
from onboard.twin import TEST_SEQ_LEN, Twin


@dataclass
class LayerMatch:
    """What the matchers found in one captured twin layer (twin-scale numbers, module paths)."""

    attention: AttentionMatch | None
    moe: MoEMatch | None
    dense: DenseMatch | None
    norms: dict[str, str]
    unmatched: list[Unmatched] = field(default_factory=list)


def match_layer(graph: Graph, hidden: int) -> LayerMatch:
    if graph.gm is None:
        return LayerMatch(None, None, None, {}, [Unmatched(graph.module_path, f"capture failed: {graph.error}")])
    view = GraphView(graph)
    moes = match_moe(view)
    moe = moes[0] if moes else None
    exclude = [moe.path] if moe else []
    attention = match_attention(view, graph.inputs, TEST_SEQ_LEN, exclude)
    if attention is not None:
        exclude.append(attention.path)
    dense = match_dense_mlp(view, exclude, hidden)
    if dense is not None:
        exclude.append(dense.path)
        if moe is not None:
            if _same_input(view, dense.path, moe.router.path):
                # an always-on MLP reading what the router reads, beside the routed experts: a shared expert
                moe.shared_paths = sorted({*moe.shared_paths, dense.path})
            dense = None
    norms = norm_kinds(view, exclude)
    covered = exclude + list(norms)
    unmatched = []
    for path in sorted({p.rsplit(".", 1)[0] for p in view.param_shapes if "." in p}):
        if not any(path == c or path.startswith(c + ".") for c in covered if c):
            unmatched.append(Unmatched(f"{graph.module_path}.{path}", "no pattern recognises this module"))
    # a layer that is only a token mixer (Mamba-only layers) or only a channel mixer (Nemotron-H's MoE
    # layers) is fine when every module is accounted for; say so only when something else is left over
    if unmatched and attention is None:
        unmatched.append(Unmatched(graph.module_path, "no token mixer (attention, linear attention, SSM) recognised"))
    if unmatched and moe is None and dense is None:
        unmatched.append(Unmatched(graph.module_path, "no channel mixer (MoE or dense MLP) recognised"))
    return LayerMatch(attention, moe, dense, norms, unmatched)


def _module_input(view: GraphView, path: str):
    first = min((n for n in view.under(path) if view.linear_weight(n)), key=lambda n: view.index[n], default=None)
    if first is None:
        return None
    data = [a for a in view.inputs(first) if view.param(a) is None]
    return view.source(data[0]) if data else None


def _same_input(view: GraphView, a: str, b: str) -> bool:
    """Do the modules at paths a and b read the same tensor (e.g. the post-attention norm's output)?"""
    x, y = _module_input(view, a), _module_input(view, b)
    return x is not None and x is y


# ----------------------------------------------------------------------------------------------------
# Full scale


class FullScale:
    """Full-size parameter shapes and config values by meaning, read from the twin's record of the full model
    (`Twin.full_model` on the meta device, `Twin.full_sizes`) and of the fields it shrank."""

    def __init__(self, twin: Twin):
        if twin.full_model is None:
            raise ValueError("a twin scaled for training has no full-size record; inspect the twin itself")
        self.twin = twin
        self.model = twin.full_model
        self.stack = self.model.get_submodule(twin.layers_path)  # the full model has the twin's module tree
        self.config_values = {meaning: [v for _, v in found] for meaning, found in twin.full_sizes.items()}
        self.config_keys = {meaning: keys for meaning, found in twin.full_sizes.items()
                            if (keys := [(p, v) for p, v in found if "." not in p])}

    def config(self, meaning: str):
        values = self.config_values.get(meaning)
        return values[0] if values else None

    def value(self, meanings, observed):
        """Map a twin observation to full scale through the first meaning whose field the twin changed."""
        if observed is None:
            return None
        for meaning in (meanings if isinstance(meanings, (list, tuple)) else [meanings]):
            # several fields may share a twin value (a multimodal config's vision tower): prefer the
            # language model's own fields, the least nested first; a per-layer list (Laguna's heads per layer)
            # before all, as it overrides the field it is named after
            candidates = sorted((s for s in self.twin.shrinks if s.meaning == meaning),
                                key=lambda s: (not isinstance(s.twin, list), _foreign(s.path), s.path.count(".")))
            for s in candidates:
                if isinstance(s.twin, list):  # the twin keeps distinct counts distinct: one full count each
                    if observed in s.twin:
                        return s.full[s.twin.index(observed)]
                elif s.twin == observed:
                    return s.full
        # a field behaviour found sizing the model, of no known meaning, has a twin value of its own
        return next((s.full for s in self.twin.shrinks if s.meaning == "width" and s.twin == observed), observed)

    def config_field(self, meaning: str, value, observed) -> str | None:
        """The top-level config attribute that holds `value` with this meaning, read again at adapt time: only
        one that holds `observed` in the twin (unless None), the number the twin was seen to use (a name is a
        hint)."""
        return next((k for k, v in self.config_keys.get(meaning, [])
                     if v == value and observed in (None, getattr(self.twin.config, k, None))), None)

    def layer_params(self, i: int) -> dict[str, tuple]:
        return {n: tuple(p.shape) for n, p in self.stack[i].named_parameters()}


def _foreign(path: str) -> bool:
    """Fields of a non-language tower in a multimodal config."""
    return any(part in path for part in ("vision", "audio", "image", "visual", "speech"))


def _inner_width(shapes, hidden: int) -> int | None:
    """The narrowest non-hidden dimension among projection weights (the FFN width)."""
    dims = []
    for s in shapes:
        rest = list(s[1:] if len(s) == 3 else s)
        if hidden in rest:
            rest.remove(hidden)
        dims.extend(rest)
    return min(dims) if dims else None


def _scale_moe(m: MoEMatch, params: dict[str, tuple], full: FullScale, hidden: int, outputs: int = 1) -> MLP:
    expert_shapes = [s for p, s in params.items() if p.startswith(m.experts.path + ".")]
    if m.flat:  # flat (E·rows, cols) stacks: the expert count is the config's, each expert's rows its share
        E = full.value("experts", m.experts.num_experts)
        flat = [params[p] for p in m.expert_weights.values() if p in m.experts.flat and p in params]
        expert_shapes = [(E, s[0] // E, s[1]) for s in flat if s[0] % E == 0]
    if m.experts.layout == "fused":
        expert_shapes = [s for s in expert_shapes if len(s) == 3]  # weights, not per-expert biases
        E = min(s[0] for s in expert_shapes) if expert_shapes else None
        ffn = _inner_width(expert_shapes, hidden)
    else:
        ids = {p[len(m.experts.path) + 1:].split(".")[0] for p in params if p.startswith(m.experts.path + ".")}
        E = len(ids)
        ffn = _inner_width([s for p, s in params.items() if p.startswith(f"{m.experts.path}.0.") and len(s) == 2],
                           hidden)
    # shared width: the inner width of every projection back to hidden (a stack of n counts n times)
    shared_ffn = 0
    for p, s in params.items():
        if not any(p.startswith(x + ".") or p == x or parent_path(p) == x for x in m.shared_paths):
            continue
        if len(s) == 2 and s[0] == hidden and s[1] != hidden:
            shared_ffn += s[1]
        elif len(s) == 3 and s[1] == hidden and s[2] != hidden:
            shared_ffn += s[0] * s[2]
    shared_ffn = shared_ffn or None
    n_shared = 0
    if m.shared_paths:
        declared = full.config("n_shared")
        if declared:
            n_shared = declared
        elif shared_ffn and ffn and shared_ffn % ffn == 0:
            n_shared = shared_ffn // ffn
        else:
            n_shared = len(m.shared_paths)
    router = dataclasses.replace(m.router)  # m holds the twin's numbers; every layer scales its own copy
    if router.logit_width is not None and router.weight in params:
        router.logit_width = params[router.weight][0]
    # what the twin was seen to use (no top-k for routing by a token-id table: its k is the table's)
    seen = {"top_k": m.top_k or None, "n_group": router.n_group, "topk_group": router.topk_group}
    router.n_group = full.value("n_group", router.n_group)
    router.topk_group = full.value("topk_group", router.topk_group)
    if router.group_limited and (router.n_group or 1) <= 1:
        router.group_limited, router.n_group, router.topk_group = False, None, None  # one group selects nothing
    top_k = full.value("top_k", m.top_k) if m.top_k else full.config("top_k")
    router.config_fields = {meaning: key for meaning, value in
                            (("top_k", top_k), ("n_group", router.n_group), ("topk_group", router.topk_group))
                            if value and (key := full.config_field(meaning, value, seen[meaning]))}
    gate_up = params.get(m.expert_weights.get("gate_up") or m.expert_weights.get("gate") or "", ())
    transposed = len(gate_up) == 3 and gate_up[1] == hidden and gate_up[2] != hidden
    if m.flat:  # read from how the forward multiplies each stack, not from its shape
        transposed = m.flat.get("gate_up", m.flat.get("gate")) == "in_out"
    return MLP(
        kind="moe", path=m.path, activation=m.activation, gated=m.gated, num_experts=E,
        top_k=top_k, expert_ffn=ffn, expert_layout=m.experts.layout,
        experts_path=m.experts.path, num_shared_experts=n_shared, shared_expert_ffn=shared_ffn,
        shared_expert_gated=m.shared_gate, shared_path=",".join(m.shared_paths) or None, router=router,
        shared_gate_weight=m.shared_gate_weight, expert_weights=dict(m.expert_weights),
        expert_interleaved=m.interleaved, expert_transposed=transposed, expert_flat=dict(m.flat),
        weight_on_input=m.weight_on_input,
        outputs=outputs, post_norm=m.post_norm, output_bias=m.output_bias,
        zero_experts=max(0, (router.logit_width or E or 0) - (E or 0)),
    )


def _scale_attention(a: AttentionMatch | None, full: FullScale, twin_hidden: int, hidden: int) -> Attention:
    """The matched attention at full scale; `twin_hidden` and `hidden` are the twin's and the model's widths."""
    if a is None:
        return Attention(kind="none")
    f = a.facts
    if a.kind.startswith(("linear", "ssm", "conv")):
        heads = full.value(["linear_v_heads", "linear_heads", "ssm_heads", "heads"], f.get("num_heads"))
        head_dim = full.config("linear_head_dim") or full.config("ssm_head_dim")
        if a.kind.startswith("ssm"):
            heads = heads or full.config("ssm_heads")
        elif a.kind == "linear:lightning":  # the model's own attention heads and head size
            heads = heads or full.config("heads")
            head_dim = head_dim or full.config("head_dim") or (hidden // heads if heads else None)
        elif a.kind.startswith("linear:") and head_dim is None and f.get("head_dim"):
            head_dim = full.value(["linear_head_dim", "head_dim"], f["head_dim"])  # no field named for it
        return Attention(kind=a.kind, path=a.path, num_heads=heads, conv_kernel=f.get("conv_kernel"),
                         gate=f.get("gate"), head_dim=head_dim,
                         state_size=full.config("ssm_state") if a.kind.startswith("ssm") else None)
    attn = Attention(
        kind=a.kind, path=a.path, num_heads=full.value("heads", f.get("num_heads")),
        num_kv_heads=full.value(["kv_heads", "heads"], f.get("num_kv_heads")),
        head_dim=full.value("head_dim", f.get("head_dim")),
        v_head_dim=full.value(["v_head_dim", "head_dim"], f.get("v_head_dim")),
        window=full.value("window", f.get("window")), sinks=bool(f.get("sinks")),
        output_gate=bool(f.get("output_gate")), qk_norm=bool(f.get("qk_norm")),
    )
    twin_heads = f.get("num_heads")
    if (full.config("head_dim") is None and twin_heads and attn.num_heads
            and f.get("head_dim") == twin_hidden // twin_heads):
        # head size derived as hidden / heads by the model: derive it the same way at full scale
        attn.head_dim = hidden // attn.num_heads
        if f.get("v_head_dim") == f.get("head_dim"):
            attn.v_head_dim = attn.head_dim
    if f.get("kv_lora_rank"):
        attn.kv_lora_rank = full.value("kv_lora_rank", f["kv_lora_rank"])
        attn.q_lora_rank = full.value("q_lora_rank", f.get("q_lora_rank"))
        attn.rope_head_dim = full.config("rope_head_dim")
        nope = full.config("nope_head_dim")
        if nope and attn.rope_head_dim:
            attn.head_dim = nope + attn.rope_head_dim
        attn.v_head_dim = full.config("v_head_dim") or attn.v_head_dim
        attn.num_kv_heads = attn.num_heads  # keys/values are decompressed per head; only the rope key is shared
    if a.kind == "sparse:dsa":
        attn.index_topk = full.value("index_topk", f.get("index_topk"))
        attn.index_heads = full.config("index_heads")
        attn.index_head_dim = full.config("index_head_dim")
    return attn


def _count_outputs(twin: Twin, blocks: set[tuple[int, str]]) -> dict[tuple[int, str], int]:
    """How many values each matched block returns (a replacement must return the same)."""
    modules = dict(twin.model.named_modules())
    seen: dict[tuple[int, str], int] = {}
    handles = []
    for j, path in blocks:
        module = modules[f"{twin.layers_path}.{j}" + (f".{path}" if path else "")]

        def hook(mod, args, output, key=(j, path)):
            seen[key] = len(output) if isinstance(output, tuple) else 1
        handles.append(module.register_forward_hook(hook))
    twin.forward_once(handles)
    return seen


def _constant_factor(node) -> float | None:
    """The factor a mul / div node applies when one operand is a Python number."""
    value = next((a for a in node.args if isinstance(a, (int, float)) and not isinstance(a, bool)), None)
    if op_name(node) in ("mul", "div") and value:
        return float(value) if op_name(node) == "mul" else 1.0 / float(value)
    return None


def _head_facts(graph: Graph) -> dict:
    if graph.gm is None:
        return {"captured": False, "error": graph.error}
    view = GraphView(graph)
    nodes = view.under("")
    facts: dict = {"captured": True}
    losses = [n for n in nodes if op_name(n) in ("cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss2d")]
    facts["loss"] = "cross_entropy" if losses else None
    logits = [n for n in nodes if view.linear_weight(n) and (view.shape(n) or (0,))[-1] >= 64]
    if logits:
        head = max(logits, key=lambda n: view.index[n])
        facts["path"] = view.path(head)
        tanh = [n for n in view.descendants(head) if op_name(n) == "tanh"]
        capping = set().union(*(view.ancestors(t) | view.descendants(t) for t in tanh)) if tanh else set()
        for n in sorted(view.descendants(head) - capping, key=lambda n: view.index[n]):
            # a constant factor on the logits outside any soft cap (Cohere's logit_scale, Granite's 1/scaling)
            if (factor := _constant_factor(n)) is not None:
                facts["logit_scale"] = factor
                break
        bias = op_name(head) == "addmm" or (op_name(head) == "linear" and len(head.args) > 2 and head.args[2] is not None)
        if not bias:
            # a constant factor on the head's input in the causal-LM forward itself, after the decoder's last norm
            # (Inkling's 1 / logits_mup_width_multiplier): with no bias it scales the logits alike
            before = [f for n in view.ancestors(head) if view.path(n) == "" and (f := _constant_factor(n)) is not None]
            for factor in before:
                facts["logit_scale"] = facts.get("logit_scale", 1.0) * factor
        if tanh:
            divs = [a for n in view.ancestors(tanh[0]) & view.descendants(head) for a in n.args
                    if op_name(n) == "div" and isinstance(a, (int, float))]
            facts["logit_softcap"] = float(divs[0]) if divs else True
    return facts


# ----------------------------------------------------------------------------------------------------


def inspect_source(source: ModelSource) -> tuple[ModelSpec, dict]:
    timings = {}
    t0 = time.perf_counter()
    twin = Twin.build(source)
    timings["twin_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    cap = capture(twin)
    timings["capture_s"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    spec = build_spec(twin, cap)
    timings["match_s"] = time.perf_counter() - t2
    timings["total_s"] = time.perf_counter() - t0
    return spec, timings


def inspect_model(ref: str, *, trust_remote_code: bool = False, online: bool = False) -> tuple[ModelSpec, dict]:
    return inspect_source(resolve(ref, trust_remote_code=trust_remote_code, online=online))


def build_spec(twin: Twin, cap: Capture) -> ModelSpec:
    """The full-scale spec: the matchers' findings in the twin's captured layers, scaled by the twin's record of
    the full model."""
    source = twin.source
    twin_hidden = twin.hidden_size
    matches = {i: match_layer(g, twin_hidden) for i, g in cap.layers.items()}
    full = FullScale(twin)
    block_outputs = _count_outputs(twin, {(j, m.moe.path) for j, m in matches.items() if m.moe is not None})
    cfg = source.config
    # the vocabulary and the width are what the input embedding table holds, whatever the config calls them
    vocab, hidden = full.model.get_input_embeddings().weight.shape
    layers = []
    unmatched: list[Unmatched] = []
    for i, sig in enumerate(twin.full_layer_signatures):
        j = cap.layer_of_signature[sig]
        m = matches[j]
        params = full.layer_params(i)
        if m.moe is not None:
            mlp = _scale_moe(m.moe, params, full, hidden, block_outputs.get((j, m.moe.path), 1))
        elif m.dense is not None:
            mlp = MLP(kind="dense", path=m.dense.path, activation=m.dense.activation, gated=m.dense.gated,
                      ffn=_inner_width([s for p, s in params.items() if p.startswith(m.dense.path + ".")
                                        and len(s) == 2], hidden))
        else:
            mlp = MLP(kind="none")
        total = sum(_numel(s) for s in params.values())
        active = total
        if mlp.kind == "moe" and mlp.num_experts and mlp.top_k:
            routed = sum(_numel(s) for p, s in params.items() if p.startswith(mlp.experts_path + "."))
            active = total - routed + routed * min(mlp.top_k, mlp.num_experts) // mlp.num_experts
        layers.append(Layer(index=i, attention=_scale_attention(m.attention, full, twin_hidden, hidden), mlp=mlp,
                            norms=sorted(set(m.norms.values())), params=total, params_active=active,
                            twin_layer=j))
    for _, m in sorted(matches.items()):
        unmatched.extend(m.unmatched)

    model = full.model
    unique = {id(p): p for p in model.parameters()}
    params_total = sum(p.numel() for p in unique.values())
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = bool(twin.model.get_output_embeddings() is not None and
                twin.model.get_output_embeddings().weight is twin.model.get_input_embeddings().weight)
    emb_params = sum(p.numel() for p in emb.parameters()) if emb is not None else 0
    head_params = 0 if tied or head is None else sum(p.numel() for p in head.parameters())
    routed_inactive = sum(layer.params - layer.params_active for layer in layers)
    head_facts = _head_facts(cap.head)
    head_facts["tied"] = tied
    return ModelSpec(
        name=source.name, model_type=cfg.model_type, vocab_size=int(vocab),
        hidden_size=int(hidden), num_layers=len(layers), tie_embeddings=tied, layers=layers,
        # the input embedding is a lookup, not arithmetic; a tied table still works as the LM head
        layers_path=twin.layers_path,
        params_total=params_total,
        params_active=params_total - routed_inactive - (0 if tied else emb_params),
        params_active_with_embedding=params_total - routed_inactive,
        params_embedding=emb_params,
        params_head=head_params, max_position_embeddings=getattr(cfg, "max_position_embeddings", None),
        head=head_facts,
        capture={g.name: g.method for g in [*cap.layers.values(), cap.head]},
        unmatched=unmatched,
    )


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
