"""Where a model comes from: a local directory, the local HuggingFace cache, or the bundled catalogue.

Offline first: nothing is downloaded unless the caller passes ``online=True``, and then only config.json
(and remote modeling files when the user also trusts remote code). Every failure is an `OnboardError`
with one line saying what was wrong and what to do.
"""

from __future__ import annotations

import copy
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from onboard.errors import OnboardError, one_line

CATALOGUE_DIR = Path(__file__).parent / "catalogue"
MAX_CONFIG_BYTES = 16 * 2**20  # released configs are kilobytes; megabytes of JSON is not a model description
MAX_LAYERS = 4096  # released models have at most a few hundred decoder layers


@dataclass
class ModelSource:
    """A resolved model reference: its config (the causal-LM part). `onboard.twin.instantiate` builds it."""

    ref: str
    kind: str  # "catalogue" | "local" | "hf-cache" | "hub"
    name: str
    path: Path
    raw: dict
    config: object
    trust_remote_code: bool = False
    published: dict = field(default_factory=dict)

    @property
    def model_type(self) -> str:
        return self.config.model_type


def catalogue_index() -> dict:
    """The bundled catalogue: slug -> metadata (hf_id, config source, published totals)."""
    index_path = CATALOGUE_DIR / "catalogue.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else {}
    for entry in sorted(p for p in CATALOGUE_DIR.iterdir() if (p / "config.json").exists()):
        index.setdefault(entry.name, {})
    return dict(sorted(index.items()))


def catalogue_slug(ref: str) -> str | None:
    """The catalogue entry `ref` names (its slug or its HuggingFace id, any case), or None."""
    wanted = ref.strip().lower()
    for slug, meta in catalogue_index().items():
        if wanted == slug.lower() or wanted == str(meta.get("hf_id", "")).lower():
            return slug
    return None


