"""A fitted gradient-boosted regressor's trees as plain arrays, evaluated with numpy.

scikit-learn fits the predictor (`predictors.learned.fit`); this holds what its `predict` reads, so a command that
only predicts (`onboard plan`) does not import scikit-learn, about 1.3 s of a cold start on a 2-core EPYC. The
arrays are data (an .npz read without pickle), and the sum is the one scikit-learn computes, term by term:

    prediction(x) = baseline + sum over trees t, in order, of value[leaf_t(x)]

where leaf_t(x) is reached from the tree's root by going left when x[feature] <= threshold, and, for a missing
(NaN) value, the way the node sent missing values in training. Equal to `HistGradientBoostingRegressor.predict`
bit for bit (tests/predictors/test_trees.py); a model with categorical splits or several trees per iteration
(a classifier) is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

FIELDS = ("feature", "threshold", "missing_left", "left", "right", "leaf", "value", "roots")


@dataclass(frozen=True)
class Trees:
    feature: np.ndarray  # per node, over all trees: the feature it splits on
    threshold: np.ndarray  # go left when the value is at most this
    missing_left: np.ndarray  # where a NaN goes
    left: np.ndarray  # children, as indices into these arrays
    right: np.ndarray
    leaf: np.ndarray
    value: np.ndarray  # a leaf's contribution (the learning rate already in it)
    roots: np.ndarray  # each tree's first node, in the order the trees add up
    baseline: float
    depth: int  # the deepest leaf's depth: how many steps reach every leaf

    @classmethod
    def of(cls, model) -> Trees:
        """The trees of a fitted scikit-learn `HistGradientBoostingRegressor`."""
        if getattr(model, "n_trees_per_iteration_", 1) != 1:
            raise ValueError("only a regressor's trees (one per iteration) can be exported")
        parts, roots, offset = [], [], 0
        for iteration in model._predictors:
            nodes = iteration[0].nodes
            if nodes["is_categorical"].any():
                raise ValueError("a tree with categorical splits cannot be exported")
            parts.append(nodes)
            roots.append(offset)
            offset += len(nodes)
        nodes = np.concatenate(parts)
        shift = np.repeat(roots, [len(p) for p in parts]).astype(np.int64)
        return cls(feature=nodes["feature_idx"].astype(np.int64), threshold=nodes["num_threshold"].astype(np.float64),
                   missing_left=nodes["missing_go_to_left"].astype(bool),
                   left=nodes["left"].astype(np.int64) + shift, right=nodes["right"].astype(np.int64) + shift,
                   leaf=nodes["is_leaf"].astype(bool), value=nodes["value"].astype(np.float64),
                   roots=np.asarray(roots, dtype=np.int64),
                   baseline=float(np.asarray(model._baseline_prediction).ravel()[0]),
                   depth=int(nodes["depth"].max()))

    def predict(self, X) -> np.ndarray:
        """One prediction per row of X: every tree walked for every row at once, one level a step."""
        X = np.asarray(X, dtype=np.float64)
        X = X.reshape(-1, X.shape[-1]) if X.ndim else X.reshape(1, 1)
        node = np.repeat(self.roots[None, :], len(X), axis=0)
        rows = np.arange(len(X))[:, None]
        for _ in range(self.depth):
            leaf = self.leaf[node]
            if leaf.all():
                break
            x = X[rows, self.feature[node]]
            go_left = np.where(np.isnan(x), self.missing_left[node], x <= self.threshold[node])
            node = np.where(leaf, node, np.where(go_left, self.left[node], self.right[node]))
        values = self.value[node]
        out = np.zeros(len(X)) + self.baseline
        for t in range(values.shape[1]):  # tree by tree, the order scikit-learn adds them in
            out += values[:, t]
        return out

    def save(self, path: Path) -> None:
        np.savez(path, **{f: getattr(self, f) for f in FIELDS}, baseline=self.baseline, depth=self.depth)

    @classmethod
    def load(cls, path: Path, features: int) -> Trees:
        """The trees saved at `path`, for rows of `features` columns; ValueError naming what does not hold when the
        file is not a forest (a file is data from wherever it came: indices out of range or a depth past the node
        count would raise or walk for ever in `predict`)."""
        with np.load(path, allow_pickle=False) as z:
            trees = cls(**{f: z[f] for f in FIELDS}, baseline=float(z["baseline"]), depth=int(z["depth"]))
        n = len(trees.value)
        if any(getattr(trees, f).ndim != 1 or len(getattr(trees, f)) != n for f in FIELDS if f != "roots") \
                or trees.roots.ndim != 1 or not len(trees.roots):
            raise ValueError("its node arrays are not one entry per node, or it has no tree")
        inner = ~trees.leaf.astype(bool)  # a leaf's children and feature are never read
        for name, index, bound, where in (("left", trees.left, n, inner), ("right", trees.right, n, inner),
                                          ("roots", trees.roots, n, slice(None)),
                                          ("feature", trees.feature, features, inner)):
            if not np.issubdtype(index.dtype, np.integer) or ((index < 0) | (index >= bound))[where].any():
                raise ValueError(f"a '{name}' entry lies outside 0..{bound - 1}")
        if not 0 <= trees.depth <= n or not np.isfinite(trees.value).all() or not np.isfinite(trees.baseline):
            raise ValueError("its depth or its values are out of range")
        return trees
