"""The learned throughput predictor: gradient-boosted trees on cost-model features.

Target: log(measured step time / cost-model step time), so the trees learn where the analytical model is
wrong rather than the whole answer, and a model never seen in training still gets the cost model's
physics. Each source carries equal total weight, so the 1,440 single-node vTrain rows do not drown
the multi-node ones.

The correction knows its reach. Trees say nothing useful about a run unlike every training run, so the
log-correction is multiplied by

    w(x) = exp(-(d(x) / (REACH * r))^2)

where d(x) is the distance from x to the nearest training run in standardised feature space and r the 90th
percentile of the training runs' own nearest-neighbour distances: a run among the training runs keeps the
whole correction, one far from all of them gets the cost model's answer. Held out a whole source at a time,
this keeps the learned median at or below the cost model's on every source (README).

From v11 what a far run falls back to is its regime's typical correction rather than none (`Fallback`): the cost
model is calibrated on dense runs, where that is about 1, and is too fast on MoE runs of every source that has them
(Megatron-Core's grouped GEMMs, routing and exchanges take more than their physics says), so a far MoE run takes
the correction MoE runs of the other sources needed (from v13 the least of them, `Fallback.fit`):

    log multiplier(x) = w(x) * trees(x) + (1 - w(x)) * fallback[regime(x)]

Saved as `throughput-vN.joblib` (the scikit-learn estimator) with `throughput-vN.json` beside it (version,
training files with their digests, row counts per source, skipped lines, scikit-learn version, and the
model file's sha256, which loading checks) and, from v6, `throughput-vN.reach.npz` (the standardised training
runs, sha256 in the JSON) and, from v8, the calibration of its interval (`Interval`: every prediction comes with
one), and from v11 its `Fallback` and the MoE features (`predictors.features`: a version predicts from the features
it was trained on), and from v14 its trees as arrays (`throughput-vN.trees.npz`, sha256 in the JSON;
`predictors.trees`), which is what predicts: a version with them loads without scikit-learn or unpickling. Training
writes the next free version; nothing is ever overwritten or deleted. joblib files are pickles: load only files you
or this package wrote.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import re
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING, Callable

import numpy as np
from threadpoolctl import threadpool_limits

from predictors import binning, workers
from predictors.costmodel import Estimate, estimate
from predictors.errors import PredictorError
from predictors.features import FEATURES, RENAMED, Dataset, features, load_dataset
from predictors.hardware import Hardware
from predictors.trees import Trees
from runtime import bounded
from runtime.dims import Dims
from runtime.plan import Plan

if TYPE_CHECKING:  # scikit-learn is imported where a model is fitted or unpickled, never to predict (Trees)
    from sklearn.ensemble import HistGradientBoostingRegressor

MODELS_DIR = Path(__file__).parent / "models"
DATA_DIR = Path(__file__).parent / "data"
STEM = "throughput"
FORMAT = 1
# Trees cannot extrapolate sensibly; on a model or chip unlike the training runs the cost model keeps
# the last word beyond this factor. 8x because the small single-node vTrain GPTs run up to ~8x slower
# than the cost model says (launch and framework overheads it does not model); 4x cost them 2 points.
MAX_CORRECTION = 8.0
# In units of the training runs' 90th-percentile nearest-neighbour distance (module docstring). 0.5 since v10: with
# host dispatch in the cost model the single-node vTrain GPTs no longer need a large correction, and at 4 the other
# sources' correction reached them held out and made them worse than the cost model. Held out a source at a time, 1
# and 0.75 still price one source a few hundredths of a point worse than the cost model, 0.5 none; held out a model
# at a time, the overall median is 8.0% at 0.5 against 6.7% at 1 (README). Versions before v10 keep the 4 their
# metadata records.
REACH = 0.5
OLD_REACH = 4.0  # what versions whose metadata records no factor were trained with


@dataclass
class Reach:
    """The training runs in standardised feature space, and the weight each new run gives the correction."""
    mean: np.ndarray
    scale: np.ndarray
    points: np.ndarray
    radius: float
    factor: float  # distances are in units of factor x radius; REACH for a new fit, the version's own when loaded

    @classmethod
    def fit(cls, X: np.ndarray, factor: float | None = None) -> Reach:
        mean, scale = X.mean(0), X.std(0) + 1e-9
        points = (X - mean) / scale
        own = _nearest(points, points, skip_self=True)
        return cls(mean, scale, points, float(np.quantile(own, 0.9)) or 1.0, REACH if factor is None else factor)

    def distance(self, X: np.ndarray) -> np.ndarray:
        """Distance to the nearest training run, in units of factor x radius (1: where the weight is 1/e)."""
        d = _nearest((np.asarray(X, dtype=float) - self.mean) / self.scale, self.points)
        return d / (self.factor * self.radius)

    def weight(self, X: np.ndarray) -> np.ndarray:
        return np.exp(-self.distance(X) ** 2)


def _nearest(queries: np.ndarray, points: np.ndarray, *, skip_self: bool = False) -> np.ndarray:
    """Distance from each query to its nearest point (to its nearest other point when queries are the points)."""
    out = np.empty(len(queries))
    for start in range(0, len(queries), 512):
        q = queries[start:start + 512]
        d2 = (q * q).sum(1)[:, None] - 2 * q @ points.T + (points * points).sum(1)[None, :]
        if skip_self:
            d2[np.arange(len(q)), np.arange(start, start + len(q))] = np.inf
        out[start:start + 512] = np.sqrt(np.maximum(d2.min(1), 0.0))
    return out


@dataclass
class Interval:
    """How far a prediction may be off, as a log-ratio half-width h: the step time lies in [t e^-h, t e^h] for
    about COVERAGE of runs. Near the training runs h is the learned predictor's held-out error (`learned`), far
    from them the cost model's (`cost_model`), as the correction fades, times a `scale` that makes the intervals of
    runs of an unseen source cover COVERAGE of them:

        h(x) = scale (w(x) learned + (1 - w(x)) cost_model),    w = exp(-u^2), the correction's own weight (`Reach`)

    `learned` and `cost_model` are a typical new model's: per source, the COVERAGE quantile of |log(measured /
    predicted)| (each run predicted by a model fitted without its model's runs, FOLDS folds by model) or of
    |log(measured / cost model)|; then the median over sources. A plan unlike every training run gets the cost
    model's typical error on a cluster or framework it has not seen, not the error of the worst-modelled source
    (the CPU run logs and single-node vTrain GPTs, where the cost model is off by up to 30x). The cost model is
    further off on MoE runs than on dense ones, so from v11 an MoE plan far from the training runs takes the MoE
    runs' own (`moe_cost_model`). `scale` is fitted held out a source at a time (`calibrate`): 1 before v11."""
    learned: float
    cost_model: float
    scale: float = 1.0
    moe_cost_model: float | None = None  # the cost model's typical error on MoE runs (from v11; None: cost_model)

    def half_width(self, distance: np.ndarray, moe=None) -> np.ndarray:
        """Half-widths at these distances; `moe` (a boolean per run) picks the MoE runs' cost-model width."""
        w = np.exp(-np.asarray(distance, dtype=float) ** 2)
        far = np.full(w.shape, self.cost_model)
        if moe is not None and self.moe_cost_model is not None:
            far = np.where(np.asarray(moe, dtype=bool), self.moe_cost_model, far)
        return self.scale * (w * self.learned + (1 - w) * far)


COVERAGE = 0.9
FOLDS = 5


def _typical(errors: np.ndarray, sources: list) -> float:
    """The median over sources of each source's COVERAGE quantile of `errors`."""
    by = np.array(sources)
    return float(np.median([np.quantile(errors[by == s], COVERAGE) for s in sorted(set(sources))]))


def held_out(data: Dataset, groups, run: workers.Mapper = map) -> tuple[np.ndarray, np.ndarray]:
    """(log multiplier, distance to the training runs in reach units) of every run, each predicted by a model
    fitted without the runs of its group (`groups`: one label per run). `run` maps the fits (a `workers.pool`)."""
    groups = np.asarray(groups)
    log, distance = np.empty(len(data)), np.empty(len(data))
    names = sorted(set(groups.tolist()))
    kept = [(data.subset(groups != name), data.X[groups == name]) for name in names]
    folds = [(train.X, train.target, train.sources, held) for train, held in kept]
    for name, (fold_log, fold_distance) in zip(names, run(_held_out_fold, folds)):
        log[groups == name], distance[groups == name] = fold_log, fold_distance
    return log, distance


def _held_out_fold(fold) -> tuple[np.ndarray, np.ndarray]:
    """One fold of `held_out`: fitted on the kept runs, the held-out runs' (log multiplier, distance)."""
    X, target, sources, held = fold
    return _fitted_on(X, target, sources)(held)


def _fitted_on(X, target, sources) -> Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """The predictor fitted on these runs, as a function of held-out runs to their (log multiplier, distance)."""
    model, reach, prior = fit(X, target, sources), Reach.fit(X), Fallback.fit(X, target, sources)

    def predict(held):
        with threadpool_limits(1):
            raw = model.predict(held)
        distance = reach.distance(held)
        return np.log(shrunk(raw, np.exp(-distance ** 2), prior.of(held))), distance
    return predict


def _pair_fold(fold) -> list[tuple[np.ndarray, np.ndarray]]:
    """Fitted without two sources, each one's runs predicted (apart, so each gets what a fit held out from it alone
    would give it)."""
    X, target, sources, helds = fold
    predict = _fitted_on(X, target, sources)
    return [predict(held) for held in helds]


def without_pairs(data: Dataset, run: workers.Mapper = map) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """For each source s, what `calibrate(data without s)` holds out by source: every other source t's runs predicted
    by a fit without s and t, as (log multiplier, distance) over the runs of `data` without s, in order. The fit
    without {s, t} serves both s's calibration and t's, so a leave-one-source-out evaluation fits each pair once
    (45 fits for 10 sources, not 90), with the same numbers to the bit."""
    groups = np.array(data.sources)
    names = sorted(set(data.sources))
    if len(names) < 3:  # without one source, a single source is left: calibrate holds none of it out
        return {}
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
    folds = []
    for a, b in pairs:
        train = data.subset((groups != a) & (groups != b))
        folds.append((train.X, train.target, train.sources, (data.X[groups == a], data.X[groups == b])))
    held = {}
    for (a, b), (of_a, of_b) in zip(pairs, run(_pair_fold, folds)):
        held[a, b], held[b, a] = of_a, of_b  # (runs of the first, predicted without the second as well)
    out = {}
    for s in names:
        kept = groups[groups != s]
        log, distance = np.empty(len(kept)), np.empty(len(kept))
        for t in names:
            if t != s:
                log[kept == t], distance[kept == t] = held[t, s]
        out[s] = (log, distance)
    return out


def calibrate(data: Dataset, run: workers.Mapper = map,
              by_source: tuple[np.ndarray, np.ndarray] | None = None) -> Interval:
    """The interval's half-widths from held-out predictions of `data`: `learned` and `cost_model` with folds by
    model, then `scale`, held out a source at a time, so that the intervals cover COVERAGE of the runs of sources
    they were not fitted on, each run weighing the same (from v15). Up to v14 each source weighed the same: that
    covered 89.5 % of a typical source's runs, but once the cost model priced vTrain's single-node sweep (64 % of the
    runs) at a median 7.8 % error, it covered 96 % of all runs, where the intervals are meant to cover 80-95 %."""
    names = sorted(set(data.groups))
    fold_of = {name: i % FOLDS for i, name in enumerate(names)}
    folds = [fold_of[g] for g in data.groups] if len(names) > 1 else [0] * len(data)
    by_model, _ = held_out(data, folds, run) if len(names) > 1 else (np.zeros(len(data)), None)
    moe = data.moe if data.moe is not None else np.zeros(len(data), bool)
    moe_width = (_typical(np.abs(data.target[moe]), [s for s, m in zip(data.sources, moe) if m])
                 if moe.any() else None)
    base = Interval(_typical(np.abs(data.target - by_model), data.sources), _typical(np.abs(data.target), data.sources),
                    moe_cost_model=moe_width)
    if len(set(data.sources)) < 2:
        return base
    # by_source: the held-out predictions by source when already made (`without_pairs`)
    by_source, distance = by_source if by_source is not None else held_out(data, data.sources, run)
    ratio = np.abs(data.target - by_source) / np.maximum(base.half_width(distance, moe), 1e-9)
    return Interval(base.learned, base.cost_model, float(np.quantile(ratio, COVERAGE)), moe_width)


def _calibrated(item) -> Interval:
    data, by_source = item
    return calibrate(data, by_source=by_source)


def shrunk(log_correction: np.ndarray, weight: np.ndarray | None, prior=0.0) -> np.ndarray:
    """The multiplier: the clipped log-correction, scaled by the reach weight where there is one, the rest of the
    weight on `prior` (a log-correction per run, `Fallback.of`; 0: the cost model's answer)."""
    log = np.clip(log_correction, -np.log(MAX_CORRECTION), np.log(MAX_CORRECTION))
    return np.exp(log if weight is None else weight * log + (1 - weight) * prior)


@dataclass
class Fallback:
    """The log-correction a run far from every training run takes: its regime's typical one. The cost model's
    constants were calibrated on dense runs, so a dense run falls back to the cost model (0). An MoE run on an
    accelerator falls back to the correction every source of accelerator MoE runs the version was trained on needed
    at least: each source's median log(measured / cost model) over its MoE runs, and of those the one nearest 0 when
    they all lean the same way, else 0. A new source is likely to need that much, and a source that needs less is
    not pushed past the cost model by the others (v11 and v12 took the median over all MoE runs, x1.32 and x1.29:
    once the cost model priced FP8 GEMMs at what they reach, `hardware.FP8_GEMM_SPEEDUP`, that median priced
    dgxc-benchmarking and Megatron-Bridge worse than the cost model alone, held out by source).
    (A line in log hidden, fitted by Theil-Sen, priced the narrowest models far worse held out by source: Qwen3-30B
    at 41 % against 17 %; the CPU's MoE runs are their own regime, and the cost model keeps them.)"""
    moe: float = 0.0

    @classmethod
    def fit(cls, X: np.ndarray, target: np.ndarray, sources: list) -> Fallback:
        moe = _accelerator_moe(X)
        by = np.asarray(sources)
        medians = [float(np.median(target[moe & (by == s)])) for s in sorted(set(by[moe].tolist()))]
        if not medians or not (all(m > 0 for m in medians) or all(m < 0 for m in medians)):
            return cls(0.0)
        return cls(min(medians, key=abs))

    def of(self, X: np.ndarray) -> np.ndarray:
        return np.where(_accelerator_moe(X), self.moe, 0.0)


def _accelerator_moe(X: np.ndarray) -> np.ndarray:
    """Which rows of a FEATURES matrix are MoE runs on an accelerator (their experts' GEMMs have rows, and the
    device does not compute on the dispatching threads)."""
    X = np.asarray(X, dtype=float).reshape(-1, len(FEATURES))
    return (X[:, FEATURES.index("log_tokens_per_expert")] > 0) & (X[:, FEATURES.index("host_computes")] == 0)


def default_training_paths() -> list[Path]:
    """Everything that ships: converted published runs and the runtime's run logs (data/runlogs/)."""
    return sorted(DATA_DIR.glob("*.jsonl")) + ([DATA_DIR / "runlogs"] if (DATA_DIR / "runlogs").is_dir() else [])


def _weights(sources: list) -> np.ndarray:
    counts = Counter(sources)
    return np.array([1.0 / counts[s] for s in sources]) * len(sources) / len(counts)


def fit(X: np.ndarray, y: np.ndarray, sources: list) -> HistGradientBoostingRegressor:
    from sklearn.ensemble import HistGradientBoostingRegressor

    model = HistGradientBoostingRegressor(max_iter=100, learning_rate=0.1, max_leaf_nodes=15, min_samples_leaf=8,
                                          l2_regularization=1.0, random_state=0)
    # one thread: these fits take a fraction of a second, and OpenMP threads on a busy machine make
    # them take minutes (spin-waiting for cores other processes hold); the weighted binning's percentiles in one
    # call per feature (`predictors.binning`: the same thresholds)
    with threadpool_limits(1), binning.vectorised():
        model.fit(X, y, sample_weight=_weights(sources))
    return model


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files_of(paths) -> list[Path]:
    out = []
    for p in map(Path, paths):
        out.extend(sorted(p.rglob("*.jsonl")) if p.is_dir() else [p])
    return out


def _shown(path: Path) -> str:
    """Shipped files relative to the package, so the bundled metadata does not name a build machine."""
    try:
        return str(path.resolve().relative_to(Path(__file__).resolve().parent.parent))
    except ValueError:
        return str(path)


def _next_version(directory: Path) -> int:
    found = [int(m.group(1)) for p in directory.glob(f"{STEM}-v*.json")
             if (m := re.fullmatch(rf"{STEM}-v(\d+)\.json", p.name))]
    return max(found, default=0) + 1


@dataclass
class Predictor:
    model: HistGradientBoostingRegressor | Trees  # the trees (`predictors.trees`) from v14; what predicts either way
    meta: dict
    path: Path | None = None
    reach: Reach | None = None  # None for versions trained before v6: the correction is not shrunk

    @property
    def interval(self) -> Interval | None:
        """The calibrated interval (versions from v8; None before)."""
        found = self.meta.get("interval")
        return (Interval(found["learned"], found["cost_model"], found.get("scale", 1.0), found.get("moe_cost_model"))
                if found and self.reach is not None else None)

    def bounds(self, X: np.ndarray, step: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(low, high) step times around the predicted `step` of each row of X: COVERAGE of held-out runs lie
        within, wider the further a row is from the training runs (`Interval`). Without a calibration (versions
        before v8), the cost model's spread of a factor MAX_CORRECTION either way."""
        step = np.asarray(step, dtype=float)
        if self.interval is None:
            return step / MAX_CORRECTION, step * MAX_CORRECTION
        X = self._columns(X)
        moe = X[:, self.feature_names.index("log_tokens_per_expert")] > 0 if "log_tokens_per_expert" in \
            self.feature_names else None
        h = self.interval.half_width(self.reach.distance(X), moe)
        return step * np.exp(-h), step * np.exp(h)

    def correction(self, X: np.ndarray) -> np.ndarray:
        """Multiplier on the cost model's step time, one per row, within MAX_CORRECTION either way and shrunk
        toward its regime's fallback (`Fallback`; 1 before v11) as a row leaves the training runs (`Reach`)."""
        X = self._columns(X)
        with threadpool_limits(1):
            log = self.model.predict(X)
        fallback = self.fallback
        prior = fallback.of(X) if fallback is not None else 0.0
        return shrunk(log, self.reach.weight(X) if self.reach is not None else None, prior)

    @property
    def fallback(self) -> Fallback | None:
        """What a far run's correction falls back to (from v11, trained on FEATURES; None before: the cost model)."""
        found = self.meta.get("fallback")
        if not found or self.feature_names != tuple(FEATURES):
            return None
        return Fallback(found["moe"])

    def outside(self, x) -> list[str]:
        """Features of one row outside what training saw: there the correction is an extrapolation."""
        ranges = self.meta.get("feature_range") or {}
        return [name for name, v in zip(self.feature_names, x) if name in ranges
                and not ranges[name][0] - 1e-9 <= v <= ranges[name][1] + 1e-9]

    def predict(self, d: Dims, plan: Plan, hw: Hardware, precision: str = "bf16") -> tuple[float, Estimate]:
        step, est, _ = self.explain(d, plan, hw, precision)
        return step, est

    def explain(self, d: Dims, plan: Plan, hw: Hardware, precision: str = "bf16") -> tuple[float, Estimate, list]:
        """Predicted step time, the cost model's estimate, and the features the prediction extrapolates on."""
        est = estimate(d, plan, hw, precision)
        x = features(d, plan, hw, precision, est, self.feature_names)
        return est.step_time_s * float(self.correction([x])[0]), est, self.outside(x)

    def _columns(self, X) -> np.ndarray:
        """X as this version reads it: rows of its own features, or full FEATURES rows cut down to them."""
        X = np.asarray(X, dtype=float)
        names = self.feature_names
        if X.ndim == 2 and X.shape[1] == len(FEATURES) != len(names):
            X = X[:, [FEATURES.index(n) for n in names]]
        elif X.ndim == 1 and X.size == len(FEATURES) != len(names):
            X = X[[FEATURES.index(n) for n in names]]
        return X.reshape(-1, len(names))

    @property
    def feature_names(self) -> tuple:
        """The features this version was trained on, in its order (FEATURES, or a prefix of it for older ones)."""
        return tuple(self.meta.get("features") or FEATURES)

    @property
    def label(self) -> str:
        return f"{STEM}-v{self.meta.get('version')}"


def train(paths=None, out=None, jobs: int | None = None) -> Predictor:
    """Train on run logs and save as a new version; `out` is a directory or a new .joblib path. `jobs`: worker
    processes for the calibration's held-out fits (`workers.pool`; None: every core); the version does not depend
    on it."""
    paths = [Path(p) for p in (paths or default_training_paths())]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise PredictorError(f"no such run-log file or directory: {', '.join(missing)}")
    data = load_dataset(paths)
    if len(data) < 10:
        why = f" (skipped: {data.skipped[0].where}: {data.skipped[0].reason})" if data.skipped else ""
        raise PredictorError(f"only {len(data)} usable runs in {', '.join(map(str, paths))}; need at least 10{why}")
    out = Path(out) if out else MODELS_DIR
    if out.exists() and not out.is_dir() and out.suffix != ".joblib":
        raise PredictorError(f"{out} is a file: --out takes a new .joblib path or a directory")
    if out.suffix == ".joblib":
        target = out
        if any(target.with_suffix(suffix).exists() for suffix in (".joblib", ".json", ".reach.npz", ".trees.npz")):
            raise PredictorError(f"{target} exists; retraining never overwrites a model, choose a new name")
        version = _next_version(target.parent)
    else:
        out.mkdir(parents=True, exist_ok=True)
        version = _next_version(out)
        target = out / f"{STEM}-v{version}.joblib"
    import joblib
    import sklearn

    model = fit(data.X, data.target, data.sources)
    target.parent.mkdir(parents=True, exist_ok=True)
    joblib.dump(model, target)
    trees_file = target.with_suffix(".trees.npz")
    Trees.of(model).save(trees_file)
    reach = Reach.fit(data.X)
    fallback = Fallback.fit(data.X, data.target, data.sources)
    with workers.pool(jobs) as run:
        interval = calibrate(data, run)
    reach_file = target.with_suffix(".reach.npz")
    with open(reach_file, "wb") as f:
        np.savez(f, mean=reach.mean, scale=reach.scale, points=reach.points, radius=np.array(reach.radius))
    meta = {
        "format": FORMAT, "version": version, "kind": "HistGradientBoostingRegressor on log(measured / cost model)",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "sklearn": sklearn.__version__, "features": list(FEATURES), "model_sha256": _sha256(target),
        "reach": {"file": reach_file.name, "sha256": _sha256(reach_file), "factor": reach.factor},
        "trees": {"file": trees_file.name, "sha256": _sha256(trees_file)},
        "fallback": {"moe": fallback.moe},
        "interval": {"coverage": COVERAGE, "folds": FOLDS, "learned": interval.learned,
                     "cost_model": interval.cost_model, "scale": interval.scale,
                     "moe_cost_model": interval.moe_cost_model},
        "feature_range": {name: [float(data.X[:, i].min()), float(data.X[:, i].max())]
                          for i, name in enumerate(FEATURES)},
        "training": {
            "files": [{"path": _shown(f), "sha256": _sha256(f)} for f in _files_of(paths)],
            "runs": len(data), "runs_per_source": dict(sorted(Counter(data.sources).items())),
            "models": len(set(data.groups)), "skipped": len(data.skipped),
            "skipped_reasons": dict(Counter(s.reason for s in data.skipped).most_common(10)),
        },
    }
    target.with_suffix(".json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return Predictor(model, meta, target, reach)


def _current_names(meta: dict) -> dict:
    """The metadata with its feature names as this code spells them (older models list renamed ones)."""
    meta = dict(meta)
    if isinstance(meta.get("features"), list):
        meta["features"] = [RENAMED.get(name, name) if isinstance(name, str) else name
                            for name in meta["features"]]
    if isinstance(meta.get("feature_range"), dict):
        meta["feature_range"] = {RENAMED.get(name, name): r for name, r in meta["feature_range"].items()}
    return meta


def versions(directory=MODELS_DIR) -> list[tuple[int, Path, dict]]:
    """(version, model file, metadata) of every version in `directory`, oldest first (unreadable metadata: {})."""
    out = []
    for meta_file in Path(directory).glob(f"{STEM}-v*.json"):
        m = re.fullmatch(rf"{STEM}-v(\d+)\.json", meta_file.name)
        if not m:
            continue
        try:
            meta = json.loads(meta_file.read_text())
        except (OSError, json.JSONDecodeError):
            meta = {}
        out.append((int(m.group(1)), meta_file.with_suffix(".joblib"), meta if isinstance(meta, dict) else {}))
    return sorted(out, key=lambda v: v[0])


def latest(directory=MODELS_DIR) -> Path:
    """The default version in `directory`: the newest one not held back (`"default": false`, a retrained version
    that was worse than the default it would have replaced; `predictors.retrain`)."""
    directory = Path(directory)
    found = [path for _, path, meta in versions(directory) if meta.get("default", True) is not False]
    if not found:
        raise PredictorError(f"no trained predictor in {directory}; run `onboard predictor train`")
    return found[-1]


def set_default(predictor: Predictor, default: bool) -> None:
    """Mark a saved version as one `latest` may (or may not) pick; its metadata file is rewritten atomically."""
    predictor.meta["default"] = default
    sidecar = predictor.path.with_suffix(".json")
    tmp = sidecar.with_name(sidecar.name + ".tmp")
    tmp.write_text(json.dumps(predictor.meta, indent=2, sort_keys=True) + "\n")
    tmp.replace(sidecar)


def load(path=None) -> Predictor:
    """A saved predictor (default: the newest version in the package); a clear error when it is damaged."""
    path = Path(path) if path else latest()
    if path.is_dir():
        path = latest(path)
    sidecar = path.with_suffix(".json")
    try:
        meta = bounded.read_json(sidecar, "predictor")
    except bounded.Refused as e:
        raise PredictorError(f"predictor metadata {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise PredictorError(f"predictor metadata {sidecar} has format {meta.get('format') if isinstance(meta, dict) else '?'}, "
                             f"this code reads {FORMAT}")
    problems = schema_problems(meta)
    if problems:
        raise PredictorError(f"predictor metadata {sidecar}: {'; '.join(problems)}")
    meta = _current_names(meta)
    if not isinstance(meta.get("features"), list) or not set(meta["features"]) <= set(FEATURES):
        raise PredictorError(f"predictor {path} was trained on features this code does not compute; retrain it")
    if not path.is_file():
        raise PredictorError(f"predictor model file {path} is missing")
    if _sha256(path) != meta.get("model_sha256"):
        raise PredictorError(f"predictor model file {path} is corrupt (its sha256 does not match {sidecar.name})")
    model = _load_trees(path, meta) if meta.get("trees") else _unpickle(path)
    return Predictor(model, meta, path, _load_reach(path, meta))


def _finite(value, low: float = -math.inf) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > low


def _file_record(record) -> bool:
    """{"file": a name beside the model, "sha256": ...}: a plain file name, never a path elsewhere."""
    return (isinstance(record, dict) and isinstance(record.get("file"), str) and isinstance(record.get("sha256"), str)
            and record["file"] not in ("", ".", "..") and "/" not in record["file"] and "\\" not in record["file"])


def schema_problems(meta: dict) -> list[str]:
    """What in a predictor's metadata is not of the shape training writes, before any field is used: the files it
    names (trees, reach), the numbers the prediction multiplies by (reach factor, fallback, interval), the
    feature ranges."""
    out = []
    if meta.get("trees") and not _file_record(meta["trees"]):
        out.append("trees must be {file: a file name beside the model, sha256}")
    reach = meta.get("reach")
    if reach:
        if not _file_record(reach):
            out.append("reach must be {file: a file name beside the model, sha256, factor}")
        elif "factor" in reach and not _finite(reach["factor"], 0):
            out.append(f"reach factor must be a positive number, got {reach['factor']!r}")
    fallback = meta.get("fallback")
    if fallback and not (isinstance(fallback, dict) and _finite(fallback.get("moe"))):
        out.append("fallback must be {moe: a finite number}")
    interval = meta.get("interval")
    if interval and not (isinstance(interval, dict) and _finite(interval.get("learned"), 0)
                         and _finite(interval.get("cost_model"), 0) and _finite(interval.get("scale", 1.0), 0)
                         and (interval.get("moe_cost_model") is None or _finite(interval["moe_cost_model"], 0))):
        out.append("interval must be {learned, cost_model, scale, moe_cost_model}: positive numbers")
    ranges = meta.get("feature_range")
    if ranges is not None and not (isinstance(ranges, dict) and all(
            isinstance(r, list) and len(r) == 2 and all(_finite(v) for v in r) for r in ranges.values())):
        out.append("feature_range must map features to [low, high]")
    if not isinstance(meta.get("model_sha256"), str):
        out.append("model_sha256 must be the model file's digest")
    return out


def _unpickle(path: Path):
    """The scikit-learn estimator of a version saved before its trees were (v14)."""
    import joblib

    try:
        model = joblib.load(path)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the same thing to the user
        raise PredictorError(f"predictor model file {path} cannot be loaded: {type(e).__name__}: {e}") from None
    if not hasattr(model, "predict"):
        raise PredictorError(f"predictor model file {path} does not hold an estimator")
    return model


def _load_trees(path: Path, meta: dict) -> Trees:
    record = meta["trees"]
    file = path.with_name(str(record.get("file")))
    if not file.is_file() or _sha256(file) != record.get("sha256"):
        raise PredictorError(f"predictor trees file {file} is missing or corrupt (its sha256 does not match)")
    try:
        return Trees.load(file, len(meta["features"]))
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        raise PredictorError(f"predictor trees file {file} cannot be read: {type(e).__name__}: {e}") from None


def _load_reach(path: Path, meta: dict) -> Reach | None:
    record = meta.get("reach")
    if not record:
        return None
    file = path.with_name(record["file"])
    if not file.is_file() or _sha256(file) != record.get("sha256"):
        raise PredictorError(f"predictor reach file {file} is missing or corrupt (its sha256 does not match)")
    try:
        with np.load(file, allow_pickle=False) as z:
            mean, scale, points, radius = (np.asarray(z[k], dtype=float) for k in ("mean", "scale", "points", "radius"))
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        raise PredictorError(f"predictor reach file {file} cannot be read: {type(e).__name__}: {e}") from None
    width = len(meta["features"])
    if (mean.shape != (width,) or scale.shape != (width,) or points.ndim != 2 or points.shape[1] != width
            or radius.size != 1 or not all(np.isfinite(a).all() for a in (mean, scale, points, radius))):
        raise PredictorError(f"predictor reach file {file} does not hold the reach of {width} features")
    return Reach(mean, scale, points, float(radius), float(record.get("factor", OLD_REACH)))


@dataclass
class SourceScore:
    source: str  # a source, a model (of the MoE runs), "moe" or "all"
    runs: int
    cost_median: float
    cost_mean: float
    learned_median: float
    learned_mean: float
    coverage: float | None = None  # share of the runs inside their 90 % interval (held out by source only)
    kind: str = "source"  # "source", "model" (MoE runs by model), "moe" or "all"


HOLD_OUT = ("model", "source")  # what evaluate holds out at a time


def evaluate(paths=None, data: Dataset | None = None, by: str = "model",
             measured_only: bool = False, jobs: int | None = None) -> tuple[list[SourceScore], Dataset]:
    """Absolute % error of step time, pure cost model vs learned, per source, for the MoE runs (together and by
    model) and 'all', each run predicted by a model trained without its group: leave-one-model-out (`by="model"`),
    or leave-one-source-out (`"source"`: a whole benchmark suite held out, as a new cluster or framework is). Held
    out by source, each run also gets the 90 % interval calibrated without its source, and the share of runs it
    covers is reported. `measured_only` leaves out the runs with a value taken from elsewhere (`meta.assumed`).
    `jobs`: worker processes for the fits (`workers.pool`; None: every core); the scores do not depend on it."""
    if by not in HOLD_OUT:
        raise PredictorError(f"hold out by {by!r}: choose from {', '.join(HOLD_OUT)}")
    data = data or load_dataset([Path(p) for p in (paths or default_training_paths())])
    if measured_only and data.assumed is not None:
        data = data.subset(~data.assumed)
    groups = np.array(data.groups if by == "model" else data.sources)
    if len(set(groups)) < 2:
        raise PredictorError(f"leave-one-{by}-out needs runs of at least two {by}s")
    names = sorted(set(groups.tolist()))
    with workers.pool(jobs) as run:
        log, distance = held_out(data, groups, run)
        # each source's interval calibrated without it: a calibration a worker, each fitting its folds in turn
        intervals = []
        if by == "source":
            given = without_pairs(data, run)
            intervals = list(run(_calibrated, [(data.subset(groups != name), given.get(name)) for name in names]))
    predicted = data.cost_step * np.exp(log)
    covered = None
    if by == "source":
        covered = np.zeros(len(data), bool)
        for name, interval in zip(names, intervals):
            held = groups == name
            moe_held = None if data.moe is None else data.moe[held]
            covered[held] = np.abs(data.target[held] - log[held]) <= interval.half_width(distance[held], moe_held)
    cost_err = np.abs(data.cost_step - data.measured) / data.measured
    learned_err = np.abs(predicted - data.measured) / data.measured
    sources, models = np.array(data.sources), np.array(data.groups)
    moe = data.moe if data.moe is not None else np.zeros(len(data), bool)

    def score(name, m, kind):
        return SourceScore(name, int(m.sum()), float(np.median(cost_err[m])), float(cost_err[m].mean()),
                           float(np.median(learned_err[m])), float(learned_err[m].mean()),
                           None if covered is None else float(covered[m].mean()), kind)

    scores = [score(s, sources == s, "source") for s in sorted(set(data.sources))]
    if moe.any():
        scores += [score(m, (models == m) & moe, "model") for m in sorted(set(models[moe].tolist()))]
        scores.append(score("moe", moe, "moe"))
    scores.append(score("all", np.ones(len(data), bool), "all"))
    return scores, data
