"""predictors.binning: scikit-learn's weighted bins, computed in one call per feature, are the bins it computes."""

import contextlib

import numpy as np
import pytest

from predictors import binning, learned

binning_module = pytest.importorskip("sklearn.ensemble._hist_gradient_boosting.binning")
needs_weighted_bins = pytest.mark.skipif(not hasattr(binning_module, "_weighted_percentile"),
                                         reason="this scikit-learn does not weight its bins")


@needs_weighted_bins
@pytest.mark.parametrize("average", [True, False])
def test_every_rank_is_the_one_sklearn_gives(average):
    """Sorted columns with ties, zero weights and a constant run, each rank of the grid and one off it."""
    _weighted_percentile = binning_module._weighted_percentile  # scikit-learn's own, which the binning calls

    rng = np.random.default_rng(0)
    column = np.sort(np.concatenate([rng.normal(size=700), np.full(200, 0.25), rng.integers(0, 5, 100)]))
    weight = rng.uniform(0, 2, column.size)
    weight[::7] = 0.0
    at_once = binning.AllRanksAtOnce(_weighted_percentile)
    # and unit weights on 255 values, where most ranks of the grid land on a value (and `average` decides)
    # and there with every fifth weight zero: the value averaged with is the next one that has weight
    gaps = np.ones(255)
    gaps[::5] = 0.0
    for col, w in ((column, weight), (np.sort(rng.normal(size=255)), np.ones(255)),
                   (np.sort(rng.normal(size=255)), gaps)):
        for rank in [*binning.RANKS, 33.3]:
            assert at_once(col, w, rank, average=average) == _weighted_percentile(col, w, rank, average=average)
    other = column[::-1].copy()  # another column is computed afresh, not read from the first one's
    assert at_once(other, weight, 50.0, average=average) == _weighted_percentile(other, weight, 50.0,
                                                                                average=average)


@needs_weighted_bins
def test_a_fit_bins_and_predicts_as_without_it():
    """The predictor's own fit on the shipped runs: the same thresholds for every feature, the same predictions."""
    from predictors.features import load_dataset

    data = load_dataset(learned.default_training_paths())
    assert max(len(np.unique(column)) for column in data.X.T) > binning.MAX_BINS  # bins at percentiles
    with binning.vectorised():
        assert isinstance(binning_module._weighted_percentile, binning.AllRanksAtOnce)
    fast = learned.fit(data.X, data.target, data.sources)
    vectorised = binning.vectorised
    try:
        binning.vectorised = contextlib.nullcontext
        plain = learned.fit(data.X, data.target, data.sources)
    finally:
        binning.vectorised = vectorised
    assert binning_module._weighted_percentile.__module__ == "sklearn.utils.stats"  # put back after the fit
    for a, b in zip(fast._bin_mapper.bin_thresholds_, plain._bin_mapper.bin_thresholds_, strict=True):
        assert np.array_equal(a, b)
    assert np.array_equal(fast.predict(data.X), plain.predict(data.X))


@needs_weighted_bins
def test_the_ends_of_the_range_and_leading_weightless_values():
    """Ranks 0 and 100 and values of zero weight first: rank 0 skips them, as scikit-learn's own does."""
    weight = np.array([0.0, 0.0, 1.0, 2.0, 0.0, 1.0, 1.0])
    column = np.array([-3.0, -2.0, 0.5, 1.0, 1.5, 2.0, 7.0])
    ranks = np.array([0.0, 20.0, 40.0, 60.0, 100.0])
    for average in (True, False):
        want = [binning_module._weighted_percentile(column, weight, r, average=average) for r in ranks]
        assert binning.weighted_percentiles(column, weight, ranks, average).tolist() == want
