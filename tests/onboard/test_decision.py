"""The adapt decision: one typed object, decided once, refined by refusals, saved and read back as JSON."""

import json

import pytest

from onboard.adapt.decision import SCHEMA_VERSION, Decision, decide
from onboard.adapt.settle import trials
from onboard.adapt.verify import Verification
import runtime.attention as attention


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory, twin_adapter):
    spec, twin, decision, _ = twin_adapter(tmp_path_factory.mktemp("qwen3-next"), ref="qwen3-next-80b-a3b")
    return spec, twin, decision


def test_every_part_is_decided_with_its_reason(qwen3_next):
    spec, _, decision = qwen3_next
    moe_layers = [layer.index for layer in spec.layers if layer.mlp.kind == "moe"]
    assert sorted(i for e in decision.moe for i in e.layers) == moe_layers
    assert all(e.takes == "block" and e.why is None and e.target == "moe:mlp" for e in decision.moe)
    linear = [layer.index for layer in spec.layers if layer.attention.kind.startswith("linear:")]
    swapped = decision.swapped_attention()
    assert [e.takes for e in swapped] == ["linear"] and swapped[0].layers == linear
    assert swapped[0].cores == ["causal_conv1d", "chunk_gated_delta"]
    # softmax attention has nothing to take and nothing to explain
    assert all(e.takes is None and e.why is None for e in decision.attention if e.kind == "softmax")
    assert decision.loss.takes and decision.loss.head == "lm_head" and decision.loss.decoder == "model"


def test_trial_swaps_run_once_per_distinct_twin_layer(qwen3_next, monkeypatch):
    spec, twin, _ = qwen3_next
    calls = []
    real = attention.swap_linear_core

    def counted(module, **kwargs):
        calls.append(module)
        return real(module, **kwargs)

    monkeypatch.setattr(attention, "swap_linear_core", counted)
    decision = decide(spec, twin)
    twin_layers = {layer.twin_layer for layer in spec.layers if layer.attention.kind.startswith("linear:")}
    assert len(calls) == len(twin_layers) < sum(len(e.layers) for e in decision.swapped_attention())
    # each trial was undone: the twin is HuggingFace code again
    assert not any("forward" in vars(m) for m in twin.model.modules())


def test_json_round_trip_and_schema_version(qwen3_next):
    _, _, decision = qwen3_next
    text = decision.to_json()
    back = Decision.from_json(text)
    assert back == decision and back.to_json() == text
    data = json.loads(text)
    assert data["moe"][0]["takes"] == "block"  # derived fields are written for readers of the file
    with pytest.raises(ValueError, match="schema version"):
        Decision.from_dict({**data, "schema_version": SCHEMA_VERSION + 1})


def test_refusals_fall_back_block_to_experts_to_nothing(qwen3_next):
    _, _, decided = qwen3_next
    decision = Decision.from_json(decided.to_json())  # a copy: the fixture is shared
    entry = decision.moe[0]
    decision.refuse("moe:mlp", "the block did not verify")
    assert entry.takes == "experts" and entry.why == "the block did not verify"
    assert entry.target == "experts:mlp.experts" and entry.path == "mlp.experts"
    decision.refuse(entry.target, "the experts did not verify either")
    assert entry.takes is None and decision.kept_moe()[entry.layers[0]] == "the block did not verify"
    path = decision.swapped_attention()[0].path
    decision.refuse(f"attention:{path}", "no")
    assert not decision.swapped_attention() and all("no" in why for why in decision.kept_attention().values())
    decision.refuse("loss", "the loss did not verify")
    assert not decision.loss.takes and decision.loss.why == "the loss did not verify"
    assert set(decision.refused) == {"moe:mlp", "experts:mlp.experts", f"attention:{path}", "loss"}
    assert Decision.from_json(decision.to_json()) == decision
    with pytest.raises(ValueError, match="nothing in this decision"):
        decision.refuse("loss", "twice")
    with pytest.raises(ValueError, match="nothing in this decision"):
        decision.refuse("moe:no.such.block", "x")


def test_expected_swaps_follow_the_twin_depth(qwen3_next):
    spec, twin, decision = qwen3_next
    depth = len(twin.model.get_submodule(twin.layers_path))
    expected = {kind: sum(1 for i in layers if i < depth) for kind, layers in decision.taken().swaps.items()}
    assert expected["moe_block"] == sum(1 for layer in spec.layers if layer.mlp.kind == "moe" and layer.index < depth)
    assert expected["linear_core"] == sum(1 for layer in spec.layers
                                          if layer.attention.kind.startswith("linear:") and layer.index < depth)
    assert expected["loss"] == 1 and expected["experts"] == expected["sparse_attention"] == 0


def test_suspects_come_in_the_order_to_give_them_back_and_refusals_can_be_taken_back(twin_adapter, tmp_path):
    """Readings only verification can confirm first (identity experts, then the loss), then whole blocks; a
    refusal taken back restores the part exactly."""
    from onboard.review.families import default_config

    config = default_config("longcat_flash")
    _, _, decision, _ = twin_adapter(tmp_path, family="longcat_flash")
    before = decision.to_json()
    suspects = decision.suspects()
    assert suspects[0].startswith("moe:") and suspects[1] == "loss"
    zero = decision.reading(suspects[0])
    assert "identity (zero) experts" in zero and str(config.zero_expert_num) in zero
    assert decision.reading("loss").startswith("computing the loss")
    decision.refuse(suspects[0], "no")
    assert suspects[0] not in decision.suspects()
    decision.admit(suspects[0])
    assert decision.to_json() == before
    with pytest.raises(ValueError, match="was not refused"):
        decision.admit("loss")


