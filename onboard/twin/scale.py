"""A trained model's config at the size the user asks, and the way back: numbers of the full-scale ModelSpec read
from the fields of a smaller config that hold them. Both go by what each field means (`onboard.twin.meanings`,
or what the twin found a field drives where its name says nothing)."""

from __future__ import annotations

from onboard.twin.fields import get, has, per_layer_meaning, put, walk
from onboard.twin.meanings import WIDENED, meaning_of
from onboard.twin.shrink import Shrink


def widen(cfg: dict, changes: list[Shrink], width: int) -> list[Shrink]:
    """Make `cfg` `width` times wider in place (more heads of the same size, wider MLPs); the fields changed."""
    found = {s.path: s.meaning for s in changes}  # meanings found by behaviour where the names had none
    wider = []
    for path, key, value in list(walk(cfg)):
        if (found.get(path, meaning_of(key)) in WIDENED and isinstance(value, int) and not isinstance(value, bool)
                and value > 0):
            put(cfg, path, value * width)
            wider.append(Shrink(path, found.get(path, meaning_of(key)), value, value * width, f"--width {width}"))
        elif (meaning := per_layer_meaning(key, value)) in WIDENED:  # each layer's own head count grows too
            put(cfg, path, [v * width for v in value])
            wider.append(Shrink(path, meaning, value, get(cfg, path), f"--width {width}"))
    return wider


class FullFields:
    """Where a full-size config (`full`) holds each number, read again in a smaller config of the same model
    (`cfg`). Fields of no known name count too where the twin shrank them by what they were seen to drive
    (`found`), after every named one."""

    def __init__(self, full: dict, cfg: dict, found: list[Shrink] | None = None):
        self.cfg = cfg
        self.sizes = [(path, key, value) for path, key, value in walk(full) if meaning_of(key) and isinstance(value, int)]
        self.found = [f for f in found or () if f.meaning != "layers"]

    def read(self, value, meanings) -> tuple[bool, object]:
        """(whether a full-scale field holds `value`, the smaller config's value of the likeliest one: the first of
        `meanings`, then any other)."""
        rank = {meaning: i for i, meaning in enumerate(meanings)}
        holders = [(rank.get(meaning_of(key), len(rank)), path) for path, key, v in self.sizes if v == value]
        holders += [(len(rank) + 1, f.path) for f in self.found if f.full == value]
        holders = [(r, path) for r, path in holders if has(self.cfg, path)]  # a layer cut away holds nothing
        return bool(holders), get(self.cfg, min(holders)[1]) if holders else None
