"""The tiny twin's config by what its fields mean (`onboard.twin.meanings`, matched at any depth of nested dicts
such as ``linear_attn_config`` or ``rope_parameters``): the rules that shrink each meaning to twin scale while
related sizes follow (equal head dims stay equal, MLA's split head dims stay summed, Mamba heads x head dim =
expand x hidden, GQA stays GQA, top-k stays below the expert count).

Names are hints: `shrink_config_dict(full, hints)` takes, for fields found by behaviour
(`onboard.twin.behaviour`), the meaning their effect on the model showed, in place of the meaning of their name.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass

from onboard.twin.fields import get, is_size, per_layer_meaning, put, walk
from onboard.twin.meanings import meaning_of

# Target values at twin scale for plain size fields.
SIZES = {
    "hidden": 64, "heads": 4, "head_dim": 16, "ffn": 128, "expert_ffn": 32, "shared_ffn": 48,
    "vocab": 512, "q_lora_rank": 24, "kv_lora_rank": 16, "rope_head_dim": 8, "nope_head_dim": 16,
    "v_head_dim": 16, "index_heads": 2, "index_head_dim": 16, "index_topk": 8, "window": 8,
    "linear_head_dim": 16, "linear_heads": 4, "ssm_state": 8, "ssm_heads": 4, "ssm_head_dim": 16,
    "ssm_groups": 1, "dt_rank": 8,
}


# Fields found by behaviour (onboard.twin.behaviour) with no known meaning: those wider than the twin's hidden size
# are shrunk to the first of these values that no other field holds (even: head sizes split for rotary)
WIDTH_FLOOR = 64
WIDTH_LADDER = (32, 48, 40, 24, 56, 16, 72, 80, 88, 96, 104, 112, 120)
# routed experts in a twin whose top-k field is unknown (its k stays the model's): room for k up to 8
EXPERTS_WITHOUT_TOP_K = 16


def halved(value: int, floor: int) -> int:
    """`value` halved as often as it stays a whole number of at least `floor` (3072 -> 96, 2048 -> 64)."""
    while value % 2 == 0 and value // 2 >= floor:
        value //= 2
    return value


@dataclass
class Shrink:
    """One field the twin changed: where it lives, what it means, both values, and why."""

    path: str
    meaning: str
    full: object
    twin: object
    why: str = ""  # "its name", "what it drives" (found by behaviour), the layer prefix, --layers, --width


class _ConfigEdit:
    """The twin's values, decided field by field; records every change."""

    def __init__(self, cfg: dict, hints: dict[str, str] | None = None):
        self.cfg = cfg
        self.shrinks: list[Shrink] = []
        self.hints = hints or {}
        self.by_behaviour = hints is not None  # the fields' meanings were checked against the model

    def meaning(self, path: str, key: str) -> str | None:
        """What behaviour showed the field at `path` drives ("": nothing its name claims), else its name's meaning."""
        return self.hints[path] if path in self.hints else meaning_of(key)

    def fields(self, meaning: str):
        return [(p, v) for p, k, v in walk(self.cfg) if self.meaning(p, k) == meaning and is_size(v)]

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
                why = "what it drives" if path in self.hints else "its name"
                self.shrinks.append(Shrink(path, meaning, old, value, why))

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
    elif top_k is None and plan.by_behaviour:
        # the top-k field is unknown, so the twin keeps the model's own k: leave the router room to choose
        e = min(experts, EXPERTS_WITHOUT_TOP_K)
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
        if plan.meaning(path, key) != "heads" or not is_size(value):
            continue
        prefix = path[: -len(key)]
        plan.put(path, "heads", SIZES["heads"])
        kv_twin = SIZES["heads"]
        for kv_path, kv_key, kv_value in list(walk(plan.cfg)):
            if (kv_path[: -len(kv_key)] != prefix or plan.meaning(kv_path, kv_key) != "kv_heads"
                    or not is_size(kv_value)):
                continue
            kv_twin = SIZES["heads"] if kv_value >= value else (1 if kv_value == 1 else 2)
            plan.put(kv_path, "kv_heads", kv_twin)
        _per_layer_heads(plan, prefix, value, kv_twin)


def _per_layer_heads(plan: _ConfigEdit, prefix: str, full_heads: int, kv_twin: int) -> None:
    """A per-layer head count list beside the heads at `prefix` follows them: each layer's count scaled as the
    heads were, a whole multiple of the twin's key/value heads (transformers groups queries over them), layers that
    differed still differing. Left at full scale it would either keep the full model's heads in the twin or, where
    the twin's key/value heads outnumber a layer's own (a 2-head model's twin has 4 of each), not run at all."""
    for path, key, value in list(walk(plan.cfg)):
        if path[: -len(key)] != prefix or per_layer_meaning(key, value) != "heads":
            continue
        twin_of, previous = {}, 0
        for count in sorted(set(value)):
            scaled = max(kv_twin, round(count * SIZES["heads"] / full_heads / kv_twin) * kv_twin)
            twin_of[count] = previous = max(scaled, previous + kv_twin)
        plan.put(path, "heads", [twin_of[count] for count in value])


