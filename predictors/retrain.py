"""Retraining from run logs, as users do it, with a guard against a worse default.

    result = retrain(["bundles/qwen3/runs"], out=None, make_default=False)

1. The default version in `out` (the package's models by default) is loaded, where there is one.
2. A new version is trained on what ships plus the given run logs (`learned.train`).
3. Both price the given runs (the error before and after, per hardware) and the shipped runs (per source).
4. Where the new version's median error on a shipped source is more than GUARD above the default's, it is
   written but held back: its metadata says `"default": false`, so `learned.latest` keeps choosing the previous
   default, unless `make_default`. Nothing is overwritten or deleted either way.

Errors are absolute relative errors of step time, each model pricing runs it was trained on (both saw the
shipped runs; the new one saw the given runs too): the guard asks whether the new runs pulled the trees away
from what they fitted before, source by source (a source's median can move while the pooled one, dominated by
the 1,440 single-node vTrain runs, does not).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from predictors import learned
from predictors.errors import PredictorError
from predictors.features import Dataset, load_dataset

GUARD = 0.01  # a shipped source's median error may rise by one percentage point before a version is held back


@dataclass
class Row:
    name: str  # a hardware name (the given runs) or a source (the shipped ones)
    runs: int
    before: float | None  # median absolute relative error of step time, the default version (None: none)
    after: float


@dataclass
class Retrained:
    predictor: learned.Predictor
    previous: str | None  # the default it was compared with
    new_runs: list[Row]
    shipped: list[Row]
    regressed: list[str]  # shipped sources the new version prices worse by more than GUARD
    default: bool


def errors(model: learned.Predictor, data: Dataset) -> np.ndarray:
    """|predicted - measured| / measured of each run of `data`."""
    predicted = data.cost_step * model.correction(data.X)
    return np.abs(predicted - data.measured) / data.measured


def _rows(keys: list, old: np.ndarray | None, new: np.ndarray) -> list[Row]:
    keys = np.array(keys)
    return [Row(str(k), int((keys == k).sum()), None if old is None else float(np.median(old[keys == k])),
                float(np.median(new[keys == k]))) for k in sorted(set(keys))]


def retrain(logs: list, *, out=None, shipped: list | None = None, make_default: bool = False,
            jobs: int | None = None) -> Retrained:
    """Train a new version on `shipped` (default: what ships) plus `logs`, compare it with the default in `out`,
    and hold it back where it is worse (module docstring)."""
    logs = [Path(p) for p in logs]
    if missing := [str(p) for p in logs if not p.exists()]:
        raise PredictorError(f"no such run-log file or directory: {', '.join(missing)}")
    added = load_dataset(logs)
    if not len(added):
        raise PredictorError(f"no usable runs in {', '.join(map(str, logs))}"
                             + (f" ({added.skipped[0].reason})" if added.skipped else ""))
    shipped = [Path(p) for p in (shipped or learned.default_training_paths())]
    place = Path(out) if out else learned.MODELS_DIR
    directory = place if place.suffix != ".joblib" else place.parent
    try:
        current = learned.load(directory) if directory.is_dir() and learned.versions(directory) else None
    except PredictorError:
        current = None
    new = learned.train([*shipped, *logs], out, jobs=jobs)
    base = load_dataset(shipped)
    old_shipped = errors(current, base) if current is not None else None
    shipped_rows = _rows(base.sources, old_shipped, errors(new, base))
    regressed = [r.name for r in shipped_rows if r.before is not None and r.after > r.before + GUARD]
    default = make_default or not regressed
    if not default:
        learned.set_default(new, False)
    return Retrained(new, current.label if current is not None else None,
                     _rows(added.hardware, errors(current, added) if current is not None else None, errors(new, added)),
                     shipped_rows, regressed, default)