def _verdict(passed: bool, note: str = "") -> Verification:
    tolerances = {"logits_rtol": 1e-4, "loss_rtol": 1e-5, "grad_rtol": 1e-3, "grad_atol": 1e-6, "err_factor": 10.0,
                  "err_floor": 1e-6}
    return Verification(passed, 0, 0, [], tolerances, note)


def test_the_trials_give_back_what_fails_then_take_back_what_was_not_needed(qwen3_next):
    """`onboard.adapt.settle.trials` decides each trial from the last verification: while the bundle fails it gives
    back the first suspect (recording why), and once it passes it takes back each refusal but the last; a refusal
    that was needed is made again and the bundle that verified rendered once more."""
    _, _, decided = qwen3_next
    decision = Decision.from_json(decided.to_json())  # the fixture's decision stays as decided
    first, second = decision.suspects()[:2]
    reading = decision.reading(first)
    trial = trials(decision, None, None, None)
    taken = next(trial)
    assert taken.loss.takes and taken.swaps == decision.taken().swaps
    taken = trial.send(_verdict(False, "planted one"))
    assert decision.refused == {first: f"{reading} did not verify (planted one)"}
    assert first not in decision.suspects()
    taken = trial.send(_verdict(False, "planted two"))
    assert list(decision.refused) == [first, second]
    taken = trial.send(_verdict(True))  # passes without both: is the first refusal needed?
    assert list(decision.refused) == [second] and first in decision.suspects()
    taken = trial.send(_verdict(False, "still needed"))  # it was: refused again, with its first reason
    assert list(decision.refused) == [second, first] and "planted one" in decision.refused[first]
    restored = _verdict(True, "the bundle that verified, rendered again")
    with pytest.raises(StopIteration) as settled:
        trial.send(restored)
    assert settled.value.value is restored


def test_a_bundle_that_never_verifies_gives_back_everything_and_keeps_the_last_failure(qwen3_next):
    _, _, decided = qwen3_next
    decision = Decision.from_json(decided.to_json())
    trial = trials(decision, None, None, None)
    next(trial)
    last = None
    with pytest.raises(StopIteration) as settled:
        for i in range(20):
            last = _verdict(False, f"failure {i}")
            taken = trial.send(last)
    assert settled.value.value is last and not decision.suspects()
    assert not taken.moe and not taken.attention and not taken.loss.takes


def test_review_says_nothing_was_generated_when_no_candidate_passed(qwen3_next):
    """REVIEW.md of an agent's bundle in which every leftover stays HuggingFace code says so, with each round's
    reason, and does not claim that generated/ holds files that passed; once one passes, it says what is there."""
    from onboard.adapt.codegen import render_review
    from onboard.adapt.decision import GeneratedEntry

    spec, twin, decided = qwen3_next
    decision = Decision.from_json(decided.to_json())
    rounds = [{"round": 1, "reading": "llm", "hypothesis": "a scale", "outcome": "failed the probe: wrong outputs"}]
    decision.generated.append(GeneratedEntry([0, 4], "mixer", "", "Mixer", "llm", "", "", rounds=rounds,
                                             refused="no candidate passed in 1 round(s)"))
    size = {"hidden": twin.hidden_size, "layers": len(twin.layer_signatures)}
    review = render_review(spec, decision, _verdict(True), size)
    assert "nothing was generated" in review and "What it wrote is in `generated/`" not in review
    assert "round 1 (llm): failed the probe: wrong outputs" in review
    decision.generated[0].file, decision.generated[0].refused = "mixer.py", None
    review = render_review(spec, decision, _verdict(True), size)
    assert "nothing was generated" not in review and "What it wrote is in `generated/`" in review


def test_a_refusal_names_the_check_that_failed():
    """Issue 36: a reading whose figures were within tolerance but whose replaced block still ran was refused as
    "did not verify (max relative logits difference 2.0e-07, loss 0.0e+00)"; the reason now names the check."""
    from onboard.adapt.settle import failure_detail
    from onboard.adapt.verify import SeedResult

    def seed(i, **kw):
        fields = dict(seed=i, logits_max_abs=0.0, logits_max_rel=2e-7, loss_ref=6.25, loss_adapted=6.25, kl=0.0,
                      grads_checked=9, grad_worst_rel=1e-7, grad_worst_param="model.norm.weight", passed=False)
        return SeedResult(**{**fields, **kw})

    still_ran = Verification(False, 1, 1, [seed(0, original_calls=4)], {})
    assert "HuggingFace code it replaces still ran (4 calls)" in failure_detail(still_ran)
    assert "logits difference" not in failure_detail(still_ran)
    gradient = Verification(False, 1, 1, [seed(0, passed=True), seed(1, grad_failures=["model.x.A_log: error 0.1",
                                                                                         "model.y: error 1"])], {})
    assert failure_detail(gradient) == "seed 1: model.x.A_log: error 0.1 and 1 more"
    counts = Verification(False, 0, 1, [seed(0, passed=True)], {}, "adapter made 0 moe_block swaps, expected 1")
    assert failure_detail(counts) == "adapter made 0 moe_block swaps, expected 1"
