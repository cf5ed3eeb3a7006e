"""Tiny twin: the same architecture as a full-size config, with small dimensions and random fp32 weights.

`Twin.build(source)` is the one way in, and this module is where a twin is made, in the order it is made:

1. The config (`twin_config`). Field names first (`onboard.twin.shrink`, by the meanings of
   `onboard.twin.meanings`, matched at any depth of nested dicts such as ``linear_attn_config``): every field
   whose name the table knows is shrunk by its meaning, never by ``model_type``. Cheap, and right for every
   transformers family. The names suffice when, on the meta device at twin width and full depth, the input
   embedding table is at twin scale (at most SIZES["vocab"] x SIZES["hidden"]), some field is named as the
   layer count where fewer layers would show every kind of layer, and no decoder layer holds more than
   LAYER_BUDGET parameters. Otherwise behaviour decides (`onboard.twin.behaviour`): each field whose name is
   unknown, or claims the vocabulary, hidden size, expert count or layer count, is changed alone on the meta
   device, and what moves says what it drives; a name whose field moves nothing it claims is overruled; a
   shrink the model refuses to build with is dropped, one field at a time. Where nothing could be shrunk, a
   model of at most AS_IS_BUDGET parameters is its own twin; so is it where a twin shrunk by behaviour does
   not run (`as_is`).
2. The depth (`onboard.twin.layers`), never guessed from field names: the model is built on the meta device at
   twin width with its full depth, each decoder layer gets a structural signature, and the twin keeps the
   shortest prefix of layers that holds every distinct signature.
3. The model, built for real (`instantiate`, the one place onboard builds a HuggingFace model from a config)
   and run forward and backward once; beside it the full-size model on the meta device (every shape, no
   memory) and the full config's numbers by meaning, which is all later stages read of the model at full
   scale. It keeps every distinctive feature: each layer kind and its interleaving, shared experts,
   dense-first layers, grouped routing, low ranks, and windows / index top-k smaller than the test sequence
   so sparsity is exercised.

`Twin.build(source, layers=N, width=W)` is the model a user trains at a size of their own: the first N layers at
twin width (the twin's own prefix when N is not given), W times wider. `Twin.changes` records every field either
changed, from what, to what, and why. A Twin is a record: later stages read its fields and call nothing of it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from onboard.errors import OnboardError, one_line
from onboard.source import ModelSource
from onboard.twin import behaviour
from onboard.twin import layers as depth
from onboard.twin.fields import (
    get,
    layers_key,
    lm_prefix,
    per_layer_lists,
    put,
    sizes_by_meaning,
    truncate_layers,
    walk,
)
from onboard.twin.meanings import meaning_of
from onboard.twin.scale import widen
from onboard.twin.shrink import SIZES, Shrink, fit_token_ids, shrink_config_dict

TEST_SEQ_LEN = 32
TEST_BATCH = 2

# parameters in one twin layer: the largest twin layer of the transformers families holds 0.7M
LAYER_BUDGET = 1_000_000
# a model this small at full size can be its own twin (the largest family twins hold about 30M)
AS_IS_BUDGET = 50_000_000
# meanings a field's name must show by behaviour once behaviour decides (the facts the pipeline reads)
CHECKED = (behaviour.VOCAB, behaviour.HIDDEN, behaviour.EXPERTS)


@dataclass
class Twin:
    source: ModelSource
    config: object
    model: nn.Module
    shrinks: list[Shrink] = field(default_factory=list)  # every field changed from the full config, and why
    layer_signatures: list[str] = field(default_factory=list)  # the twin's own layers
    full_layer_signatures: list[str] = field(default_factory=list)  # every layer of the full model
    layers_path: str = ""
    fields: dict[str, str] = field(default_factory=dict)  # what behaviour found each config field drives
    why_probed: str | None = None  # why the field names did not suffice to shrink the config (None: they did)
    # the model at full size on the meta device (None for a model scaled for training)
    full_model: nn.Module | None = None
    # the full config's integer fields of known meaning: {meaning: [(path, value), ...]}, in the config's order
    full_sizes: dict[str, list[tuple[str, int]]] = field(default_factory=dict)

    @classmethod
    def build(cls, source: ModelSource, *, layers: int | None = None, width: int = 1, check: bool = True) -> Twin:
        """The tiny twin of `source`; with `layers` / `width`, its first `layers` layers at twin width (the twin's
        own prefix when not given), `width` times wider. `check`: run forward and backward once, and fall back
        to the model as it is where a twin shrunk by behaviour does not run and the model is small."""
        if width < 1 or (layers is not None and layers < 1):
            raise OnboardError("--layers and --width must be at least 1")
        plan = twin_config(source)
        if layers is not None or width != 1:
            return _scaled(source, plan, layers, width, check)
        twin = _shrunk_or_as_is(source, plan, check)
        twin.full_model = instantiate(source, device="meta")
        twin.full_sizes = sizes_by_meaning(source.config.to_dict())
        return twin

    @property
    def changes(self) -> list[Shrink]:
        return self.shrinks

    @property
    def full_width(self) -> bool:
        """Behaviour found no field to shrink safely: the twin is the model at its own widths."""
        return self.why_probed is not None and all(s.meaning == "layers" for s in self.shrinks)

    @property
    def vocab_size(self) -> int:
        """The token ids the twin takes and predicts: rows of its input embedding table, whatever its config
        calls them, and no more than its output head scores (a head over the unpadded vocabulary, narrower
        than a padded embedding table, cannot take a label past its width)."""
        rows = self.model.get_input_embeddings().weight.shape[0]
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        width = getattr(head, "out_features", None) if head is not None else None
        return min(rows, width) if isinstance(width, int) and width > 3 else rows

    @property
    def hidden_size(self) -> int:
        """The width of the hidden state: the input embedding table's width."""
        return self.model.get_input_embeddings().weight.shape[-1]

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
        ids = torch.randint(3, self.vocab_size, (TEST_BATCH, seq_len), generator=gen)
        return {"input_ids": ids, "labels": ids.clone()}


