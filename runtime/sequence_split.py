"""The sequence split the current step runs under (context parallelism), or None: the whole sequence is here.

The attention cores of `runtime.attention` (the linear cores' chunk rule and short convolution, the DSA indexer and
its sparse attention) ask `active()` on every call. Under context parallelism the training step sets it
(`running`) to a `runtime.parallel.context_split.Split`, whose methods compute the same core across the cp ranks'
segments (`gated_delta`, `conv1d`, `attention`, `index_topk`, `sparse_attention`); outside one they run as they
always do. The object lives here, outside `runtime.parallel` and `runtime.attention`, so that the cores never import
the parallel layout and the loss does not import the attention cores.
"""

from __future__ import annotations

from contextlib import contextmanager

_ACTIVE = None


def active():
    """The split this step runs under, or None."""
    return _ACTIVE


@contextmanager
def running(split):
    """Run the cores under `split` (None: unsplit) for the duration (forward and backward: a recomputed layer
    runs its forward again inside the backward)."""
    global _ACTIVE
    before, _ACTIVE = _ACTIVE, split
    try:
        yield split
    finally:
        _ACTIVE = before
