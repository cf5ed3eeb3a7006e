"""The predictor's trees as arrays (predictors.trees): the numbers scikit-learn's own `predict` gives, bit for bit,
on the training runs, on runs pushed off them and on missing values; a predicting command that does not import
scikit-learn; a damaged trees file refused in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import joblib
import numpy as np
import pytest
from sklearn.ensemble import HistGradientBoostingRegressor

from predictors import learned
from predictors.errors import PredictorError
from predictors.features import load_dataset
from predictors.trees import Trees


@pytest.fixture(scope="module")
def shipped():
    predictor = learned.load()
    estimator = joblib.load(predictor.path)  # the scikit-learn estimator the trees were taken from
    X = predictor._columns(load_dataset(learned.default_training_paths()).X)
    return predictor, estimator, X


def test_the_shipped_trees_predict_what_scikit_learn_predicts(shipped):
    predictor, estimator, X = shipped
    assert isinstance(predictor.model, Trees)
    rng = np.random.default_rng(0)
    moved = X[rng.integers(0, len(X), 400)] * rng.uniform(0.3, 3.0, (400, X.shape[1]))  # off the training runs
    missing = moved.copy()
    missing[rng.random(missing.shape) < 0.1] = np.nan  # each node sends NaN the way training did
    for rows in (X, moved, missing, X[:1]):
        assert np.array_equal(predictor.model.predict(rows), estimator.predict(rows))


def test_a_freshly_fitted_model_round_trips_through_its_file(tmp_path):
    rng = np.random.default_rng(1)
    X = rng.normal(size=(300, 4))
    X[rng.random(X.shape) < 0.05] = np.nan  # trained with missing values: the nodes learn where they go
    y = np.sin(np.nan_to_num(X[:, 0])) + np.nan_to_num(X[:, 1], nan=3.0) ** 2
    model = HistGradientBoostingRegressor(max_iter=30, max_leaf_nodes=7, random_state=0).fit(X, y)
    Trees.of(model).save(tmp_path / "t.npz")
    query = rng.normal(size=(200, 4)) * 2
    query[rng.random(query.shape) < 0.1] = np.nan
    assert np.array_equal(Trees.load(tmp_path / "t.npz", 4).predict(query), model.predict(query))
    # a planted difference is seen: one leaf's value changed changes the predictions
    trees = Trees.load(tmp_path / "t.npz", 4)
    trees.value[np.flatnonzero(trees.leaf)[3]] += 1e-3
    assert not np.array_equal(trees.predict(query), model.predict(query))


def test_categorical_splits_are_refused():
    X = np.column_stack([np.arange(200) % 4, np.linspace(0, 1, 200)])
    model = HistGradientBoostingRegressor(max_iter=5, categorical_features=[0], random_state=0).fit(X, X[:, 0] * 2.0)
    with pytest.raises(ValueError, match="categorical"):
        Trees.of(model)


def test_predicting_imports_no_scikit_learn():
    code = ("import sys; from predictors import learned; m = learned.load(); "
            "import numpy as np; m.correction(np.zeros((1, len(m.feature_names)))); "
            "print(sorted(k for k in sys.modules if k.split('.')[0] in ('sklearn', 'joblib', 'scipy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_damaged_trees_file_is_refused_in_one_line(tmp_path):
    version = learned.load().path
    for f in version.parent.glob(version.stem + ".*"):
        shutil.copy(f, tmp_path / f.name)
    trees = tmp_path / (version.stem + ".trees.npz")
    trees.write_bytes(trees.read_bytes()[:-10])
    with pytest.raises(PredictorError, match="trees file .* is missing or corrupt"):
        learned.load(tmp_path / version.name)
    trees.unlink()
    with pytest.raises(PredictorError, match="trees file .* is missing or corrupt"):
        learned.load(tmp_path / version.name)
    # a file whose digest the metadata was re-stamped with, which is no array file
    trees.write_bytes(b"not an npz")
    sidecar = tmp_path / (version.stem + ".json")
    meta = json.loads(sidecar.read_text())
    assert meta["trees"]["file"] == trees.name
    meta["trees"]["sha256"] = learned._sha256(trees)
    sidecar.write_text(json.dumps(meta))
    with pytest.raises(PredictorError, match="trees file .* cannot be read"):
        learned.load(tmp_path / version.name)


def test_a_trees_file_that_is_not_a_forest_is_refused_in_one_line(tmp_path):
    """The file is data from wherever it came, and its digest only says it is the file the JSON names (both can be
    rewritten together): a child or a feature out of range, a depth that would walk past the nodes, a value that is
    not finite, a truncated archive, each is refused when it loads, not met as a traceback or a hang in predict."""
    version = learned.load().path
    for f in version.parent.glob(version.stem + ".*"):
        shutil.copy(f, tmp_path / f.name)
    trees_file, sidecar = tmp_path / (version.stem + ".trees.npz"), tmp_path / (version.stem + ".json")
    good = Trees.load(trees_file, len(learned.load().feature_names))
    inner = np.flatnonzero(~good.leaf)[0]

    def edited(**change):
        arrays = {f: getattr(good, f).copy() for f in ("feature", "threshold", "missing_left", "left", "right",
                                                       "leaf", "value", "roots")}
        arrays.update(baseline=good.baseline, depth=good.depth)
        for name, (at, value) in change.items():
            if at is None:
                arrays[name] = value
            else:
                arrays[name][at] = value
        return arrays

    cases = {"child": edited(left=(inner, 10 ** 9)), "feature": edited(feature=(inner, 999)),
             "depth": edited(depth=(None, 10 ** 12)), "value": edited(value=(0, np.nan)),
             "root": edited(roots=(0, -1)), "shape": edited(right=(None, good.right[:-1]))}
    for what, arrays in cases.items():
        np.savez(trees_file, **arrays)
        meta = json.loads(sidecar.read_text())
        meta["trees"]["sha256"] = learned._sha256(trees_file)
        sidecar.write_text(json.dumps(meta))
        with pytest.raises(PredictorError, match="trees file .* cannot be read: ValueError"):
            learned.load(tmp_path / version.name)
    trees_file.write_bytes((version.parent / trees_file.name).read_bytes()[:2000])  # a zip cut short
    meta["trees"]["sha256"] = learned._sha256(trees_file)
    sidecar.write_text(json.dumps(meta))
    with pytest.raises(PredictorError, match="trees file .* cannot be read"):
        learned.load(tmp_path / version.name)