@dataclass
class TwinConfig:
    """The twin's config dict and how it was reached."""

    cfg: dict
    shrinks: list[Shrink]
    layers_key: str | None  # the field holding the layer count, if any
    fields: dict[str, str] = field(default_factory=dict)  # {path: what it drives} where behaviour decided
    why_probed: str | None = None  # why the names did not suffice (None: they did)


def instantiate(source: ModelSource, config=None, *, device: str | None = None,
                experts_implementation: str | None = None) -> nn.Module:
    """The causal LM of `source` for `config` (default: the source's own) with random fp32 weights.

    `experts_implementation` picks transformers' expert kernel where the model supports the choice
    ("grouped_mm" has no data-dependent Python loop, so it exports as one graph); models that do not
    support it are built as they are.
    """
    from transformers import AutoModelForCausalLM

    config = config if config is not None else source.config
    kwargs = {"trust_remote_code": source.trust_remote_code, "dtype": torch.float32}
    with torch.device(device or "cpu"):
        if experts_implementation:
            try:  # on a copy: a refused choice must not stay written into the config
                return AutoModelForCausalLM.from_config(
                    copy.deepcopy(config), experts_implementation=experts_implementation, **kwargs)
            except Exception:  # the model offers no choice of experts implementation: build it plainly
                pass
        try:
            return AutoModelForCausalLM.from_config(config, **kwargs)
        except Exception as exc:  # model code we do not own: say which model and why, in one line
            raise OnboardError(f"{source.name}: building the model failed: {one_line(exc)}") from exc


def config_of(source: ModelSource, cfg_dict: dict):
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
    return instantiate(source, config_of(source, cfg_dict), device="meta")


def twin_config(source: ModelSource) -> TwinConfig:
    """The twin's config (see the module docstring)."""
    full = source.config.to_dict()
    cfg, shrinks = shrink_config_dict(full)
    key = layers_key(cfg, lm_prefix(source.config))
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
    for which, table in (("input embedding", model.get_input_embeddings()), ("output head", _output_head(model))):
        table = getattr(table, "weight", None)
        if table is not None and (table.shape[0] > SIZES["vocab"] or table.shape[-1] > SIZES["hidden"]):
            return f"shrunk by field names, the {which} is still {table.shape[0]} x {table.shape[-1]}"
    try:
        _, stack = depth.decoder_stack(model, get(cfg, key) if key else None)
    except OnboardError:
        return None  # no decoder stack at all: building the twin says so
    if key is None and _shortest_prefix(stack) < len(stack):
        return "no field is named as the layer count, and fewer layers would show every kind"
    biggest = max(sum(p.numel() for p in layer.parameters()) for layer in stack)
    if biggest > LAYER_BUDGET:
        return f"shrunk by field names, a decoder layer still holds {biggest:,} parameters"
    return None


def _output_head(model: nn.Module) -> nn.Module | None:
    """The model's output head (its logits' width is the vocabulary it predicts), or None."""
    try:
        return model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
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
    count = layers_key(full, lm_prefix(source.config))
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


