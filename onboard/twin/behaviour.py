"""Which config fields drive which parts of a model, read from the model itself: change one field, build the
model on the meta device (no memory, no weights), and watch which parameter shapes move.

A new vendor's config may name its sizes in words of its own (`lexicon_size`, `breadth`, `strata`,
`specialists`). Field names are hints (`onboard.twin.meanings`); when the hints are missing, unknown or
lying, behaviour decides. For a field of value v, set to v' (half, else double; a value that looks like a
layer count also cuts the per-layer lists), the model is rebuilt and compared with the unchanged one:

    the decoder stack is now v' layers long                           -> LAYERS
    the input embedding table has other rows                           -> VOCAB
    the input embedding table has another width                        -> HIDDEN
    an expert count moved from v to v' (the leading dim of E-way 3-D
    weight stacks, or the length of a list of sub-modules in a layer)  -> EXPERTS
    any other parameter shape moved                                    -> WIDTH
    no parameter shape moved                                           -> INERT
    the model builds at neither value                                  -> TIED

The first that applies wins, in that order. Only parameter shapes are compared, so a field that changes
what the model computes without sizing any parameter (a top-k, a window, a position limit, a flag) is
INERT here, and a TIED field is bound to others (by a validator, or by a product such as heads x head
size = width) so that it cannot change alone.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

from torch import nn

from onboard.twin.fields import get, is_size, per_layer_lists, put, truncate_layers, walk
from runtime import model_tree

LAYERS, VOCAB, HIDDEN, EXPERTS, WIDTH, INERT, TIED = "layers", "vocab", "hidden", "experts", "width", "inert", "tied"

# config bookkeeping that never sizes a model: label maps, special token ids, private fields
_NOT_SIZES = ("id2label", "label2id")


@dataclass(frozen=True)
class Footprint:
    """What a model's parameters look like: enough to tell which of them a config field sized."""

    shapes: dict  # parameter path -> shape
    lists: dict  # path of every list of sub-modules -> its length
    stack: str  # path of the decoder layer stack (one of `lists`)
    embedding: tuple  # the input embedding table's shape (rows, width), () without one


def footprint(model: nn.Module) -> Footprint:
    stack, _ = model_tree.find_layer_stack(model)
    table = getattr(model.get_input_embeddings(), "weight", None)
    return Footprint(
        shapes={name: tuple(p.shape) for name, p in model.named_parameters()},
        lists={name: len(m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList)},
        stack=stack, embedding=tuple(table.shape) if table is not None else ())


def drives(before: Footprint, after: Footprint, old: int, new: int) -> str:
    """What a field sizes, from the model at its old value and at its new one (the table in the docstring)."""
    if before.lists.get(before.stack) == old and after.lists.get(before.stack) == new:
        return LAYERS
    if before.embedding[:1] != after.embedding[:1]:
        return VOCAB
    if before.embedding[1:] != after.embedding[1:]:
        return HIDDEN
    if _expert_count_moved(before, after, old, new):
        return EXPERTS
    if before.shapes != after.shapes:
        return WIDTH
    return INERT


def _expert_count_moved(before: Footprint, after: Footprint, old: int, new: int) -> bool:
    """E-way stacks (E, a, b) with a, b > 1 (not a depthwise conv's (C, 1, K)) whose E went old -> new, or a
    list of sub-modules below the stack (one module per expert) whose length did."""
    for path, shape in before.shapes.items():
        moved = after.shapes.get(path)
        if (len(shape) == 3 and min(shape[1:]) > 1 and shape[0] == old and moved is not None
                and moved == (new, *shape[1:])):
            return True
    return any(path != before.stack and n == old and after.lists.get(path) == new
               for path, n in before.lists.items())


def candidates(cfg: dict) -> list[str]:
    """Paths of the fields that could size a model: positive whole numbers, not label maps or token ids."""
    return [path for path, key, value in walk(cfg)
            if is_size(value) and not path.startswith(_NOT_SIZES) and not key.startswith("_")
            and not key.endswith(("token_id", "token_ids"))]


def _variants(cfg: dict, path: str, value: int):
    """(config, new value) to try, in order: half, half with per-layer lists cut to match, double."""
    if value >= 2:
        half = copy.deepcopy(cfg)
        put(half, path, value // 2)
        yield half, value // 2
        if per_layer_lists(cfg, value):  # a layer count whose lists a validator checks against it
            cut = copy.deepcopy(cfg)
            truncate_layers(cut, path, value, value // 2)
            yield cut, value // 2
    double = copy.deepcopy(cfg)
    put(double, path, value * 2)
    yield double, value * 2


def probe_fields(build: Callable[[dict], nn.Module], cfg: dict, paths: list[str]) -> dict[str, str]:
    """{path: what the field drives} for each field at `paths` of `cfg` (see the module docstring).
    `build(cfg)` returns the model for a config dict, on the meta device, or raises."""
    before = footprint(build(cfg))
    found = {}
    for path in paths:
        value = get(cfg, path)
        found[path] = TIED
        for variant, new in _variants(cfg, path, value):
            try:
                after = footprint(build(variant))
            except Exception:  # noqa: BLE001 - model code we do not own refuses this value: try the next
                continue
            found[path] = drives(before, after, value, new)
            break
    return found
