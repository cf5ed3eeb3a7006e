"""Verification judges gradients against an fp64 run of the HuggingFace twin (issue 14).

Gated-delta-rule hybrids built from configs that are not transformers' defaults (smaller and differently
mixed, saved with `save_pretrained` as a checkpoint's author would) verify under the rule; a decay gradient
formed the cancellation-prone way (each pair's row sum minus its column sum, then a reversed running sum: the
runtime's backward before issue 14) fails it, while the fp32-only rule lets it through.
"""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from onboard.adapt.verify import ERR_FACTOR, ERR_FLOOR, verify
from onboard.bundle.files import load_adapter, read_decision
from onboard.bundle.make import adapt
from onboard.inspect.spec import ModelSpec
from onboard.source import resolve
from onboard.twin import Twin

pytestmark = pytest.mark.slow  # five adapt-and-verify runs against fp64: about a minute

SMALL = dict(vocab_size=320, hidden_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=24, linear_key_head_dim=16, linear_value_head_dim=24, linear_num_key_heads=2,
             linear_num_value_heads=4, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40,
             shared_expert_intermediate_size=56, eos_token_id=1, bos_token_id=0)
CONFIGS = {
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"]),
    "qwen3_5_moe_text": dict(layer_types=["linear_attention", "linear_attention", "full_attention",
                                          "linear_attention"]),
    "qwen4_exp_text": dict(layer_types=["linear_attention", "indexed_attention", "linear_attention",
                                        "linear_attention"],
                           indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=24, indexer_budget=16,
                           indexer_compress_ratio=4),
    "lara_mini": dict(layer_types=["linear_attention", "sliding_attention", "full_attention", "linear_attention"],
                      sliding_window=16),
}


def _checkpoint_config(tmp_path_factory, family: str) -> str:
    folder = tmp_path_factory.mktemp(family)
    AutoConfig.for_model(family, **SMALL, **CONFIGS[family]).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def qwen3_next_bundle(tmp_path_factory):
    source = resolve(_checkpoint_config(tmp_path_factory, "qwen3_next"))
    out = tmp_path_factory.mktemp("bundle") / "qwen3_next"
    adapt(source, out)
    return source, out


@pytest.mark.parametrize("family", [f for f in CONFIGS if f != "qwen3_next"])
def test_hybrids_from_other_configs_verify_against_fp64(tmp_path_factory, family):
    _, verification = adapt(resolve(_checkpoint_config(tmp_path_factory, family)),
                            tmp_path_factory.mktemp("bundle") / family)
    _assert_judged_against_fp64(verification)


def test_qwen3_next_from_another_config_verifies_against_fp64(qwen3_next_bundle):
    import json

    _, bundle = qwen3_next_bundle
    data = json.loads((bundle / "verification.json").read_text())
    assert data["passed"], data["note"]
    assert {"err_factor", "err_floor"} <= set(data["tolerances"])
    assert [s["decays"] for s in data["seeds"]] == ["", "weak", "strong"]
    assert "fp64" in (bundle / "REVIEW.md").read_text()


def _assert_judged_against_fp64(verification):
    assert verification.passed, verification.note
    assert all(s.truth == "fp64" for s in verification.seeds)
    assert [s.decays for s in verification.seeds] == ["", "weak", "strong"]
    for s in verification.seeds:
        assert s.grad_err_adapted <= ERR_FACTOR * s.grad_err_hf + ERR_FLOOR
        assert 0 < s.logits_err_hf < 1e-4 and s.logits_err_adapted <= ERR_FACTOR * s.logits_err_hf + ERR_FLOOR


def _rows_minus_columns(original):
    """The planted backward: the pairs' decay gradient as each token's row sum minus its column sum, then a
    reversed running sum (equal in exact arithmetic; under strong decay both sums are large and the difference
    is rounding)."""
    def backward(lhs, b, G, dxs):
        das, db, _ = original(lhs, b, G, dxs)
        dG = -b * db
        for a, da in zip(lhs, das):
            dG = dG + a * da
        if G.shape[-1] == 1:
            dG = dG.sum(-1, keepdim=True)
        return das, db, dG.flip(-2).cumsum(-2).flip(-2)
    return backward


def test_a_cancelling_decay_gradient_fails_against_fp64_but_passes_the_fp32_rule(qwen3_next_bundle, monkeypatch):
    import runtime.attention.decay_pairs as pairs
    import runtime.attention.gated_delta as gated_delta

    source, bundle = qwen3_next_bundle
    spec = ModelSpec.from_json((bundle / "spec.json").read_text())
    decision = read_decision(bundle)
    twin = Twin.build(source)
    adapter = load_adapter(bundle).adapt
    planted = _rows_minus_columns(pairs.decay_pairs_backward)
    monkeypatch.setattr(pairs, "decay_pairs_backward", planted)
    monkeypatch.setattr(gated_delta, "decay_pairs_backward", planted)

    judged = verify(spec, twin, adapter, decision.taken())
    assert not judged.passed
    wide = judged.seeds[-1]
    assert wide.decays == "strong" and not wide.passed
    assert any(name in failure for failure in wide.grad_failures for name in ("A_log", "dt_bias"))
    assert wide.grad_err_adapted > ERR_FACTOR * wide.grad_err_hf

    before = verify(spec, twin, adapter, decision.taken(), against_fp64=False, decay_draws={})  # the rule before issue 14
    assert before.passed, before.note
    assert all(s.truth == "" and s.decays == "" for s in before.seeds)
