"""The cost model's operator counts per decoder layer (`OPS_PER_LAYER`) against a recount of the runtime's adapted
layers, so a runtime change that adds or removes operators shows up here rather than as a silent mispricing."""

import importlib.util
from pathlib import Path

import pytest
import torch

from predictors.costmodel import OPS_PER_LAYER
from runtime.op_count import OpCounter

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_dispatch", ROOT / "bench" / "dispatch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kind", sorted(OPS_PER_LAYER))
def test_operator_counts_per_layer_match_the_runtime(kind):
    forward, backward = _bench().count_layer_ops(kind)
    want_forward, want_backward = OPS_PER_LAYER[kind]
    assert forward == pytest.approx(want_forward, rel=0.1) and backward == pytest.approx(want_backward, rel=0.1), (
        f"{kind} layer now issues {forward} + {backward} operators; update OPS_PER_LAYER")


def test_the_counter_counts_every_operator_once():
    x = torch.ones(4, requires_grad=True)
    with OpCounter() as forward:
        y = (x * 2).sum()
    with OpCounter() as backward:
        y.backward()
    assert forward.count == 2 and backward.count > 0
    with OpCounter() as nothing:
        pass
    assert nothing.count == 0
