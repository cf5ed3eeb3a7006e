"""scikit-learn's weighted histogram binning, the same thresholds in one vectorised call per feature.

From scikit-learn 1.7, `HistGradientBoostingRegressor.fit(X, y, sample_weight=w)` bins each feature at weighted
percentiles, and asks `sklearn.utils.stats._weighted_percentile` for them one at a time: `max_bins - 1` calls per
feature, each a pass through its array-API layer. On the predictor's 2,000 runs that is three quarters of a fit, and
the held-out evaluations fit a hundred times. `_weighted_percentile` takes a vector of ranks and gives, rank for rank,
the same numbers as those calls (`tests/predictors/test_binning.py` holds it to that, and fits with and without this
to the same trees). So during a fit the binning module's name for it is bound to `AllRanksAtOnce`: the first call
for a column computes every rank of the default grid in one call, and the next calls for the same column (the same
array objects, kept alive while they are served) read from it. A rank off that grid, or another column, goes to the
function itself. Where the binning module has no such name (scikit-learn before 1.7 does not weight its bins),
nothing is changed.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np

MAX_BINS = 255  # HistGradientBoostingRegressor's default, which `learned.fit` keeps
RANKS = np.linspace(0, 100, num=MAX_BINS + 1)[1:-1]  # the ranks its binning asks for, in order


class AllRanksAtOnce:
    """A stand-in for `_weighted_percentile` that answers a column's ranks from one vectorised call."""

    def __init__(self, percentile):
        self.percentile = percentile
        self._local = threading.local()  # binning may run its features on threads: one column per thread

    def __call__(self, array, sample_weight=None, percentile_rank=50, average=False, **kwargs):
        if kwargs or sample_weight is None or np.ndim(array) != 1 or not np.isscalar(percentile_rank):
            return self.percentile(array, sample_weight, percentile_rank, average=average, **kwargs)
        held = getattr(self._local, "held", None)
        # the same objects: held here, so no other array can take their ids while they are served
        if held is None or held[0] is not array or held[1] is not sample_weight or held[2] != average:
            values = self.percentile(array, sample_weight, RANKS, average=average)
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
