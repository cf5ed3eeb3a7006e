"""Experts kept as flat matrices (DBRX, issue 36): (E·F, H) parameters the forward views per expert as (E, F, H),
read as MoE experts by what the forward does with them, swapped with the runtime's block around the same
parameters, each stack multiplied the way the model multiplies it (DBRX's gate and up as x W^T, its down as x W),
the chosen weights renormalised by the p-norm the model uses; a router that jitters its tokens in training keeps
its own code. Tiny twins of transformers' own DbrxConfig."""

from __future__ import annotations

import sys

import pytest
import torch

from onboard.adapt.decision import decide
from onboard.bundle.files import load_adapter
from onboard.inspect.capture import capture
from onboard.inspect.inspection import build_spec
from onboard.review.families import default_config
from onboard.source import from_config
from onboard.twin import Twin
from tests.helpers import verify_rendered


def _dbrx(**ffn):
    """DBRX's default config with `ffn` set in its ffn_config: (spec, twin, decision)."""
    config = default_config("dbrx")
    for key, value in ffn.items():
        setattr(config.ffn_config, key, value)
    twin = Twin.build(from_config(config, "dbrx"))
    spec = build_spec(twin, capture(twin))
    return spec, twin, decide(spec, twin)


def _verify(model, tmp_path):
    return verify_rendered(*model, tmp_path)


@pytest.fixture(scope="module")
def square():
    """Experts as wide as the model (F = H): no shape tells the down matrix's orientation, only the forward."""
    return _dbrx(ffn_hidden_size=64, moe_num_experts=6, moe_top_k=2)


@pytest.fixture(scope="module")
def two_norm():
    return _dbrx(moe_num_experts=6, moe_top_k=3, moe_normalize_expert_weights=2.0)


def test_flat_matrices_are_read_as_experts_each_stack_as_the_forward_multiplies_it(square):
    spec, twin, decision = square
    mlp = spec.layers[0].mlp
    assert (mlp.kind, mlp.num_experts, mlp.top_k, mlp.expert_layout) == ("moe", 6, 2, "fused")
    assert mlp.expert_weights == {"gate": "ffn.experts.mlp.w1", "up": "ffn.experts.mlp.v1",
                                  "down": "ffn.experts.mlp.w2"}
    assert mlp.expert_flat == {"gate": "out_in", "up": "out_in", "down": "in_out"}
    assert mlp.expert_ffn == twin.config.ffn_config.ffn_hidden_size
    assert mlp.router.renormalize and mlp.router.renorm_p is None  # DBRX's default: the 1-norm, the sum
    assert decision.moe[0].takes == "block"


def test_the_block_verifies_on_the_models_own_parameters(square, tmp_path):
    spec, twin, decision = square
    verification = _verify(square, tmp_path)
    assert verification.passed and verification.replaced == 1, verification.note
    # the runtime's experts hold DBRX's own flat parameters (views at each use, no copies)
    from runtime.moe.block import MoEBlock

    model = twin.model
    own = model.get_submodule("transformer.blocks.0.ffn.experts.mlp").w2
    swaps = load_adapter(tmp_path).adapt(model)
    try:
        block = next(m for m in model.modules() if isinstance(m, MoEBlock))
        assert block.experts.down is own
        assert block.experts.down.dim() == 2 and block.experts.stack("down").shape[0] == 6
    finally:
        swaps.undo()


def test_planted_down_read_as_the_gate_is_caught(square, tmp_path, monkeypatch):
    """Every stack read as (out, in), the layout the shapes alone would suggest when F = H: verification fails."""
    from runtime.moe.block import GroupedExperts

    monkeypatch.setattr(GroupedExperts, "is_transposed", lambda self, name: False)
    assert not _verify(square, tmp_path).passed


def test_weights_renormalised_by_their_two_norm(two_norm, tmp_path, monkeypatch):
    spec, _, decision = two_norm
    assert spec.layers[0].mlp.router.renorm_p == 2.0
    assert decision.moe[0].takes == "block"
    assert _verify(two_norm, tmp_path).passed

    from runtime.moe.router import route as good

    def by_sum(logits, spec, bias=None, indices=None):  # planted: the sum, DBRX's default, where p is 2
        return good(logits, spec.__class__(**{**spec.__dict__, "renorm_p": None}), bias, indices)

    monkeypatch.setattr(sys.modules["runtime.moe.block"], "route", by_sum)
    assert not _verify(two_norm, tmp_path / "planted").passed


def test_a_router_that_jitters_in_training_keeps_its_own_code(tmp_path):
    """Verification runs in evaluation mode, where the jitter is off: the block is told apart by running it in
    training mode, and the experts alone are swapped behind DBRX's own router (which keeps jittering the tokens
    the experts receive)."""
    model = _dbrx(moe_num_experts=4, moe_top_k=2, moe_jitter_eps=0.01)
    entry = model[2].moe[0]
    assert entry.takes == "experts" and entry.experts.path == "ffn.experts"
    assert "draws random numbers in training" in entry.why and "`ffn_config.moe_jitter_eps` = 0.01" in entry.why
    assert _verify(model, tmp_path).passed


def test_expert_parallelism_refuses_flat_stacks():
    from runtime.moe.block import GroupedExperts
    from runtime.parallel.expert import shard_experts

    E, F, H = 4, 8, 6
    flat = [torch.nn.Parameter(torch.randn(E * F, H)) for _ in range(3)]
    experts = GroupedExperts(flat[0], flat[2], up=flat[1], activation=torch.nn.functional.silu, num_experts=E,
                             layouts={"gate_up": "out_in", "up": "out_in", "down": "in_out"})
    with pytest.raises(ValueError, match="flat"):
        shard_experts(experts, E, 0, 2)
