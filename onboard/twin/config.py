"""The tiny twin's config: field names first, the model's behaviour when they fall short, and the model as it
is when no field can be shrunk safely.

1. Names (`onboard.twin.shrink`): every field whose name the table knows is shrunk by its meaning. Cheap, and
   right for every transformers family.
2. Check, on the meta device at twin width and full depth: the input embedding table is at twin scale
   (at most SIZES["vocab"] x SIZES["hidden"]), some field is named as the layer count where fewer layers
   would show every kind of layer, and no decoder layer holds more than LAYER_BUDGET parameters. If so, the
   names sufficed.
3. Otherwise behaviour decides (`onboard.twin.behaviour`): each field whose name is unknown, or claims the
   vocabulary, hidden size, expert count or layer count, is changed alone on the meta device, and what moves
   says what it drives. A name whose field moves nothing it claims is overruled. The twin is then shrunk
   by those findings; a shrink the model refuses to build with is dropped, one field at a time.
4. Where nothing could be shrunk, a model of at most AS_IS_BUDGET parameters is its own twin; so is it
   where a twin shrunk by behaviour does not run (`as_is`, called by `onboard.twin.Twin.build`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from torch import nn

from onboard.errors import OnboardError, one_line
from onboard.source import ModelSource
from onboard.twin import behaviour
from onboard.twin.fields import get, layers_key, put, walk
from onboard.twin.meanings import meaning_of
from onboard.twin.shrink import SIZES, Shrink, fit_token_ids, shrink_config_dict
from runtime import model_tree

# parameters in one twin layer: the largest twin layer of the transformers families holds 0.7M
LAYER_BUDGET = 1_000_000
# a model this small at full size can be its own twin (the largest family twins hold about 30M)
AS_IS_BUDGET = 50_000_000
# meanings a field's name must show by behaviour once behaviour decides (the facts the pipeline reads)
CHECKED = (behaviour.VOCAB, behaviour.HIDDEN, behaviour.EXPERTS)


@dataclass
class TwinConfig:
    """The twin's config dict and how it was reached."""

    cfg: dict
    shrinks: list[Shrink]
    layers_key: str | None  # the field holding the layer count, if any
    fields: dict[str, str] = field(default_factory=dict)  # {path: what it drives} where behaviour decided
    why_probed: str | None = None  # why the names did not suffice (None: they did)


def make_config(source: ModelSource, cfg_dict: dict):
    """The model's own config class built from a config dict (remote code included)."""
    cls = type(source.config)
    try:
        config = cls.from_dict(cfg_dict)
    except Exception as exc:
        raise OnboardError(f"{source.name}: the twin config is invalid: {one_line(exc)}") from exc
    config._name_or_path = getattr(source.config, "_name_or_path", "")
    return config


def build_meta(source: ModelSource, cfg_dict: dict) -> nn.Module:
    """The model for a config dict on the meta device: every parameter's shape, no memory."""
    return source.build(make_config(source, cfg_dict), device="meta")


def twin_config(source: ModelSource) -> TwinConfig:
    """The twin's config (see the module docstring)."""
    full = source.config.to_dict()
    cfg, shrinks = shrink_config_dict(full)
    key = layers_key(cfg)
    why = _why_not_small(source, cfg, key)
    if why is None:
        return TwinConfig(cfg, shrinks, key)
    return _by_behaviour(source, full, why)


def _why_not_small(source: ModelSource, cfg: dict, key: str | None) -> str | None:
    """Why the config shrunk by names does not make a small twin (None when it does)."""
    try:
        model = build_meta(source, cfg)
    except OnboardError as exc:
        return f"the config shrunk by field names does not build ({exc})"
    table = getattr(model.get_input_embeddings(), "weight", None)
    if table is not None and (table.shape[0] > SIZES["vocab"] or table.shape[-1] > SIZES["hidden"]):
        return f"shrunk by field names, the input embedding is still {table.shape[0]} x {table.shape[-1]}"
    try:
        _, stack = model_tree.find_layer_stack(model, get(cfg, key) if key else None)
    except ValueError:
        return None  # no decoder stack at all: building the twin says so
    if key is None and _shortest_prefix(stack) < len(stack):
        return "no field is named as the layer count, and fewer layers would show every kind"
    biggest = max(sum(p.numel() for p in layer.parameters()) for layer in stack)
    if biggest > LAYER_BUDGET:
        return f"shrunk by field names, a decoder layer still holds {biggest:,} parameters"
    return None