def _hf_cache_dir(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # malformed repo ids are simply "not cached"
        return None
    return Path(found).parent if isinstance(found, str) else None


def _hub_download(repo_id: str, trust_remote_code: bool) -> Path:
    try:
        from huggingface_hub import hf_hub_download, snapshot_download

        if trust_remote_code:
            return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.py"]))
        return Path(hf_hub_download(repo_id, "config.json")).parent
    except Exception as exc:
        raise OnboardError(f"could not download the config of '{repo_id}': {one_line(exc)}") from exc


def _read_config_json(path: Path) -> dict:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise OnboardError(f"{path} has no config.json: point MODEL at a model directory")
    size = cfg_path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise OnboardError(f"{cfg_path} is {size / 2**20:.0f} MiB; a model config is at most "
                           f"{MAX_CONFIG_BYTES // 2**20} MiB")
    try:
        raw = json.loads(cfg_path.read_text(), object_hook=_special_floats)
    except json.JSONDecodeError as exc:
        raise OnboardError(
            f"{cfg_path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    except RecursionError:
        raise OnboardError(f"{cfg_path} is nested too deeply to be a model config") from None
    except ValueError as exc:
        raise OnboardError(f"{cfg_path}: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise OnboardError(f"cannot read {cfg_path}: {one_line(exc)}") from None
    if not isinstance(raw, dict):
        raise OnboardError(f"{cfg_path} must hold a JSON object, not {type(raw).__name__}")
    if not raw.get("model_type"):
        raise OnboardError(f"{cfg_path} has no model_type: cannot tell which architecture it describes")
    if not isinstance(raw["model_type"], str):
        raise OnboardError(f"{cfg_path}: model_type must be a string, got {type(raw['model_type']).__name__}")
    return raw


def _special_floats(obj: dict):
    """transformers' `save_pretrained` writes inf / nan as {"__float__": "Infinity"}: read them back as it does."""
    if set(obj) == {"__float__"}:
        try:
            return float(obj["__float__"])
        except (TypeError, ValueError):
            raise ValueError(f"{obj!r} is not a float transformers wrote") from None
    return obj


# config fields read as hints to check a config's arithmetic (the names transformers' families use)
_POSITIVE = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_topk")


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _global(config, attr: str):
    """A config's model-wide value of `attr`, or None: transformers 5.24 refuses to read one that a per-layer
    config may override (AmbiguousGlobalPerLayerAttributeError); such a field is checked per layer by the model's
    own validators."""
    try:
        return getattr(config, attr, None)
    except Exception:  # noqa: BLE001 - any refusal to give one value for the whole model
        return None


def check_semantics(config, name: str) -> None:
    """Refuse, in one line naming the field, a config whose sizes cannot describe a decoder language model:
    sizes that are not positive, more layers than any model has, query heads that key/value heads do not
    divide, more experts per token than experts, an encoder or an encoder-decoder."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    if getattr(config, "is_encoder_decoder", False):
        raise OnboardError(f"{name}: '{config.model_type}' is an encoder-decoder model; onboard handles decoder "
                           f"language models")
    if config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
        raise OnboardError(f"{name}: '{config.model_type}' is an encoder (a masked language model), not a decoder "
                           f"language model")
    for attr in _POSITIVE:
        value = _global(config, attr)
        if value is not None and _whole(value) and value < 1:
            raise OnboardError(f"{name}: {attr} is {value}; it must be at least 1")
    layers = _global(config, "num_hidden_layers")
    if _whole(layers) and layers > MAX_LAYERS:
        raise OnboardError(f"{name}: num_hidden_layers is {layers}; onboard takes models of at most {MAX_LAYERS} "
                           f"layers")
    heads, kv = _global(config, "num_attention_heads"), _global(config, "num_key_value_heads")
    if _whole(heads) and _whole(kv) and (kv < 1 or heads % kv):
        raise OnboardError(f"{name}: num_key_value_heads {kv} must divide num_attention_heads {heads}")
    experts = next((v for f in _EXPERTS if _whole(v := _global(config, f)) and v > 0), None)
    top_k = next((v for f in _TOP_K if _whole(v := _global(config, f))), None)
    if experts is not None and top_k is not None and not 1 <= top_k <= experts:
        raise OnboardError(f"{name}: {top_k} experts per token, and the model has {experts} experts")


def _is_native(model_type: str) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return model_type in CONFIG_MAPPING_NAMES


def _causal_lm_config(config, name: str, trust_remote_code: bool):
    """The config that a causal-LM head is built from: the config itself or its text part."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    def has_head(cfg) -> bool:
        if cfg.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            return True
        return trust_remote_code and "AutoModelForCausalLM" in (getattr(cfg, "auto_map", None) or {})

    if has_head(config):
        return config
    text = getattr(config, "text_config", None)
    if text is not None and has_head(text):
        return text
    raise OnboardError(
        f"{name}: model_type '{config.model_type}' has no causal-LM head in transformers "
        "(onboard handles decoder language models)"
    )


_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _check_auto_map(path: Path, auto_map, name: str) -> None:
    """Remote code runs only from the model's own folder, the one the user reviewed: every auto_map entry must
    name `module.Class` with module a file in that folder (transformers' `other/repo--module.Class` form, which
    loads code from elsewhere, is refused)."""
    if not isinstance(auto_map, dict):
        raise OnboardError(f"{name}: config.json's auto_map must be an object, got {type(auto_map).__name__}")
    for key, value in auto_map.items():
        for ref in value if isinstance(value, list) else [value]:
            if ref is None:
                continue
            module, _, cls = ref.rpartition(".") if isinstance(ref, str) else ("", "", "")
            if "--" in str(ref) or not _MODULE.fullmatch(module or "-") or not cls.isidentifier():
                raise OnboardError(f"{name}: auto_map {key} = {ref!r} names code outside the model's own folder; "
                                   f"onboard runs only modeling code that sits in {path}")
            if not (path / (module.replace(".", "/") + ".py")).is_file():
                raise OnboardError(f"{name}: auto_map {key} names {module}.py, which is not in {path}")


def _load_config(path: Path, raw: dict, name: str, trust_remote_code: bool):
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = raw["model_type"]
    native = model_type in CONFIG_MAPPING_NAMES
    remote = "AutoConfig" in (raw.get("auto_map") or {})
    if not native and not remote:
        raise OnboardError(
            f"{name}: unknown model_type '{model_type}': transformers has no such model "
            "and config.json has no auto_map to its own code"
        )
    if not native and not trust_remote_code:
        raise OnboardError(
            f"{name} runs its own modeling code (auto_map in config.json); review it, then pass --trust-remote-code"
        )
    if not native:
        _check_auto_map(path, raw.get("auto_map"), name)
    try:  # transformers' own reading of config.json (its encodings included), offline, from this folder only
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=not native, local_files_only=True)
        if hasattr(config, "quantization_config"):  # random fp32 twins are never quantised
            del config.quantization_config
    except Exception as exc:
        raise OnboardError(
            f"{name}: config.json does not describe a valid '{model_type}' model: {one_line(exc)}") from None
    config._name_or_path = str(path)
    return config


def resolve(ref: str, *, trust_remote_code: bool = False, online: bool = False) -> ModelSource:
    """Turn MODEL (directory, HF id, or catalogue name) into a `ModelSource`."""
    if not ref or not ref.strip():
        raise OnboardError("MODEL is empty: give a directory, a HuggingFace id or a catalogue name")
    path = Path(os.path.expanduser(ref))
    looks_like_path = ref.startswith((".", "/", "~")) or os.sep in ref and path.exists()
    published: dict = {}
    if path.is_dir():
        kind, name = "local", path.name
    elif path.exists():
        raise OnboardError(f"{ref} is a file: MODEL must be a directory holding config.json")
    elif looks_like_path:
        raise OnboardError(f"{ref}: no such directory")
    elif (slug := catalogue_slug(ref)) is not None:
        kind, name, path = "catalogue", slug, CATALOGUE_DIR / slug
        published = catalogue_index()[slug].get("published", {})
        # the catalogue's own remote code ships with (and is reviewed in) onboard; native types use transformers
        trust_remote_code = not _is_native(_read_config_json(path)["model_type"])
    elif (cached := _hf_cache_dir(ref)) is not None:
        kind, name, path = "hf-cache", ref, cached
    elif online:
        kind, name, path = "hub", ref, _hub_download(ref, trust_remote_code)
    else:
        raise OnboardError(
            f"model '{ref}' not found offline: not a directory, not in the catalogue (see `onboard catalogue`), "
            "not in the HuggingFace cache; pass a local directory, or --online to fetch its config"
        )
    raw = _read_config_json(path)
    config = _load_config(path, raw, name, trust_remote_code)
    config = _causal_lm_config(config, name, trust_remote_code)
    check_semantics(config, name)
    return ModelSource(
        ref=ref, kind=kind, name=name, path=path, raw=raw, config=config,
        trust_remote_code=trust_remote_code, published=published,
    )


def clone_config(config, **overrides):
    """A deep copy of a config with attributes overridden (the same class, remote code included)."""
    new = copy.deepcopy(config)
    for key, value in overrides.items():
        setattr(new, key, value)
    return new


def from_config(config, name: str | None = None, *, trust_remote_code: bool = False) -> ModelSource:
    """A source for an in-memory config (tests and families discovered from transformers itself)."""
    name = name or config.model_type
    config = _causal_lm_config(config, name, trust_remote_code)
    return ModelSource(
        ref=name, kind="config", name=name, path=Path(getattr(config, "_name_or_path", "") or "."),
        raw=config.to_dict(), config=config, trust_remote_code=trust_remote_code,
    )
