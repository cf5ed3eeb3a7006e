"""Tiny twin: the same architecture as a full-size config, with small dimensions and random fp32 weights.

The twin is driven by what config fields *mean* (a table of field names by meaning, matched at any depth of
nested dicts such as ``linear_attn_config`` or ``rope_parameters``), not by ``model_type``. It keeps every
distinctive feature: each layer kind and its interleaving, shared experts, dense-first layers, grouped
routing, low ranks, and windows / index top-k smaller than the test sequence so sparsity is exercised.

Layers are not guessed from field names either: the model is built on the meta device at twin width with
its full depth, each decoder layer gets a structural signature, and the twin keeps the shortest prefix of
layers that holds every distinct signature. Then it is built for real and run forward and backward.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from onboard.config_dict import get, is_size, layers_key, per_layer_lists, put, truncate_layers, walk
from onboard.errors import OnboardError, one_line
from onboard.source import ModelSource
from runtime import model_tree

TEST_SEQ_LEN = 32
TEST_BATCH = 2
MAX_TWIN_LAYERS = 48

# Field-name patterns by meaning. Order matters: the first pattern that matches a key decides.
# Each entry: (meaning, regex on the key).
MEANINGS: list[tuple[str, str]] = [
    ("shared_ffn", r"(moe_)?shared_expert_intermediate_size|shared_expert_ffn.*|moe_shared_expert_intermediate_size"),
    ("expert_ffn", r"moe_intermediate_size|expert_intermediate_size|moe_ffn_hidden_size|expert_ffn_size|moe_dim|moe_hidden_size|expert_ffn_hidden_size"),
    ("zero_experts", r"zero_expert_num|num_zero_experts|n_null_experts"),
    ("ffn", r"intermediate_size|ffn_hidden_size|ffn_dim|n_inner|dense_intermediate_size"),
    ("n_shared", r"n_shared_experts|num_shared_experts|moe_num_shared_experts|shared_expert_count"),
    ("experts", r"num_experts|num_local_experts|n_routed_experts|moe_num_experts|num_routed_experts|n_experts"),
    ("top_k", r"num_experts_per_tok|num_experts_per_token|moe_topk|moe_k|top_k|moe_top_k|num_selected_experts"),
    ("n_group", r"n_group|num_expert_group|moe_n_group|n_expert_groups"),
    ("topk_group", r"topk_group|moe_topk_group|topk_groups"),
    ("index_topk", r"index_topk"),
    ("index_heads", r"index_n_heads|index_num_heads"),
    ("index_head_dim", r"index_head_dim"),
    ("window", r"sliding_window|attention_window|sliding_window_size|window_size|attention_chunk_size|local_window"),
    ("q_lora_rank", r"q_lora_rank"),
    ("kv_lora_rank", r"kv_lora_rank"),
    ("rope_head_dim", r"qk_rope_head_dim"),
    ("nope_head_dim", r"qk_nope_head_dim"),
    ("v_head_dim", r"v_head_dim"),
    ("linear_k_heads", r"linear_num_key_heads"),
    ("linear_v_heads", r"linear_num_value_heads"),
    ("linear_heads", r"linear_num_heads|linear_attn_num_heads"),
    ("linear_head_dim", r"linear_key_head_dim|linear_value_head_dim|linear_head_dim|linear_attn_head_dim"),
    ("ssm_state", r"mamba_d_state|state_size|ssm_state_size|d_state"),
    ("ssm_heads", r"mamba_n_heads|mamba_num_heads|n_mamba_heads"),
    ("ssm_head_dim", r"mamba_head_dim|mamba_d_head|mamba_headdim"),
    ("ssm_groups", r"mamba_n_groups|n_groups|mamba_ngroups"),
    ("ssm_inner", r"mamba_d_ssm|mamba_d_inner|d_inner|ssm_intermediate_size"),
    ("dt_rank", r"time_step_rank|mamba_dt_rank|dt_rank"),
    ("kv_heads", r"num_key_value_heads|num_kv_heads|n_kv_heads|multi_query_group_num|num_global_key_value_heads"),
    ("heads", r"num_attention_heads|n_head|num_heads|n_heads"),
    ("head_dim", r"head_dim|attention_head_dim|kv_channels|global_head_dim"),
    ("hidden", r"hidden_size|d_model|n_embd|dim|model_dim"),
    ("vocab", r"vocab_size"),
]
_COMPILED = [(meaning, re.compile(rf"(?:{pattern})$")) for meaning, pattern in MEANINGS]

# Target values at twin scale for plain size fields.
SIZES = {
    "hidden": 64, "heads": 4, "head_dim": 16, "ffn": 128, "expert_ffn": 32, "shared_ffn": 48,
    "vocab": 512, "q_lora_rank": 24, "kv_lora_rank": 16, "rope_head_dim": 8, "nope_head_dim": 16,
    "v_head_dim": 16, "index_heads": 2, "index_head_dim": 16, "index_topk": 8, "window": 8,
    "linear_head_dim": 16, "linear_heads": 4, "ssm_state": 8, "ssm_heads": 4, "ssm_head_dim": 16,
    "ssm_groups": 1, "dt_rank": 8,
}


def meaning_of(key: str) -> str | None:
    for meaning, regex in _COMPILED:
        if regex.fullmatch(key):
            return meaning
    return None


@dataclass
class Shrink:
    """One field the twin changed: where it lives, what it means, and both values."""

    path: str
    meaning: str
    full: object
    twin: object


@dataclass
class Twin:
    source: ModelSource
    config: object
    model: nn.Module
    shrinks: list[Shrink] = field(default_factory=list)
    layer_signatures: list[str] = field(default_factory=list)  # the twin's own layers
    full_layer_signatures: list[str] = field(default_factory=list)  # every layer of the full model
    layers_path: str = ""

    def full_value(self, meaning: str, twin_value):
        """Map a number observed in the twin back to full scale, through the fields the twin shrank."""
        for s in self.shrinks:
            if s.meaning == meaning and s.twin == twin_value:
                return s.full
        return twin_value

    def shrunk(self, meaning: str) -> list[Shrink]:
        return [s for s in self.shrinks if s.meaning == meaning]

    def module(self, path: str) -> nn.Module | None:
        """The twin's module at a dotted path, or None when the twin has none there."""
        try:
            return self.model.get_submodule(path)
        except AttributeError:
            return None

    def layer_module(self, layer: int, path: str) -> nn.Module | None:
        """The module at `path` below the twin's decoder layer `layer` (the layer itself for ""), or None."""
        return self.module(f"{self.layers_path}.{layer}.{path}" if path else f"{self.layers_path}.{layer}")

    def forward_once(self, handles: list) -> None:
        """Run the example batch through the twin once (no grad), then remove the given hook handles."""
        try:
            with torch.no_grad():
                self.model(**self.example_batch(), use_cache=False)
        finally:
            for h in handles:
                h.remove()

    def example_batch(self, seed: int = 0, seq_len: int = TEST_SEQ_LEN) -> dict:
        gen = torch.Generator().manual_seed(seed)
        vocab = self.config.vocab_size
        ids = torch.randint(3, vocab, (TEST_BATCH, seq_len), generator=gen)
        return {"input_ids": ids, "labels": ids.clone()}