def _linear_heads(plan: _ConfigEdit) -> None:
    k_heads = plan.first("linear_k_heads")
    v_heads = plan.first("linear_v_heads")
    if k_heads:
        ratio = max(1, (v_heads or k_heads) // k_heads)
        plan.put_all("linear_k_heads", lambda _: 2)
        plan.put_all("linear_v_heads", lambda _: 2 * min(ratio, 2))


def fit_token_ids(cfg: dict, vocab: int) -> None:
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
    # a head dim already at its twin size that equalled a shrunk one follows it too (all four of an MLA config
    # drawn with head_dim == qk_rope_head_dim == qk_nope_head_dim)
    shrunk = {s.path for s in plan.shrinks}
    for meaning in HEAD_DIMS:
        for path, value in plan.fields(meaning):
            if path not in shrunk and value in by_full:
                plan.put(path, meaning, min(s.twin for s in by_full[value]))


def _derived_sizes(plan: _ConfigEdit) -> None:
    """Unknown size fields that were a sum or small multiple of shrunk ones follow them down: a count of heads
    follows head counts, a width follows widths (LongCat's qk_head_dim of 24 with 6 heads is nope + rope, not
    4 x heads), and a sum of two head sizes follows them whether or not each shrank."""
    known = {s.path for s in plan.shrinks}
    dims = [s for s in plan.shrinks
            if s.meaning in HEAD_DIMS + ("hidden", "heads", "kv_heads", "ffn") and is_size(s.full)]
    # the hidden size first, shrunk or not: a width that is a multiple of it (Zamba's attention over the hidden
    # state and the embeddings side by side, 2 x hidden) follows it, also where a head size has the same value
    hidden = plan.shrunk_meaning("hidden") or next((Shrink(p, "hidden", v, v) for p, v in plan.fields("hidden")), None)
    if hidden is not None:
        dims = [hidden] + [s for s in dims if s is not hidden]
    head_sizes = [s for s in dims if s.meaning in HEAD_DIMS]
    head_sizes += [Shrink(p, m, v, v) for m in HEAD_DIMS for p, v in plan.fields(m) if p not in known]
    for path, key, value in list(walk(plan.cfg)):
        if path in known or not is_size(value) or not re.search(r"dim|size|heads?$", key):
            continue
        if plan.meaning(path, key) is not None or key.startswith("max_") or "position" in key or "vocab" in key:
            continue
        counts = re.search(r"heads?$", key) is not None
        twin = None
        for s in dims:
            if (s.meaning in ("heads", "kv_heads")) != counts:
                continue
            for mult in (1, 2, 4):
                if value == mult * s.full:
                    twin = mult * s.twin
                    break
            if twin is not None:
                break
        if twin is None and not counts:
            twin = next((a.twin + b.twin for a in head_sizes for b in head_sizes
                         if a is not b and value == a.full + b.full), None)
        if twin is not None and twin != value:
            plan.put(path, "derived", twin)


def _split_head_dims(plan: _ConfigEdit) -> None:
    """A head dim that was nope + rope at full size (MLA-style split heads) stays their sum, also where the nope
    dim is a per-layer override (dots3's sliding layers: head_dim = their own qk_nope_head_dim + rope)."""
    nopes = [s for s in plan.shrinks if s.meaning == "nope_head_dim"]
    ropes = [s for s in plan.shrinks if s.meaning == "rope_head_dim"]
    for path, key, value in list(walk(plan.cfg)):
        if plan.meaning(path, key) == "head_dim" and is_size(value):
            full = next((s.full for s in plan.shrinks if s.path == path), value)
            twin = next((n.twin + r.twin for n in nopes for r in ropes if full == n.full + r.full), None)
            if twin is not None:
                plan.put(path, "head_dim", twin)


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


def _widths(plan: _ConfigEdit, full: dict) -> None:
    """Fields behaviour found sizing parameters, of no known meaning (an expert's width, a head size): each
    wider than WIDTH_FLOOR gets a twin value that no other field holds, at full size or in the twin, so that a
    number seen in the twin maps back to this one field (`Shrink.full`)."""
    taken = {v for _, _, v in walk(full) if is_size(v)} | {v for _, _, v in walk(plan.cfg) if is_size(v)}
    for path, value in plan.fields("width"):
        twin = next((w for w in WIDTH_LADDER if w < value and w not in taken), None)
        if value > WIDTH_FLOOR and twin is not None:
            plan.put(path, "width", twin)
            taken.add(twin)


def shrink_config_dict(full: dict, hints: dict[str, str] | None = None) -> tuple[dict, list[Shrink]]:
    """Twin-scale values for every field whose meaning the table knows; the rest stays as it was.

    `hints` ({path: meaning}, from `onboard.twin.behaviour`: "vocab", "hidden", "experts", "width", or "" for a field
    whose name claims a meaning its effect on the model does not show) take the place of the names' meanings."""
    plan = _ConfigEdit(copy.deepcopy(full), hints)
    _routing(plan)
    _heads(plan)
    _linear_heads(plan)
    for path, old in plan.fields("hidden"):
        # a width found by behaviour is halved while it stays at least the twin's: it keeps the model's odd
        # factors, so a head count that divides it (one that sizes no parameter, head size = width / heads,
        # is never found) still does
        plan.put(path, "hidden", halved(old, SIZES["hidden"]) if path in plan.hints else min(old, SIZES["hidden"]))
    for meaning in ("head_dim", "ffn", "expert_ffn", "shared_ffn", "q_lora_rank", "kv_lora_rank", "rope_head_dim",
                    "nope_head_dim", "v_head_dim", "index_heads", "index_head_dim", "linear_head_dim", "linear_heads",
                    "ssm_state", "ssm_heads", "ssm_head_dim", "ssm_groups", "dt_rank", "vocab"):
        target = SIZES[meaning]
        plan.put_all(meaning, lambda old, t=target: min(old, t))
    for meaning in ("index_topk", "window"):
        target = SIZES[meaning]
        plan.put_all(meaning, lambda old, t=target: min(old, t))
    _tie_equal_head_dims(plan)
    _split_head_dims(plan)
    _derived_sizes(plan)
    _ssm_heads(plan)
    _widths(plan, full)
    fit_token_ids(plan.cfg, plan.first("vocab") or SIZES["vocab"])
    _rope(plan.cfg, plan)
    return plan.cfg, plan.shrinks

