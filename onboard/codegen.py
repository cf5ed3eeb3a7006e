"""Render the bundle's code and pages from the Jinja2 templates in templates/ (package onboard.templates).

Output depends only on the spec, the twin's module tree and the templates, so the same model and
options give byte-identical files.
"""

from __future__ import annotations

import copy
import inspect
import json
from dataclasses import asdict
from importlib import resources

import jinja2

from onboard.errors import one_line
from onboard.report import describe_mlp, describe_router, ranges
from onboard.spec import MLP, Layer, ModelSpec
from onboard.twin import Twin

# MLP fields that make two MoE layers need different construction code
_KIND_FIELDS = ("path", "activation", "gated", "expert_layout", "experts_path", "shared_path", "shared_gate_weight",
                "expert_weights", "expert_interleaved", "expert_transposed", "weight_on_input", "outputs",
                "top_k", "router", "post_norm", "output_bias", "zero_experts")


def environment() -> jinja2.Environment:
    loader = jinja2.FunctionLoader(lambda name: resources.files("onboard.templates").joinpath(name).read_text())
    env = jinja2.Environment(loader=loader, keep_trailing_newline=True, undefined=jinja2.StrictUndefined,
                             trim_blocks=False, lstrip_blocks=False)
    env.filters["tojson"] = lambda v: json.dumps(v)
    return env


def replaceable(mlp: MLP, refused: dict | None = None) -> str | None:
    """Why a matched MoE block cannot be swapped (None when it can). `refused` maps an MLP path to a reason
    found by an earlier verification (a hypothesis that did not hold)."""
    if refused and mlp.kind == "moe" and mlp.path in refused:
        return refused[mlp.path]
    if mlp.kind != "moe":
        return "not an MoE block"
    if mlp.router is None or mlp.router.score == "static" or (mlp.router.order == "static" and not mlp.router.table):
        return "experts chosen without a learned router, and no token-id table found to reproduce the choice"
    if mlp.router.score not in ("softmax", "sigmoid", "sqrtsoftplus"):
        return f"router score function {mlp.router.score!r} is not in the runtime yet"
    if mlp.router.order not in ("score_then_topk", "topk_then_score", "static"):
        return f"experts chosen by {mlp.router.order.replace('_', ' ')} (a sparse mixer): not in the runtime yet"
    if not mlp.router.direct:
        return "the router is more than one projection of the tokens (a small network): not in the runtime yet"
    if not mlp.path:
        return "the MoE block is the whole decoder layer; nothing to swap it into"
    if mlp.expert_layout == "fused" and not ({"gate_up", "down"} <= set(mlp.expert_weights)
                                             or {"gate", "up", "down"} <= set(mlp.expert_weights)):
        return "the expert weight stacks could not be told apart"
    return None