# ----------------------------------------------------------------------------------------------------
# Shrinking the config


class _ConfigEdit:
    """The twin's values, decided field by field; records every change."""

    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.shrinks: list[Shrink] = []

    def fields(self, meaning: str):
        return [(p, v) for p, k, v in walk(self.cfg) if meaning_of(k) == meaning and is_size(v)]

    def first(self, meaning: str):
        found = self.fields(meaning)
        return found[0][1] if found else None

    def put(self, path: str, meaning: str, value) -> None:
        old = get(self.cfg, path)
        if old != value:
            put(self.cfg, path, value)
            earlier = next((s for s in self.shrinks if s.path == path), None)
            if earlier is not None:  # a later rule refines an earlier one: keep the original full value
                earlier.twin = value
            else:
                self.shrinks.append(Shrink(path, meaning, old, value))

    def shrunk_meaning(self, meaning: str) -> Shrink | None:
        return next((s for s in self.shrinks if s.meaning == meaning), None)

    def put_all(self, meaning: str, value_of) -> None:
        for path, old in self.fields(meaning):
            self.put(path, meaning, value_of(old))


def _routing(plan: _ConfigEdit) -> None:
    experts = plan.first("experts")
    top_k = plan.first("top_k")
    if experts is None or experts <= 1:
        return
    k = min(top_k or 1, 4)
    # Keep k > 1 where the model has it (renormalisation only shows with several experts chosen).
    n_group = plan.first("n_group")
    topk_group = plan.first("topk_group")
    if n_group and n_group > 1:
        g = min(n_group, 4)
        tg = max(1, min(topk_group or 1, g - 1 if (topk_group or 1) < n_group else g))
        per_group = max(2, math.ceil(k / tg))
        e = g * per_group
        while e < max(8, 2 * k):
            per_group += 1
            e = g * per_group
        plan.put_all("n_group", lambda _: g)
        plan.put_all("topk_group", lambda _: tg)
    else:
        e = min(experts, max(8, 2 * k))
    plan.put_all("experts", lambda _: e)
    if top_k is not None:
        plan.put_all("top_k", lambda old: min(old, k))
    plan.put_all("n_shared", lambda old: min(old, 2))
    plan.put_all("zero_experts", lambda old: min(old, 2))


