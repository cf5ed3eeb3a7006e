"""scikit-learn's weighted histogram binning, the same thresholds in one NumPy pass per feature.

From scikit-learn 1.7, `HistGradientBoostingRegressor.fit(X, y, sample_weight=w)` bins each feature at weighted
percentiles, and asks `sklearn.utils.stats._weighted_percentile` for them one at a time: `max_bins - 1` calls per
feature, each a pass through its array-API layer. On the predictor's 2,000 runs that was three quarters of a fit,
and the held-out evaluations fit a hundred times. So during our fits the binning module's name for that function is
bound to `AllRanksAtOnce`: the first call for a column computes every rank of the default grid at once
(`weighted_percentiles`, the same rule in NumPy: the averaged inverted CDF of the weights), and the next calls for
the same column (the same array objects, kept alive while they are served) read from it. Anything else (a rank off
the grid, a 2-D array, no weights) goes to scikit-learn's own function. `tests/predictors/test_binning.py` holds
the two to the same numbers rank by rank, and a fit with and without this to the same bins and predictions. Where the
binning module has no such name (scikit-learn before 1.7 does not weight its bins), nothing is changed.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np

MAX_BINS = 255  # HistGradientBoostingRegressor's default, which `learned.fit` keeps
RANKS = np.linspace(0, 100, num=MAX_BINS + 1)[1:-1]  # the ranks its binning asks for, in order


def weighted_percentiles(values: np.ndarray, weights: np.ndarray, ranks: np.ndarray, average: bool) -> np.ndarray:
    """The weighted percentiles of a 1-D column at `ranks` (0-100), as scikit-learn's `_weighted_percentile`
    defines them. With the values sorted and C the running sum of their weights, rank p picks the first value whose
    C reaches t = p / 100 * C[-1] (t = 0 moved to the next float up, so it skips leading zero weights); with
    `average`, where C there is t exactly (to machine epsilon) the value is averaged with the next one of nonzero
    weight (the `averaged_inverted_cdf` of `np.percentile` for unit weights)."""
    values = np.asarray(values, dtype=np.float64)
    weights = np.asarray(weights, dtype=np.float64)
    order = np.argsort(values.reshape(-1, 1), axis=0, kind="quicksort")[:, 0]  # as scikit-learn sorts
    cdf = np.cumsum(weights[order])
    target = np.asarray(ranks, dtype=np.float64) / 100 * cdf[-1]
    zero = target == 0
    target[zero] = np.nextafter(target[zero], target[zero] + 1)
    last = len(values) - 1
    at = np.clip(np.searchsorted(cdf, target), 0, last)
    picked = values[order[at]]
    if not average:
        return picked
    after = order[np.clip(at + 1, 0, last)]
    weightless = weights[after] == 0  # the next value carries no weight: the next one that does
    if weightless.any():
        beyond = np.searchsorted(cdf, cdf[at[weightless]], side="right")
        after[weightless] = order[np.where(beyond > last, at[weightless], beyond)]
    past_the_target = cdf[at] - target > np.finfo(np.float64).eps
    return np.where(past_the_target, picked, (picked + values[after]) / 2)


class AllRanksAtOnce:
    """A stand-in for `_weighted_percentile` that answers a column's ranks from one vectorised call."""

    def __init__(self, percentile):
        self.percentile = percentile
        self._local = threading.local()  # binning may run its features on threads: one column per thread

    def __call__(self, array, sample_weight=None, percentile_rank=50, average=False, **kwargs):
        if (kwargs or sample_weight is None or np.ndim(array) != 1 or not np.isscalar(percentile_rank)
                or np.asarray(array).dtype != np.float64 or np.asarray(sample_weight).dtype != np.float64):
            return self.percentile(array, sample_weight, percentile_rank, average=average, **kwargs)
        held = getattr(self._local, "held", None)
        # the same objects: held here, so no other array can take their ids while they are served
        if held is None or held[0] is not array or held[1] is not sample_weight or held[2] != average:
            values = weighted_percentiles(array, sample_weight, RANKS, average)
            held = (array, sample_weight, average, dict(zip(RANKS.tolist(), values)))
            self._local.held = held
        value = held[3].get(float(percentile_rank))
        return self.percentile(array, sample_weight, percentile_rank, average=average) if value is None else value


@contextlib.contextmanager
def vectorised():
    """Within the block, scikit-learn's histogram binning reads its weighted percentiles through `AllRanksAtOnce`."""
    try:
        from sklearn.ensemble._hist_gradient_boosting import binning
    except ImportError:
        binning = None
    percentile = getattr(binning, "_weighted_percentile", None)
    if percentile is None or isinstance(percentile, AllRanksAtOnce):
        yield
        return
    binning._weighted_percentile = AllRanksAtOnce(percentile)
    try:
        yield
    finally:
        binning._weighted_percentile = percentile
