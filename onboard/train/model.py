"""The model `runtime.train` trains: a bundle's adapted model (its twin, scaled, or the released model on the meta
device), the run log's record of it, and what tensor parallelism may split. `build_model` is the factory every rank
calls (`onboard.train:build_model`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from onboard.bundle.files import bundle_source, load_adapter, read_bundle
from onboard.errors import OnboardError, one_line
from onboard.train.record import trained_record
from onboard.twin import Twin, instantiate


def train_config(bundle, *, layers: int | None = None, width: int = 1, trust_remote_code: bool = False) -> dict:
    """The config the loop trains: the bundle's tiny twin, or its first `layers` layers at twin width,
    `width` times wider (more heads of the same size, wider MLPs)."""
    bundle, _, origin = read_bundle(bundle)
    twin = Twin.build(bundle_source(origin, trust_remote_code), layers=layers, width=width, check=False)
    return twin.config.to_dict()


def build_model(bundle, layers: int | None = None, width: int = 1, config: str | None = None,
                trust_remote_code: bool = False, weights: str | None = None):
    """Model factory for `runtime.train`: the adapted model and its run-log record.

    `config` is a JSON file written by `train_config` (the launcher computes it once for every rank).
    `weights` (a model directory with safetensors shards, as `weights_source` resolved it): the model of that
    directory's config, built on the meta device and adapted, with what the loop needs to read its weights
    once it is parallelised (`runtime.train.weights.Pretrained`).
    """
    from onboard.twin.build import twin_config

    if weights is not None:
        return _pretrained_model(bundle, weights, trust_remote_code)
    bundle, spec, origin = read_bundle(bundle)
    cfg = json.loads(Path(config).read_text()) if config else train_config(
        bundle, layers=layers, width=width, trust_remote_code=trust_remote_code)
    source = bundle_source(origin, trust_remote_code)
    full = config_of_type(source, cfg)
    try:
        model_config = type(full).from_dict(cfg)
    except Exception as exc:  # noqa: BLE001 - config validators we do not own
        raise OnboardError(f"{bundle}: the training config is invalid: {one_line(exc)}") from None
    model = instantiate(source, model_config, experts_implementation="grouped_mm")
    load_adapter(bundle).adapt(model)
    twin = twin_config(source)  # the fields the twin shrank by what they drive, where names fell short
    record = trained_record(spec, full.to_dict(), cfg, model, twin.shrinks if twin.why_probed else [])
    declare_parallel(model, spec, full.to_dict(), cfg)
    return model, record


def config_of_type(source, cfg: dict):
    """The source's full-scale config of the trained config's type: the config itself, or its text part where the
    twin is the text model of a multimodal config (Llama 4: a `llama4` config whose causal LM is built from its
    `llama4_text` part). Reading the trained dict as the outer type would fill the text part with full-scale
    defaults."""
    outer = source.config
    text = outer.get_text_config() if hasattr(outer, "get_text_config") else outer
    return next((c for c in (outer, text) if c.model_type == cfg.get("model_type")), outer)


def declare_parallel(model: torch.nn.Module, spec: dict, full: dict, cfg: dict) -> None:
    """What `runtime.parallel` needs to know of the adapted `model` from its spec: which modules tensor parallelism
    may split (`declare_tensor_parallel`) and the chunk of each chunked-attention layer, which context parallelism
    computes its masks from (the trained config's, read as the run log's are)."""
    from runtime.parallel.context_split import declare_chunks

    declare_tensor_parallel(model, spec, full, cfg)
    for _, paths, _, mixer in _attention_by_kind(model, spec, full, cfg, ("chunked",)):
        if mixer.get("window"):
            declare_chunks(model, {path: mixer["window"] for path in paths})


def _kept_layers(model: torch.nn.Module, spec: dict) -> list[tuple[int, dict]]:
    """(index, spec layer) of the layers the model has (a prefix of the spec's when it trains fewer)."""
    return list(enumerate(spec.get("layers", [])))[:len(model.get_submodule(spec["layers_path"]))]


def _attention_by_kind(model: torch.nn.Module, spec: dict, full: dict, cfg: dict, kinds) -> list:
    """For each attention kind among `kinds` the model's layers hold: (kind, the attention modules' paths, the run
    log's record of those layers alone, read back from the trained config `cfg` as `trained_record` reads it, and
    its mixer of that kind, {} when it has none)."""
    prefix, out = spec["layers_path"], []
    kept = [(i, layer) for i, layer in _kept_layers(model, spec) if (layer.get("attention") or {}).get("kind") in kinds]
    for kind in sorted({layer["attention"]["kind"] for _, layer in kept}):
        layers = [(i, layer) for i, layer in kept if layer["attention"]["kind"] == kind]
        record = trained_record({**spec, "layers": [layer for _, layer in layers]}, full, cfg, model)
        mixer = next((m for m in record.get("mixers") or [] if m.get("kind") == kind), {})
        out.append((kind, [f"{prefix}.{i}.{layer['attention']['path']}" for i, layer in layers], record, mixer))
    return out


def _key_heads(cfg: dict) -> int | None:
    """Linear attention's key heads where the config gives them apart from its value heads (Gated DeltaNet: each
    key head serves a group of value heads, as a key/value head serves query heads), else None."""
    from onboard.twin.fields import sizes_by_meaning

    return next((v for _, v in sizes_by_meaning(cfg).get("linear_k_heads", []) if v > 0), None)


def declare_tensor_parallel(model: torch.nn.Module, spec: dict, full: dict, cfg: dict) -> None:
    """Tell `runtime.parallel` which modules of the adapted `model` tensor parallelism may split: the spec's
    attention layers of the kinds it splits and dense MLPs, in the layers the model has, and every layer's attention
    and MLP (the blocks sequence parallelism gathers the sequence for). Head counts are the trained config's (`cfg`),
    read from the fields that hold the spec's at full scale (`full`), as the run log's are, for each attention kind
    apart (a hybrid's KDA and MLA layers have their own). The runtime adds the shared experts of its MoE blocks
    itself."""
    from runtime.parallel.runnable import TP_ATTENTION
    from runtime.parallel.tensor import Heads, declare

    prefix = spec["layers_path"]
    kept = _kept_layers(model, spec)
    attention = {}
    for kind, paths, record, mixer in _attention_by_kind(model, spec, full, cfg, TP_ATTENTION):
        heads = mixer.get("heads") or record.get("heads")
        kv_heads = (_key_heads(cfg) if kind.startswith("linear:") else record.get("kv_heads")) or heads
        if heads:
            attention.update({path: Heads(heads, kv_heads) for path in paths})
    mlps = [f"{prefix}.{i}.{layer['mlp']['path']}" for i, layer in kept
            if (layer.get("mlp") or {}).get("kind") == "dense" and layer["mlp"].get("path")]
    blocks = [f"{prefix}.{i}.{part['path']}" for i, layer in kept
              for part in (layer.get("attention") or {}, layer.get("mlp") or {}) if part.get("path")]
    declare(model, attention=attention, mlps=mlps, blocks=blocks)


def weights_source(bundle, model: str, *, online: bool = False, trust_remote_code: bool = False):
    """The model directory `--weights MODEL` names (a local directory, the HuggingFace cache, or the Hub with
    `online`), checked against the bundle: same model type, safetensors present."""
    from onboard.source import resolve

    bundle, _, origin = read_bundle(bundle)
    source = resolve(model, online=online, trust_remote_code=trust_remote_code)
    if source.path is None or not any(Path(source.path).glob("*.safetensors")):
        raise OnboardError(f"{model}: no *.safetensors weights in {source.path or 'it (a config only)'}")
    ours = bundle_source(origin, trust_remote_code).config.model_type
    if source.config.model_type != ours:
        raise OnboardError(f"{model}: a {source.config.model_type} model; the bundle {bundle} adapts {ours}")
    return source


def _pretrained_model(bundle, weights: str, trust_remote_code: bool):
    """(model on the meta device, adapted; run-log record; Pretrained) for `build_model(weights=...)`."""
    from onboard.source import resolve
    from runtime.train.weights import Pretrained

    bundle, spec, _ = read_bundle(bundle)
    source = resolve(weights, trust_remote_code=trust_remote_code)
    model = instantiate(source, device="meta", experts_implementation="grouped_mm")
    try:
        pretrained = Pretrained.prepare(model, source.path, load_adapter(bundle).adapt)
    except ValueError as exc:
        raise OnboardError(str(exc)) from None
    cfg = source.config.to_dict()
    record = trained_record(spec, cfg, cfg, model)
    declare_parallel(model, spec, cfg, cfg)
    return model, record, pretrained