def _shortest_prefix(stack: nn.ModuleList) -> int:
    """Layers up to the first of each distinct layout of module classes (a rough form of the twin's own
    layer signatures, which the twin's depth is chosen by)."""
    first: dict[tuple, int] = {}
    for i, layer in enumerate(stack):
        first.setdefault(tuple(type(m).__name__ for m in layer.modules()), i)
    return max(first.values()) + 1


def _by_behaviour(source: ModelSource, full: dict, why: str) -> TwinConfig:
    """Probe the fields (`onboard.twin.behaviour`), shrink by what they drive, keep what the model builds with."""
    named = {path: meaning_of(key) for path, key, _ in walk(full)}
    count = layers_key(full)
    paths = [p for p in behaviour.candidates(full) if named.get(p) in (None, *CHECKED) or p == count]
    found = behaviour.probe_fields(lambda cfg: build_meta(source, cfg), full, paths)
    hints = {}
    for path, what in found.items():
        if what in (*CHECKED, behaviour.WIDTH):
            hints[path] = what
        elif named.get(path) in CHECKED:
            hints[path] = ""  # its name claims a size its effect on the model does not show: a hint that lied
    layers = next((p for p, what in found.items() if what == behaviour.LAYERS), None)
    if layers is None and found.get(count) == behaviour.TIED:
        layers = count  # named, and bound to other fields: the twin's layer prefix is checked anyway
    cfg, shrinks = _buildable(source, full, *shrink_config_dict(full, hints))
    if not shrinks:
        _check_small(source, full, why)
    return TwinConfig(cfg, shrinks, layers, found, why)


def _buildable(source: ModelSource, full: dict, cfg: dict, shrinks: list[Shrink]) -> tuple[dict, list[Shrink]]:
    """The shrunk config if the model builds with it; else the shrinks it builds with, added one at a time."""
    try:
        build_meta(source, cfg)
        return cfg, shrinks
    except OnboardError:
        pass
    current, kept = copy.deepcopy(full), []
    for s in shrinks:
        trial = copy.deepcopy(current)
        put(trial, s.path, s.twin)
        if s.meaning == "vocab":
            fit_token_ids(trial, s.twin)
        try:
            build_meta(source, trial)
        except OnboardError:
            continue  # tied to a field that has not changed with it (a validator, a product of sizes)
        current, kept = trial, [*kept, s]
    return current, kept


def _check_small(source: ModelSource, full: dict, why: str) -> None:
    """A model nothing could be shrunk in serves as its own twin only if it is small."""
    n = sum(p.numel() for p in build_meta(source, full).parameters())
    if n > AS_IS_BUDGET:
        raise OnboardError(f"{source.name}: no twin: {why}, no config field could be shrunk safely, and at full "
                           f"size the model has {n:,} parameters (a twin may have {AS_IS_BUDGET:,})")


def as_is(source: ModelSource, plan: TwinConfig) -> TwinConfig | None:
    """The model at full size as its own twin, when behaviour shrank fields of a model small enough as it is
    (for a shrunk twin the model refused to run); None otherwise."""
    if plan.why_probed is None or not plan.shrinks:
        return None
    full = source.config.to_dict()
    try:
        _check_small(source, full, plan.why_probed)
    except OnboardError:
        return None
    return TwinConfig(full, [], plan.layers_key, plan.fields, f"{plan.why_probed}; the shrunk twin did not run")
