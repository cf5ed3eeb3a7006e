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


def test_the_truth_is_fp64_throughout(qwen3_next_bundle):
    """transformers' code upcasts to fp32 for half precision (norms, softmaxes, the loss, the gated-delta scans and
    their decays), which in a `.double()` model rounds to fp32; verification's truth keeps fp64 everywhere. Planted:
    the truth as the model's code writes it gives a loss in fp32 and shares HuggingFace fp32's roundings."""
    import copy

    import torch

    import onboard.adapt.verify as V

    source, bundle = qwen3_next_bundle
    spec = ModelSpec.from_json((bundle / "spec.json").read_text())
    twin = Twin.build(source)
    model = copy.deepcopy(twin.model)
    V._redraw(model, spec, twin.layers_path, 2, V.DECAY_DRAWS[2][1])
    batch = twin.example_batch(2, V.WIDE_SEQ)
    truth = copy.deepcopy(model).double().eval()
    out, why_not, casts = V._truth(truth, batch)
    assert why_not is None and casts == "" and out.loss.dtype == torch.float64
    as_written = copy.deepcopy(model).double().eval()
    as_written.set_experts_implementation("eager")  # grouped GEMMs take no fp64
    V._token_by_token(as_written)
    plain = as_written(**batch, use_cache=False)
    assert plain.loss.dtype == torch.float32  # the model's own `logits.float()`
    hf = model.eval()(**batch, use_cache=False)
    assert V._error(hf.loss, out.loss) > 1e-9  # fp32's rounding, seen against the fp64 loss


# decays drawn so that a decay rate's gradient is tiny next to the model's largest (5e-5 of it on this config)
# while HuggingFace's own fp32 error on it stays small (3e-3): a 10 % error there is far past the bound
SMALL_GRADIENT_DRAW = {0: ("strong", (2.0, 2.5))}


def _with_planted_gradient(adapter, name: str, factor: float):
    """The bundle's adapter, and then the gradient of parameter `name` multiplied by `factor`."""
    def adapt(model, **kw):
        swaps = adapter(model, **kw)
        model.get_parameter(name).register_hook(lambda grad: grad * factor)
        return swaps
    return adapt


def test_a_decay_gradient_ten_percent_off_fails_on_a_tensor_with_a_tiny_gradient(qwen3_next_bundle):
    import copy

    import onboard.adapt.verify as V

    source, bundle = qwen3_next_bundle
    spec = ModelSpec.from_json((bundle / "spec.json").read_text())
    taken = read_decision(bundle).taken()
    twin = Twin.build(source)
    adapter = load_adapter(bundle).adapt
    name = f"{twin.layers_path}.0.linear_attn.dt_bias"

    truth = copy.deepcopy(twin.model)
    V._redraw(truth, spec, twin.layers_path, 0, SMALL_GRADIENT_DRAW[0][1])
    truth = truth.double().eval()
    assert V._truth(truth, twin.example_batch(0, V.WIDE_SEQ))[1:] == (None, "")
    grads = {n: float(p.grad.abs().max()) for n, p in truth.named_parameters() if p.grad is not None}
    assert grads[name] <= 1e-4 * max(grads.values())

    honest = verify(spec, twin, adapter, taken, seeds=(0,), decay_draws=SMALL_GRADIENT_DRAW)
    assert honest.passed, honest.note
    planted = verify(spec, twin, _with_planted_gradient(adapter, name, 1.1), taken, seeds=(0,),
                     decay_draws=SMALL_GRADIENT_DRAW)
    assert not planted.passed
    assert [f for f in planted.seeds[0].grad_failures if f.startswith(name)], planted.seeds[0].grad_failures