def _heads(plan: _ConfigEdit) -> None:
    """Attention heads to 4; key/value heads keep their relation (MHA, GQA or MQA) to the heads beside them."""
    for path, key, value in list(walk(plan.cfg)):
        if meaning_of(key) != "heads" or not is_size(value):
            continue
        prefix = path[: -len(key)]
        plan.put(path, "heads", SIZES["heads"])
        for kv_path, kv_key, kv_value in list(walk(plan.cfg)):
            if kv_path[: -len(kv_key)] != prefix or meaning_of(kv_key) != "kv_heads" or not is_size(kv_value):
                continue
            twin = SIZES["heads"] if kv_value >= value else (1 if kv_value == 1 else 2)
            plan.put(kv_path, "kv_heads", twin)


def _linear_heads(plan: _ConfigEdit) -> None:
    k_heads = plan.first("linear_k_heads")
    v_heads = plan.first("linear_v_heads")
    if k_heads:
        ratio = max(1, (v_heads or k_heads) // k_heads)
        plan.put_all("linear_k_heads", lambda _: 2)
        plan.put_all("linear_v_heads", lambda _: 2 * min(ratio, 2))


def _token_ids(cfg: dict, vocab: int) -> None:
    """Special token ids must stay inside the shrunk vocabulary (embeddings use pad as padding_idx)."""
    for path, key, value in list(walk(cfg)):
        if key.endswith("token_id") and isinstance(value, int) and value >= vocab:
            put(cfg, path, min(value, vocab - 1) if "pad" not in key else 0)
        elif key.endswith("token_id") and isinstance(value, list):
            put(cfg, path, [v if v < vocab else vocab - 1 for v in value if isinstance(v, int)])


def _rope(cfg: dict, plan: _ConfigEdit) -> None:
    """Rotary sections that partition the head dimension must follow it down."""
    for path, key, value in list(walk(cfg)):
        if key == "mrope_section" and isinstance(value, list) and value:
            head_dim = plan.first("head_dim") or SIZES["head_dim"]
            full_half = sum(value)
            twin_half = max(len(value), head_dim // 2)
            scaled = [max(1, v * twin_half // full_half) for v in value]
            scaled[0] += twin_half - sum(scaled)
            put(cfg, path, scaled)


HEAD_DIMS = ("head_dim", "rope_head_dim", "nope_head_dim", "v_head_dim", "index_head_dim", "linear_head_dim",
             "ssm_head_dim")


def _tie_equal_head_dims(plan: _ConfigEdit) -> None:
    """Head dims that were equal at full size stay equal (e.g. DeepSeek's head_dim is its rope dim)."""
    by_full: dict[int, list[Shrink]] = {}
    for s in plan.shrinks:
        if s.meaning in HEAD_DIMS:
            by_full.setdefault(s.full, []).append(s)
    for group in by_full.values():
        low = min(s.twin for s in group)
        for s in group:
            if s.twin != low:
                put(plan.cfg, s.path, low)
                s.twin = low


def _derived_sizes(plan: _ConfigEdit) -> None:
    """Unknown size fields that were a sum or small multiple of shrunk ones follow them down."""
    known = {s.path for s in plan.shrinks}
    dims = [s for s in plan.shrinks if s.meaning in HEAD_DIMS + ("hidden", "heads", "kv_heads", "ffn")]
    for path, key, value in list(walk(plan.cfg)):
        if path in known or not is_size(value) or not re.search(r"dim|size|heads?$", key):
            continue
        if meaning_of(key) is not None or key.startswith("max_") or "position" in key or "vocab" in key:
            continue
        twin = None
        for s in dims:
            for mult in (1, 2, 4):
                if value == mult * s.full:
                    twin = mult * s.twin
                    break
            if twin is not None:
                break
        if twin is None:
            for a in dims:
                for b in dims:
                    if a is not b and a.meaning in HEAD_DIMS and b.meaning in HEAD_DIMS and value == a.full + b.full:
                        twin = a.twin + b.twin
        if twin is not None and twin != value:
            plan.put(path, "derived", twin)


def _split_head_dims(plan: _ConfigEdit) -> None:
    """A head dim that was nope + rope at full size (MLA-style split heads) stays their sum."""
    nope = plan.shrunk_meaning("nope_head_dim")
    rope = plan.shrunk_meaning("rope_head_dim")
    if not nope or not rope:
        return
    for path, key, value in list(walk(plan.cfg)):
        if meaning_of(key) == "head_dim" and is_size(value):
            full = next((s.full for s in plan.shrinks if s.path == path), value)
            if full == nope.full + rope.full:
                plan.put(path, "head_dim", nope.twin + rope.twin)


def _ssm_heads(plan: _ConfigEdit) -> None:
    """Mamba-2 style blocks need heads x head_dim == expand x hidden."""
    heads = plan.fields("ssm_heads")
    head_dims = plan.fields("ssm_head_dim")
    expand = next((v for p, k, v in walk(plan.cfg) if k in ("mamba_expand", "expand") and is_size(v)), None)
    hidden = plan.first("hidden")
    if not (heads and expand and hidden):
        return
    head_dim = head_dims[0][1] if head_dims else None
    if head_dim is None:
        return
    inner = plan.fields("ssm_inner")
    if inner:  # an explicit inner width: make it heads x head_dim
        n = heads[0][1]
        for path, _ in inner:
            plan.put(path, "ssm_inner", n * head_dim)
        return
    n = max(1, expand * hidden // head_dim)
    for path, _ in heads:
        plan.put(path, "ssm_heads", n)


def shrink_config_dict(full: dict) -> tuple[dict, list[Shrink]]:
    """Twin-scale values for every field whose meaning the table knows; the rest stays as it was."""
    plan = _ConfigEdit(copy.deepcopy(full))
    _routing(plan)
    _heads(plan)
    _linear_heads(plan)
    for meaning in ("hidden", "head_dim", "ffn", "expert_ffn", "shared_ffn", "q_lora_rank", "kv_lora_rank",
                    "rope_head_dim", "nope_head_dim", "v_head_dim", "index_heads", "index_head_dim",
                    "linear_head_dim", "linear_heads", "ssm_state", "ssm_heads", "ssm_head_dim", "ssm_groups",
                    "dt_rank", "vocab"):
        target = SIZES[meaning]
        plan.put_all(meaning, lambda old, t=target: min(old, t))
    for meaning in ("index_topk", "window"):
        target = SIZES[meaning]
        plan.put_all(meaning, lambda old, t=target: min(old, t))
    _tie_equal_head_dims(plan)
    _split_head_dims(plan)
    _derived_sizes(plan)
    _ssm_heads(plan)
    _token_ids(plan.cfg, plan.first("vocab") or SIZES["vocab"])
    _rope(plan.cfg, plan)
    return plan.cfg, plan.shrinks


# ----------------------------------------------------------------------------------------------------
# Layers: find the decoder stack, fingerprint each layer, keep the shortest prefix that shows them all


def find_layer_stack(model: nn.Module, num_layers: int | None) -> tuple[str, nn.ModuleList]:
    """The decoder layer stack (`runtime.model_tree.find_layer_stack`), as an OnboardError when there is none."""
    try:
        return model_tree.find_layer_stack(model, num_layers)
    except ValueError as exc:
        raise OnboardError(str(exc)) from None


def _attr_fingerprint(module: nn.Module) -> list[str]:
    out = []
    for key, value in sorted(vars(module).items()):
        if key.startswith("_") or key == "training":
            continue
        if isinstance(value, (bool, str)) or value is None:
            out.append(f"{key}={value!r}")
    return out


def layer_signature(layer: nn.Module, per_layer_values: tuple = ()) -> str:
    """Structure of one decoder layer: module classes, parameter ranks, flags; never its widths."""
    parts = [f"cfg:{per_layer_values!r}"]
    for name, module in layer.named_modules():
        parts.append(f"{name}:{type(module).__name__}:{','.join(_attr_fingerprint(module))}")
    for name, param in layer.named_parameters():
        parts.append(f"p:{name}:{param.dim()}")
    return "|".join(parts)


def _make_config(source: ModelSource, cfg_dict: dict):
    cls = type(source.config)
    try:
        config = cls.from_dict(cfg_dict)
    except Exception as exc:
        raise OnboardError(f"{source.name}: the twin config is invalid: {one_line(exc)}") from exc
    config._name_or_path = getattr(source.config, "_name_or_path", "")
    return config


def _signatures(model: nn.Module, cfg: dict, layers_path: str, list_paths: list[str]) -> list[str]:
    stack = dict(model.named_modules())[layers_path]
    lists = [get(cfg, p) for p in list_paths]
    return [layer_signature(layer, tuple(lst[i] for lst in lists)) for i, layer in enumerate(stack)]


def _build_real(source: ModelSource, cfg: dict) -> nn.Module:
    torch.manual_seed(0)
    model = source.build(_make_config(source, cfg), experts_implementation="grouped_mm")
    model.eval()  # no dropout: capture and verification need deterministic numbers
    return model


def build_twin(source: ModelSource, *, run_check: bool = True) -> Twin:
    """Shrink, choose the layer prefix, build for real, and check forward + backward runs."""
    full = source.config.to_dict()
    cfg, shrinks = shrink_config_dict(full)
    count_key = layers_key(cfg)
    full_layers = get(cfg, count_key) if count_key else None

    # 1. twin width, full depth, on meta: the structural signature of every layer.
    wide = source.build(_make_config(source, cfg), device="meta")
    layers_path, stack = find_layer_stack(wide, full_layers)
    full_layers = len(stack)
    list_paths = per_layer_lists(cfg, full_layers)  # decided at full depth: short lists are ambiguous
    full_sigs = _signatures(wide, cfg, layers_path, list_paths)
    del wide

    # 2. shortest prefix holding every distinct signature.
    wanted = set(full_sigs)
    seen: set[str] = set()
    keep = full_layers
    for i, sig in enumerate(full_sigs):
        seen.add(sig)
        if seen == wanted:
            keep = i + 1
            break
    if keep > MAX_TWIN_LAYERS:
        raise OnboardError(f"{source.name}: the twin would need {keep} layers to show every layer kind")
    # 3. the real twin; if the shortened stack does not reproduce the full one (validators that tie layer
    # counts together, index lists we could not read), keep the full depth at twin width instead.
    model = None
    if count_key and keep != full_layers:
        short = copy.deepcopy(cfg)
        truncate_layers(short, count_key, full_layers, keep)
        try:
            model = _build_real(source, short)
            twin_sigs = _signatures(model, short, layers_path, list_paths)
        except OnboardError:
            model = None
        if model is not None and twin_sigs == full_sigs[:keep]:
            cfg = short
            shrinks.append(Shrink(count_key, "layers", full_layers, keep))
        else:
            model = None
    if model is None:
        if full_layers > MAX_TWIN_LAYERS:
            raise OnboardError(f"{source.name}: no short twin reproduces the layer structure of {full_layers} layers")
        keep = full_layers
        model = _build_real(source, cfg)
        twin_sigs = _signatures(model, cfg, layers_path, list_paths)
    config = model.config
    twin = Twin(source, config, model, shrinks, twin_sigs, full_sigs, layers_path)
    if run_check:
        check_runs(twin)
    return twin


def check_runs(twin: Twin) -> float:
    """Forward + backward on a small batch; the loss must be finite and parameters must get gradients."""
    batch = twin.example_batch()
    try:
        out = twin.model(**batch, use_cache=False)
        loss = out.loss
        loss.backward()
    except Exception as exc:
        raise OnboardError(f"{twin.source.name}: the tiny twin does not run: {one_line(exc)}") from exc
    if loss is None or not torch.isfinite(loss):
        raise OnboardError(f"{twin.source.name}: the tiny twin's loss is not finite ({loss})")
    twin.model.zero_grad(set_to_none=True)
    return float(loss.detach())
