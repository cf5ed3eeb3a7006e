"""Tiny twin: the same architecture as a full-size config, with small dimensions and random fp32 weights.

`Twin.build(source)` is the one way in. The twin's config (`onboard.twin.config`) is shrunk by what its fields
mean: by their names where the names are known (`onboard.twin.meanings`, matched at any depth of nested dicts
such as ``linear_attn_config``), by what each field is seen to drive in the model where they are not
(`onboard.twin.behaviour`), never by ``model_type``. It keeps every distinctive feature: each layer kind and its
interleaving, shared experts, dense-first layers, grouped routing, low ranks, and windows / index top-k smaller
than the test sequence so sparsity is exercised.

Layers are not guessed from field names either (`onboard.twin.layers`): the model is built on the meta device at
twin width with its full depth, each decoder layer gets a structural signature, and the twin keeps the shortest
prefix of layers that holds every distinct signature. Then it is built for real and run forward and backward.
What the pipeline needs to know of the twin (its vocabulary, its width) is read from its modules.

`Twin.build(source, layers=N, width=W)` is the model a user trains at a size of their own: the first N layers at
twin width (the twin's own prefix when N is not given), W times wider. `Twin.changes` records every field either
changed, from what, to what, and why.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from onboard.errors import OnboardError, one_line
from onboard.source import ModelSource
from onboard.twin import layers as depth
from onboard.twin.config import TwinConfig, as_is, build_meta, make_config, twin_config
from onboard.twin.fields import get, per_layer_lists, truncate_layers
from onboard.twin.scale import widen
from onboard.twin.shrink import Shrink

TEST_SEQ_LEN = 32
TEST_BATCH = 2


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

    @classmethod
    def build(cls, source: ModelSource, *, layers: int | None = None, width: int = 1, check: bool = True) -> Twin:
        """The tiny twin of `source`; with `layers` / `width`, its first `layers` layers at twin width (the twin's
        own prefix when not given), `width` times wider. `check`: run forward and backward once, and fall back
        to the model as it is where a twin shrunk by behaviour does not run and the model is small."""
        if width < 1 or (layers is not None and layers < 1):
            raise OnboardError("--layers and --width must be at least 1")
        plan = twin_config(source)
        if layers is None and width == 1:
            return _shrunk_or_as_is(source, plan, check)
        return _scaled(source, plan, layers, width, check)

    @property
    def changes(self) -> list[Shrink]:
        return self.shrinks

    def full_value(self, meaning: str, twin_value):
        """Map a number observed in the twin back to full scale, through the fields the twin shrank: those
        with this meaning, else a field behaviour found sizing the model (each has a twin value of its own)."""
        for wanted in (meaning, "width"):
            for s in self.shrinks:
                if s.meaning == wanted and s.twin == twin_value:
                    return s.full
        return twin_value

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
        ids = torch.randint(3, self.vocab_size, (TEST_BATCH, seq_len), generator=gen)
        return {"input_ids": ids, "labels": ids.clone()}


def _build_real(source: ModelSource, cfg: dict) -> nn.Module:
    torch.manual_seed(0)
    model = source.build(make_config(source, cfg), experts_implementation="grouped_mm")
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