def experts_only(layer: Layer, twin: Twin, refused: dict | None = None) -> str | None:
    """Why the runtime cannot take over a block's experts alone, keeping the model's block and router
    (None when it can): a fused weight stack with known roles behind transformers' experts interface
    `experts(hidden_states, top_k_index, top_k_weights)`."""
    mlp = layer.mlp
    if mlp.kind != "moe" or mlp.expert_layout != "fused" or not mlp.experts_path:
        return "the experts are not one fused weight stack"
    if refused and mlp.experts_path in refused:
        return refused[mlp.experts_path]
    if not ({"gate_up", "down"} <= set(mlp.expert_weights) or {"gate", "up", "down"} <= set(mlp.expert_weights)):
        return "the expert weight stacks could not be told apart"
    try:
        module = _experts_module(twin, layer.twin_layer, mlp.experts_path)
    except AttributeError:
        return "the experts module is not in the tiny twin"
    required = [p for p in inspect.signature(module.forward).parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(required) != 3:
        return "the experts module is not called as experts(hidden_states, top_k_index, top_k_weights)"
    return None


def swap_target(layer: Layer, twin: Twin, refused: dict | None = None) -> tuple[str | None, str | None]:
    """What the adapter swaps in a layer's MLP: ("block", None), ("experts", why not the block) or
    (None, why nothing)."""
    why = replaceable(layer.mlp, refused)
    if why is None:
        return "block", None
    if layer.mlp.kind == "moe" and experts_only(layer, twin, refused) is None:
        return "experts", why
    return None, why


def swapped_path(layer: Layer, twin: Twin, refused: dict | None = None) -> str | None:
    """The module (path below the decoder layer) the adapter replaces in this layer's MLP, if any."""
    mode, _ = swap_target(layer, twin, refused)
    return {"block": layer.mlp.path, "experts": layer.mlp.experts_path}.get(mode)


def loss_target(spec: ModelSpec, twin: Twin, refused: dict | None = None) -> tuple[dict | None, str | None]:
    """How the adapter computes the training loss without full logits (None, and why, when it does not)."""
    if refused and "loss" in refused:
        return None, refused["loss"]
    head = spec.head or {}
    if head.get("loss") != "cross_entropy":
        return None, "no cross-entropy loss found after the LM head"
    path = head.get("path")
    try:
        module = twin.model.get_submodule(path) if path else None
    except AttributeError:
        module = None
    if module is None or getattr(module, "weight", None) is None or module.weight.dim() != 2:
        return None, "the LM head is not one linear projection"
    if "." not in twin.layers_path:
        return None, "the decoder layers sit on the model itself: no decoder module returns the last hidden state"
    softcap = head.get("logit_softcap")
    if softcap is True:
        return None, "the logits are soft-capped by a value the graph does not show"
    decoder = twin.layers_path.rpartition(".")[0]  # the module holding the layer stack returns the last hidden state
    return {"head": path, "softcap": softcap, "scale": head.get("logit_scale"), "decoder": decoder or None}, None


def attention_swap(layer: Layer, twin: Twin,
                   refused: dict | None = None) -> tuple[str | None, str | None, set[str]]:
    """How the adapter runs a layer's attention in the runtime: ("linear", None, cores) for a chunked sequence
    core (gated delta rule, Mamba2 SSD, Mamba1 selective scan, lightning attention, a short conv), cores being
    what the swap takes over (chunk_gated_delta, ssd_chunk_scan, selective_scan, causal_conv1d, lightning);
    ("sparse", None, set()) for DSA; or (None, why it stays HuggingFace code, set()). Decided by trying the
    runtime's swap on a copy of the twin's module, so a family whose functions only look right stays as it is."""
    from runtime.attention import swap_linear_core, swap_sparse_attention

    kind, path = layer.attention.kind, layer.attention.path
    if refused and f"attention:{path}" in refused:
        return None, refused[f"attention:{path}"], set()
    if kind.startswith(("linear:", "ssm:", "conv")):
        mode, swap = "linear", swap_linear_core
    elif kind == "sparse:dsa":
        mode, swap = "sparse", lambda m: swap_sparse_attention(m, paths=[""])
    else:
        return None, None, set()  # softmax-family attention: transformers' own sdpa / flash paths serve it
    configs = [(c, c._attn_implementation) for c in {id(c): c for c in _configs(twin.model)}.values()]
    try:
        module = twin.model.get_submodule(f"{twin.layers_path}.{layer.twin_layer}.{path}")
        copied = copy.deepcopy(module)
        result = swap(copied)
    except (AttributeError, ValueError) as exc:
        return None, one_line(exc), set()
    finally:  # the trial swap may have set the attention implementation of a config the twin shares
        for config, implementation in configs:
            if config._attn_implementation != implementation:
                config._attn_implementation = implementation
    if mode == "sparse":
        return (None, "; ".join(result.kept.values()), set()) if result.kept else (mode, None, set())
    return mode, None, set(result.values())  # {function name: core kind}, or {"forward": "lightning"}


def _configs(model):
    return [m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")]


def attention_kinds(spec: ModelSpec, twin: Twin, refused: dict | None = None) -> tuple[list[dict], dict[int, str]]:
    """Attention layers the adapter swaps, grouped by (mode, module path); and why other linear / sparse
    attention layers stay as they are."""
    groups: dict[tuple, list[int]] = {}
    cores: dict[tuple, set[str]] = {}
    kept: dict[int, str] = {}
    for layer in spec.layers:
        mode, why, layer_cores = attention_swap(layer, twin, refused)
        if mode:
            key = (mode, layer.attention.path, layer.attention.kind)
            groups.setdefault(key, []).append(layer.index)
            cores.setdefault(key, layer_cores)
        elif why:
            kept[layer.index] = f"{layer.attention.kind}: {why}"
    refused_sparse = [i for i, why in kept.items() if why.startswith("sparse:")]
    if refused_sparse:
        # the DSA layers share one attention implementation (their config's): all of them or none
        for (mode, _, kind), indices in list(groups.items()):
            if mode == "sparse":
                for i in indices:
                    kept[i] = (f"{kind}: it shares its attention implementation with layers "
                               f"{ranges(sorted(refused_sparse))}, which stay HuggingFace code")
        groups = {key: indices for key, indices in groups.items() if key[0] != "sparse"}
    kinds = [{"mode": mode, "path": path, "kind": kind, "indices": indices, "ranges": ranges(indices),
              "cores": cores[(mode, path, kind)]}
             for (mode, path, kind), indices in groups.items()]
    return kinds, kept


def _experts_module(twin: Twin, layer: int, path: str):
    return twin.model.get_submodule(f"{twin.layers_path}.{layer}.{path}")


def _activation_code(mlp: MLP, twin: Twin, layer: int) -> tuple[str, str | None]:
    """Code for the activation (the experts' own act_fn where they have one) and any custom gating."""
    from transformers.integrations.moe import _default_apply_gate

    module = _experts_module(twin, layer, mlp.experts_path)
    own = f"layer.get_submodule({json.dumps(mlp.experts_path)})"
    activation = f"{own}.act_fn" if callable(getattr(module, "act_fn", None)) else f"ACTIVATIONS[{json.dumps(mlp.activation)}]"
    gate = getattr(type(module), "_apply_gate", None)
    gate_fn = f"{own}._apply_gate" if gate is not None and gate is not _default_apply_gate else None
    if gate_fn and not callable(getattr(module, "act_fn", None)):
        activation = "None"  # the model's gating function applies its own activation
    return activation, gate_fn


def moe_kinds(spec: ModelSpec, twin: Twin, refused: dict | None = None) -> tuple[list[dict], dict[int, str]]:
    """Group MoE layers that need the same construction code; also say which MoE layers stay as they are.
    A kind's `mode` is "block" (the whole MoE block) or "experts" (the experts alone, the model routing)."""
    groups: dict[str, list[int]] = {}
    skipped: dict[int, str] = {}
    partial: dict[int, str] = {}  # layers whose experts alone are swapped: why not the whole block
    for layer in spec.layers:
        if layer.mlp.kind != "moe":
            continue
        mode, why = swap_target(layer, twin, refused)
        if mode is None:
            skipped[layer.index] = why
            continue
        if mode == "experts":
            partial[layer.index] = why
        key = json.dumps({"mode": mode, **{f: asdict(layer.mlp)[f] for f in _KIND_FIELDS}}, sort_keys=True)
        groups.setdefault(key, []).append(layer.index)
    kinds = []
    for indices in groups.values():
        layer = spec.layers[indices[0]]
        mlp, r = layer.mlp, layer.mlp.router
        activation, gate_fn = _activation_code(mlp, twin, layer.twin_layer)
        fields = r.config_fields

        def from_config(meaning, value):
            return f"config.{fields[meaning]}" if meaning in fields else repr(value)

        # the router as the block holds it (its outermost module below the block): what transformers observes
        below = (r.weight or "")[len(mlp.path) + 1:].split(".") if mlp.path else (r.weight or "").split(".")
        router_module = f"{mlp.path}.{below[0]}" if len(below) > 1 and not r.table else None
        mode = "experts" if indices[0] in partial else "block"
        kinds.append({
            "indices": indices, "ranges": ranges(indices), "mode": mode,
            "path": mlp.experts_path if mode == "experts" else mlp.path, "router_module": router_module,
            "why_not_block": partial.get(indices[0]),
            "summary": describe_mlp(mlp) + "; " + describe_router(mlp),
            "layout": mlp.expert_layout, "experts_path": mlp.experts_path, "weights": _Roles(mlp.expert_weights),
            "top_k": from_config("top_k", mlp.top_k), "n_group": from_config("n_group", r.n_group),
            "topk_group": from_config("topk_group", r.topk_group), "router": r,
            "activation": activation, "gate_fn": gate_fn, "gated": bool(mlp.gated),
            "transposed": mlp.expert_transposed, "interleaved": mlp.expert_interleaved,
            # shared experts outside the block (an MLP beside it in the layer) keep running where they are
            "shared": [p for p in (mlp.shared_path or "").split(",") if p and p.startswith(mlp.path + ".")],
            "shared_gate_weight": mlp.shared_gate_weight, "outputs": mlp.outputs,
            "weight_on_input": mlp.weight_on_input, "post_norm": mlp.post_norm, "output_bias": mlp.output_bias,
            "zero_experts": mlp.zero_experts,
        })
    return kinds, skipped


class _Roles(dict):
    """Expert weight roles; a missing role reads as None in templates."""

    def __getattr__(self, name):
        return self.get(name)


def render_adapter(spec: ModelSpec, twin: Twin, refused: dict | None = None) -> str:
    kinds, _ = moe_kinds(spec, twin, refused)
    loss, _ = loss_target(spec, twin, refused)
    stays = ["norms", "embeddings"]
    if any(layer.mlp.kind == "dense" for layer in spec.layers):
        stays.insert(1, "dense MLPs")
    if loss is None:
        stays.append("LM head and loss")
    attention, _ = attention_kinds(spec, twin, refused)
    if len(attention) < len({layer.attention.kind for layer in spec.layers}):
        stays.insert(0, "attention" if not attention else "the other attention layers")
    return environment().get_template("adapter.py.j2").render(
        spec=spec, kinds=kinds, stays=", ".join(stays), loss=loss, attention=attention,
        moe_layer_count=sum(len(k["indices"]) for k in kinds),
    )


def _pow2(n: int, low: int, high: int) -> int:
    p = low
    while p < n and p < high:
        p *= 2
    return p


def render_kernels(spec: ModelSpec, twin: Twin | None = None, refused: dict | None = None) -> dict[str, str]:
    """Kernel modules specialised for this model's shapes, for what the adapter runs in the runtime: the MoE
    kernels, and with the twin (which decides the attention and loss swaps) the gated delta rule, DSA sparse
    attention and cross-entropy rows. Empty when nothing the runtime runs has a kernel. Without the twin only
    whole MoE block swaps are considered (experts-only ones need its modules)."""
    kernels = {}
    if (moe := _moe_kernel(spec, twin, refused)) is not None:
        kernels["moe_triton.py"] = moe
    if twin is not None:
        kernels.update(_attention_kernels(spec, twin, refused))
        if loss_target(spec, twin, refused)[0] is not None:
            kernels["loss_triton.py"] = environment().get_template("kernels/loss_triton.py.j2").render(
                name=spec.name, vocab=spec.vocab_size, block=_pow2(spec.vocab_size, 64, 4096))
    return kernels


KERNEL_DTYPE = "bf16"  # what training runs in; the kernels compute in fp32 inside


def _moe_kernel(spec: ModelSpec, twin: Twin | None, refused: dict | None) -> str | None:
    def swapped(layer) -> bool:
        return (swap_target(layer, twin, refused)[0] if twin is not None else
                ("block" if replaceable(layer.mlp, refused) is None else None)) is not None

    moe = next((layer.mlp for layer in spec.layers if layer.mlp.kind == "moe" and swapped(layer)), None)
    if moe is None:
        return None
    return environment().get_template("kernels/moe_triton.py.j2").render(
        name=spec.name, hidden=spec.hidden_size, top_k=moe.top_k, ffn=moe.expert_ffn, dtype=KERNEL_DTYPE,
        block_cols=_pow2(spec.hidden_size, 16, 1024), bm=64, bn=64, bk=32,
    )


def _is_pow2(n: int | None) -> bool:
    return bool(n) and n >= 16 and n & (n - 1) == 0


def _attention_kernels(spec: ModelSpec, twin: Twin, refused: dict | None) -> dict[str, str]:
    """The scalar-decay kernel (Mamba2 SSD, lightning) and the gated delta rule kernel, each for the first swapped
    attention of its kind whose dims it can tile (one op each in the registry: a model mixing gate kinds keeps
    the others on the PyTorch path), and the DSA kernel."""
    out = {}
    groups, _ = attention_kinds(spec, twin, refused)
    by_index = {layer.index: layer for layer in spec.layers}
    for group in groups:
        attn = by_index[group["indices"][0]].attention
        head_k, head_v = attn.head_dim, attn.v_head_dim or attn.head_dim
        if group["mode"] == "linear" and group["cores"] & {"ssd_chunk_scan", "lightning"}:
            # Mamba2's SSD (keys are B: the state size) and lightning attention (keys are the head size)
            head_k = attn.state_size or attn.head_dim
            if "scalar_decay_triton.py" not in out and _is_pow2(head_k) and _is_pow2(attn.head_dim):
                out["scalar_decay_triton.py"] = environment().get_template("kernels/scalar_decay_triton.py.j2").render(
                    name=spec.name, head_k=head_k, head_v=attn.head_dim, chunk=64, block_k=min(head_k, 64),
                    block_v=min(attn.head_dim, 64), dtype=KERNEL_DTYPE)
        elif (group["mode"] == "linear" and attn.gate in ("scalar", "channel") and "gated_delta_triton.py" not in out
                and _is_pow2(head_k) and _is_pow2(head_v)):
            out["gated_delta_triton.py"] = environment().get_template("kernels/gated_delta_triton.py.j2").render(
                name=spec.name, gate="head" if attn.gate == "scalar" else "channel", head_k=head_k, head_v=head_v,
                chunk=64, block=16, block_k=min(head_k, 64), block_v=min(head_v, 64), dtype=KERNEL_DTYPE)
        elif group["mode"] == "sparse" and "sparse_attention_triton.py" not in out and attn.index_topk:
            out["sparse_attention_triton.py"] = environment().get_template(
                "kernels/sparse_attention_triton.py.j2").render(
                name=spec.name, qk_head_dim=attn.head_dim, v_head_dim=head_v, top_k=attn.index_topk,
                dtype=KERNEL_DTYPE)
    return out