# --------------------------------------------------------------------------------------------------
# the twin built from its config


def _build_real(source: ModelSource, cfg: dict) -> nn.Module:
    torch.manual_seed(0)
    model = instantiate(source, config_of(source, cfg), experts_implementation="grouped_mm")
    model.eval()  # no dropout: capture and verification need deterministic numbers
    return model


def _shrunk_or_as_is(source: ModelSource, plan: TwinConfig, run_check: bool) -> Twin:
    """The twin of `plan`; where a twin shrunk by behaviour does not build or run, the model as it is, if small."""
    try:
        return _build(source, plan, run_check)
    except OnboardError:
        fallback = as_is(source, plan)
        if fallback is None:
            raise
        return _build(source, fallback, run_check)


def _build(source: ModelSource, plan: TwinConfig, run_check: bool) -> Twin:
    """Choose the layer prefix, build for real, and check forward + backward runs."""
    cfg, shrinks, count_key = plan.cfg, list(plan.shrinks), plan.layers_key
    full_layers = get(cfg, count_key) if count_key else None

    # 1. twin width, full depth, on meta: the structural signature of every layer.
    wide = build_meta(source, cfg)
    layers_path, stack = depth.decoder_stack(wide, full_layers)
    full_layers = len(stack)
    list_paths = per_layer_lists(cfg, full_layers)  # decided at full depth: short lists are ambiguous
    full_sigs = depth.signatures(wide, cfg, layers_path, list_paths)
    del wide

    # 2. the shortest prefix holding every distinct signature, then the shortest holding each twice (a block
    # shared across layers needs a second use: transformers ties the copies, and refuses a lone one).
    if (shortest := depth.prefix(full_sigs, 1)) > depth.MAX_TWIN_LAYERS:
        raise OnboardError(f"{source.name}: the twin would need {shortest} layers to show every layer kind")
    prefixes = sorted({shortest, depth.prefix(full_sigs, 2)} - {full_layers})
    # 3. the real twin; if no shortened stack reproduces the full one (validators that tie layer counts
    # together, index lists we could not read, modules counted per layer inside a shared block), keep the full
    # depth at twin width instead.
    model = None
    for keep in prefixes if count_key else ():
        short = copy.deepcopy(cfg)
        truncate_layers(short, count_key, full_layers, keep)
        try:
            model = _build_real(source, short)
            twin_sigs = depth.signatures(model, short, layers_path, list_paths)
        except OnboardError:
            model = None
        if model is not None and twin_sigs == full_sigs[:keep]:
            cfg = short
            shrinks.append(Shrink(count_key, "layers", full_layers, keep, "the shortest prefix showing every layer kind"))
            break
        model = None
    if model is None:
        if full_layers > depth.MAX_TWIN_LAYERS:
            raise OnboardError(f"{source.name}: no short twin reproduces the layer structure of {full_layers} layers")
        model = _build_real(source, cfg)
        twin_sigs = depth.signatures(model, cfg, layers_path, list_paths)
    twin = Twin(source, model.config, model, shrinks, twin_sigs, full_sigs, layers_path, plan.fields, plan.why_probed)
    if run_check:
        check_runs(twin)
    return twin


def _scaled(source: ModelSource, plan: TwinConfig, layers: int | None, width: int, run_check: bool) -> Twin:
    """The twin's config (its own layer prefix when `layers` is None, else the first `layers` layers at twin
    width), `width` times wider, built for real."""
    if layers is None:
        twin = _shrunk_or_as_is(source, plan, run_check=False)  # as the twin adapt verified
        cfg, changes = twin.config.to_dict(), list(twin.shrinks)
    else:
        cfg, changes, key = copy.deepcopy(plan.cfg), list(plan.shrinks), plan.layers_key
        if key is None:
            raise OnboardError(f"{source.name}: the model config has no layer count to set")
        full = get(cfg, key)
        if layers > full:
            raise OnboardError(f"{source.name}: the model has {full} layers; --layers may not exceed that")
        truncate_layers(cfg, key, full, layers)
        if layers != full:
            changes.append(Shrink(key, "layers", full, layers, f"--layers {layers}"))
    if width > 1:
        changes += widen(cfg, changes, width)
    model = _build_real(source, cfg)
    layers_path, _ = depth.decoder_stack(model, None)
    sigs = depth.signatures(model, cfg, layers_path, [])
    twin = Twin(source, model.config, model, changes, sigs, sigs, layers_path, plan.fields, plan.why_probed)
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
