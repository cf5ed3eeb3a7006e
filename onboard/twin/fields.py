"""Nested config dicts (a HuggingFace config's `to_dict()`): fields by dotted path, the layer count, and the
per-layer lists that follow it when a model is cut to its first layers."""

from __future__ import annotations

from onboard.twin.meanings import meaning_of


def walk(d: dict, prefix: str = ""):
    """(dotted path, key, value) of every leaf, depth first."""
    for key, value in d.items():
        key = str(key)
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from walk(value, path + ".")
        else:
            yield path, key, value


def get(d: dict, path: str):
    """The value at a dotted path."""
    for part in path.split("."):
        d = d[part]
    return d


def put(d: dict, path: str, value) -> None:
    """Set the value at a dotted path (its parents exist)."""
    parts = path.split(".")
    for part in parts[:-1]:
        d = d[part]
    d[parts[-1]] = value


def is_size(value) -> bool:
    """A positive whole number (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def is_index_list(key: str, value) -> bool:
    """Lists of layer indices (``moe_layers``, ``kda_layers``), as opposed to one value per layer."""
    return (
        "layer" in key and isinstance(value, list) and len(value) > 0
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        and all(a < b for a, b in zip(value, value[1:]))
    )


PER_LAYER_SUFFIX = "_per_layer"


def per_layer_meaning(key: str, value) -> str | None:
    """The meaning of each entry of a list that overrides a field layer by layer (Laguna's
    ``num_attention_heads_per_layer``: one head count per layer), or None for any other field."""
    if not (key.endswith(PER_LAYER_SUFFIX) and isinstance(value, list) and value and all(map(is_size, value))):
        return None
    return meaning_of(key[: -len(PER_LAYER_SUFFIX)])


def per_layer_lists(cfg: dict, num_layers: int) -> list[str]:
    """Paths of the lists that hold one value per layer."""
    return [
        path for path, key, value in walk(cfg)
        if isinstance(value, list) and len(value) == num_layers and not is_index_list(key, value)
    ]


def has(d: dict, path: str) -> bool:
    """Whether a dotted path leads to a value."""
    for part in path.split("."):
        if not isinstance(d, dict) or part not in d:
            return False
        d = d[part]
    return True


def layer_keyed(d: dict, full_layers: int) -> bool:
    """Whether a config dict is keyed by layer index: a dict of fields for each layer it overrides (Dots3's
    ``per_layer_config``: {"02": {...}, "03": {...}}), as opposed to a dict of named fields or a table keyed by
    other numbers (``id2label``: {"0": "LABEL_0", ...})."""
    return bool(d) and all(str(k).isdigit() and int(k) < full_layers and isinstance(v, dict) for k, v in d.items())


def _dicts(d: dict):
    """Every dict nested in `d`, below it."""
    for value in d.values():
        if isinstance(value, dict):
            yield value
            yield from _dicts(value)


def truncate_layers(cfg: dict, layers_key: str, full_layers: int, keep: int) -> None:
    """Cut the config to its first `keep` layers: the layer count, per-layer lists, layer-index lists and the
    entries of dicts keyed by layer index."""
    for d in [d for d in _dicts(cfg) if layer_keyed(d, full_layers)]:
        for k in [k for k in d if int(k) >= keep]:
            del d[k]
    for path, key, value in list(walk(cfg)):
        if is_index_list(key, value):
            one_based = max(value) == full_layers
            put(cfg, path, [v for v in value if v < keep or (one_based and v == keep)])
        elif isinstance(value, list) and len(value) == full_layers:
            put(cfg, path, value[:keep])
    put(cfg, layers_key, keep)


def layers_key(cfg: dict, within: str = "") -> str | None:
    """The path of the layer count (num_hidden_layers and its other names), or None; the first under `within`
    (a dotted prefix: where the causal LM's own config sits, `lm_prefix`) when there is one there. A multimodal
    config holds its vision tower's count too, which may come first (Llama 4's)."""
    found = [path for path, key, value in walk(cfg)
             if key in ("num_hidden_layers", "num_layers", "n_layer", "n_layers") and is_size(value)]
    return next((path for path in found if path.startswith(within)), found[0] if found else None)


def lm_prefix(config) -> str:
    """Where the causal LM's config sits inside `config` (a transformers config): "" when it is the config itself,
    else its field's name and a dot (Llama 4's "text_config."), as transformers' `get_text_config` finds it."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return next((f"{name}." for name, value in vars(config).items() if value is text and text is not config), "")


def sizes_by_meaning(cfg: dict) -> dict[str, list[tuple[str, int]]]:
    """The integer fields of a config dict whose names have a meaning: {meaning: [(path, value), ...]}."""
    sizes: dict[str, list[tuple[str, int]]] = {}
    for path, key, value in walk(cfg):
        meaning = meaning_of(key)
        if meaning and isinstance(value, int) and not isinstance(value, bool):
            sizes.setdefault(meaning, []).append((path, value))
    return sizes
