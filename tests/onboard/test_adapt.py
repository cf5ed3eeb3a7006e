"""`onboard adapt`: bundles verify against HuggingFace, planted bugs are caught, writes are safe."""

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from onboard.adapt.decision import decide
from onboard.adapt.verify import verify
from onboard.bundle.files import FILES, load_adapter, read_decision
from onboard.bundle.make import adapt
from onboard.inspect.capture import capture
from onboard.inspect.inspection import build_spec
from onboard.source import resolve
from onboard.twin import Twin
from tests.helpers import run_cli, verify_rendered

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("model", ["deepseek-v3", "qwen3-next-80b-a3b", "gpt-oss-120b", "mixtral-8x7b"])
def test_catalogue_models_adapt_and_verify(model, tmp_path):
    spec, result = adapt(resolve(model), tmp_path / "bundle")
    assert result.passed, result.note or [r.grad_failures for r in result.seeds]
    assert result.replaced == result.expected >= 1
    assert all(r.runtime_calls == result.replaced and r.original_calls == 0 for r in result.seeds)
    files = sorted(p.name for p in (tmp_path / "bundle").iterdir())
    assert files == sorted(FILES)
    review = (tmp_path / "bundle" / "REVIEW.md").read_text()
    assert "PASSED" in review and "runtime.moe.MoEBlock" in review


def test_adapter_imports_only_runtime_torch_transformers(tmp_path):
    adapt(resolve("olmoe-1b-7b"), tmp_path / "b")
    source = (tmp_path / "b" / "adapter.py").read_text()
    imports = {line.split()[1].split(".")[0] for line in source.splitlines() if line.startswith(("import ", "from "))}
    assert imports <= {"json", "pathlib", "torch", "transformers", "runtime"}
    module = load_adapter(tmp_path / "b")
    assert module.SPEC["model_type"] == "olmoe" and callable(module.adapt)


def test_parameters_are_reused_not_copied(tmp_path):
    adapt(resolve("qwen3-30b-a3b"), tmp_path / "b")
    module = load_adapter(tmp_path / "b")
    twin = Twin.build(resolve("qwen3-30b-a3b"))
    before = {name: p for name, p in twin.model.named_parameters()}
    swaps = module.adapt(twin.model)
    after = {id(p) for p in twin.model.parameters()}
    assert {id(p) for p in before.values()} == after
    assert [s.kind for s in swaps] == ["moe_block", "loss"]
    # undone, the model is HuggingFace code again: its own blocks, the same parameters
    swaps.undo()
    assert {name: p for name, p in twin.model.named_parameters()} == before
    assert not any(type(m).__module__.startswith("runtime.") for m in twin.model.modules())


def test_regeneration_is_byte_identical(tmp_path):
    adapt(resolve("mixtral-8x7b"), tmp_path / "one")
    adapt(resolve("mixtral-8x7b"), tmp_path / "two")
    for name in ("spec.json", "decision.json", "adapter.py", "kernels.json", "source.json", "plan.json", "train.sh"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()


@pytest.fixture(scope="module")
def deepseek():
    source = resolve("deepseek-v3")
    twin = Twin.build(source)
    spec = build_spec(twin, capture(twin))
    return spec, twin, decide(spec, twin)


def _verify_rendered(deepseek, tmp_path):
    """Render DeepSeek-V3's adapter and verify it with whatever runtime is in place now."""
    return verify_rendered(*deepseek, tmp_path)


def _planted(deepseek, tmp_path, monkeypatch, target: str, broken):
    """Adapt with one runtime function replaced by a broken version; verification must fail."""
    owner, _, name = target.rpartition(".")
    monkeypatch.setattr(sys.modules[owner], name, broken)
    return _verify_rendered(deepseek, tmp_path)


def test_planted_wrong_renormalisation(deepseek, tmp_path, monkeypatch):
    from runtime.moe.router import route as good

    def no_renorm(logits, spec, bias=None):
        return good(logits, spec.__class__(**{**spec.__dict__, "renormalize": False}), bias)

    assert not _planted(deepseek, tmp_path, monkeypatch, "runtime.moe.block.route", no_renorm).passed


def test_planted_gate_up_swapped(deepseek, tmp_path, monkeypatch):
    from runtime.moe.block import GroupedExperts

    def swapped(self, x, d, scale=None):
        up, gate = self._mm(x, "gate_up", d).chunk(2, dim=-1)
        return self._mm(self.activation(gate) * up * scale.unsqueeze(-1), "down", d)

    monkeypatch.setattr(GroupedExperts, "forward", swapped)
    assert not _verify_rendered(deepseek, tmp_path).passed


def test_planted_dropped_shared_expert(deepseek, tmp_path, monkeypatch):
    from runtime.moe.block import MoEBlock

    original = MoEBlock.__init__

    def without_shared(self, *args, **kwargs):
        kwargs["shared"] = []
        original(self, *args, **kwargs)

    monkeypatch.setattr(MoEBlock, "__init__", without_shared)
    assert not _verify_rendered(deepseek, tmp_path).passed


def test_planted_wrong_bias_sign(deepseek, tmp_path, monkeypatch):
    from runtime.moe.router import route as good

    def flipped(logits, spec, bias=None):
        return good(logits, spec, None if bias is None else -bias)

    assert not _planted(deepseek, tmp_path, monkeypatch, "runtime.moe.block.route", flipped).passed


def test_the_good_runtime_passes_the_same_harness(deepseek, tmp_path, monkeypatch):
    from runtime.moe.router import route as good

    assert _planted(deepseek, tmp_path, monkeypatch, "runtime.moe.block.route", good).passed


def test_dense_model_gives_bundle_with_nothing_replaced(tmp_path):
    """A dense model: no MoE block to swap, said plainly; only its loss runs in the runtime."""
    spec, result = adapt(resolve("qwen3-8b"), tmp_path / "b")
    assert result.passed and result.replaced == result.expected == 0
    assert "no MoE block" in result.note
    assert all(r.runtime_loss_calls == 1 and r.runtime_calls == 0 for r in result.seeds)
    review = (tmp_path / "b" / "REVIEW.md").read_text()
    assert "No MoE block" in review and "LM head + loss" in review


def _cli(*args):
    """`onboard ARGS` in this process (`tests.helpers.run_cli`)."""
    return run_cli(*args)


def test_existing_bundle_needs_force_and_is_not_touched(tmp_path):
    out = tmp_path / "b"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    result = _cli("adapt", "olmoe-1b-7b", "--out", str(out))
    assert result.returncode != 0 and "--force" in result.stderr and "Traceback" not in result.stderr
    assert (out / "mine.txt").read_text() == "keep me"
    assert [p.name for p in tmp_path.iterdir()] == ["b"]  # no staging directory left behind


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_out(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    result = _cli("adapt", "olmoe-1b-7b", "--out", str(locked / "b"))
    assert result.returncode != 0 and "cannot write" in result.stderr


def test_out_under_a_file_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = _cli("adapt", "olmoe-1b-7b", "--out", str(blocker / "b"))
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert blocker.read_text() == "x"


def test_cli_adapt_then_verify(tmp_path):
    out = tmp_path / "b"
    result = _cli("adapt", "qwen3-30b-a3b", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "verification PASSED" in result.stdout
    again = _cli("verify", str(out))
    assert again.returncode == 0 and "PASSED" in again.stdout
    data = json.loads((out / "verification.json").read_text())
    assert data["passed"] and len(data["seeds"]) == 3
    # verify reads what adapt decided; a bundle without its decision is refused in one line
    (out / "decision.json").unlink()
    refused = _cli("verify", str(out))
    assert refused.returncode != 0 and "decision.json" in refused.stderr and "Traceback" not in refused.stderr


def test_zero_experts_are_identity_slots(family_bundle):
    """LongCat-Flash routes over real and zero (identity) experts: the runtime takes the reading and verifies."""
    spec, result, _ = family_bundle("longcat_flash")
    moe = next(layer.mlp for layer in spec.layers if layer.mlp.kind == "moe")
    assert moe.zero_experts == 256 and moe.num_experts == 512
    assert result.passed and result.replaced == result.expected >= 1


def test_a_reading_that_does_not_verify_is_dropped(family_bundle):
    """Inkling's router also scores its shared experts: read as identity experts it fails verification,
    so the bundle keeps those blocks and their routing as HuggingFace code, says why, and takes over only
    the experts."""
    spec, result, bundle = family_bundle("inkling_text")
    decision = read_decision(bundle)
    partial = [e for e in decision.moe if e.takes == "experts"]
    assert decision.refused and all(t.startswith("moe:") and "did not verify" in why
                                    for t, why in decision.refused.items())
    assert partial and all("did not verify" in e.why for e in partial)
    assert result.passed and result.replaced == result.expected > 0
    assert all(r.original_calls == 0 and r.runtime_calls > 0 for r in result.seeds)
    review = (bundle / "REVIEW.md").read_text()
    assert "did not verify" in review and "runtime.moe.RoutedExperts" in review
    # its head input is divided by logits_mup_width_multiplier in the causal-LM forward: read as a logit scale,
    # the loss runs in the runtime and verifies
    assert spec.head["logit_scale"] == pytest.approx(1 / spec_config(spec, "logits_mup_width_multiplier"))
    assert decision.loss.takes and all(r.runtime_loss_calls == 1 for r in result.seeds)


def spec_config(spec, name):
    from onboard.review.families import default_config

    return getattr(default_config(spec.model_type), name)


@pytest.mark.parametrize("family", ["phimoe", "zaya"])
def test_routers_the_runtime_cannot_reproduce_keep_routing_and_swap_experts(family, family_bundle):
    """PhiMoE's sparse mixer and ZAYA's router network stay HuggingFace code; their experts run in the runtime."""
    spec, result, bundle = family_bundle(family)
    decision = read_decision(bundle)
    assert {e.takes for e in decision.moe} == {"experts"} and all(e.why for e in decision.moe)
    assert result.passed and result.replaced == result.expected > 0
    assert result.swaps["experts"] == {"expected": result.expected, "made": result.expected}
    assert all(r.original_calls == 0 and r.runtime_calls > 0 for r in result.seeds)
    assert "RoutedExperts(experts)" in (bundle / "adapter.py").read_text()


def test_hash_routed_layers_are_reproduced(family_bundle):
    """DeepSeek-V4's first MoE layers pick experts from a token-id table: read from the graph, reproduced."""
    spec, result, _ = family_bundle("deepseek_v4")
    static = [layer.mlp for layer in spec.layers if layer.mlp.kind == "moe" and layer.mlp.router.order == "static"]
    assert static and static[0].router.table.endswith("tid2eid") and static[0].router.token_input == "input_ids"
    assert static[0].router.score == "sqrtsoftplus"
    assert result.passed and result.replaced == result.expected == 5


@pytest.mark.parametrize("family", ["mixtral", "minimax", "jetmoe"])
def test_router_auxiliary_loss_is_kept(family, family_bundle):
    """With router logits requested, the adapted model's auxiliary loss equals HuggingFace's: the model's own
    router module still runs (under its own name) when something records it."""
    from onboard.review.families import default_config
    from onboard.source import from_config

    source = from_config(default_config(family), family)
    _, result, bundle = family_bundle(family)
    assert result.passed and result.aux_loss and result.aux_loss["passed"]
    assert result.aux_loss["hf"] == pytest.approx(result.aux_loss["adapted"], rel=1e-5)
    # ... and only then: a forward that records nothing does not run it (the recorders are attached at adapt)
    model = Twin.build(source).model
    load_adapter(bundle).adapt(model)
    routers = [getattr(block, block.router_name) for block in model.modules() if getattr(block, "router_name", None)]
    ran = []
    for router in routers:
        router.register_forward_pre_hook(lambda *_: ran.append(1))
    batch = {k: v for k, v in Twin.build(source).example_batch(0).items() if k != "labels"}
    model(**batch, use_cache=False)
    assert routers and not ran
    model(**batch, use_cache=False, output_router_logits=True)
    assert ran


def test_head_is_captured_when_the_model_reads_class_attributes_of_its_layers(family_bundle):
    """Inkling2's model forward reads `decoder_layer.attention_type`, a class attribute: the stand-in layers of the
    head capture carry it, so the head, its soft cap and the loss are found and the loss is swapped."""
    from onboard.review.families import default_config

    spec, _, bundle = family_bundle("inkling2_text")
    assert spec.head["captured"] and spec.head["loss"] == "cross_entropy"
    assert spec.head["logit_softcap"] == pytest.approx(default_config("inkling2_text").final_logit_softcapping)
    loss = read_decision(bundle).loss
    assert loss.takes and loss.why is None and loss.softcap == spec.head["logit_softcap"]


def test_missing_parent_folders_of_out_are_created(tmp_path):
    """`onboard adapt MODEL` writes to bundles/<model> by default: on a fresh checkout bundles/ does not exist."""
    out = tmp_path / "bundles" / "nested" / "b"
    result = _cli("adapt", "olmoe-1b-7b", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert (out / "REVIEW.md").is_file() and (out / "adapter.py").is_file()


def test_a_swap_that_never_runs_fails_verification(deepseek, tmp_path):
    """Verification reads the handles: a swap the adapter reports but that never runs (undone behind its back,
    so the HuggingFace block runs instead) fails, and the note names it."""
    from onboard.adapt.codegen import render_adapter

    spec, twin, decision = deepseek
    (tmp_path / "spec.json").write_text(spec.to_json())
    (tmp_path / "adapter.py").write_text(render_adapter(spec, decision.taken()))
    adapter = load_adapter(tmp_path)

    def undone_behind_its_back(model, **kwargs):
        swaps = adapter.adapt(model, **kwargs)
        swaps.of("moe_block")[0].undo()
        return swaps

    result = verify(spec, twin, undone_behind_its_back, decision.taken(), seeds=(0,))
    assert not result.passed and "swapped but never run: model.layers." in result.note
    assert result.seeds[0].original_calls > 0


def _deepseek_v2_greedy():
    """DeepSeek-V2 as it was released: group-limited greedy routing (a group scored by its best expert)."""
    from onboard.review.families import default_config
    from onboard.source import from_config

    config = default_config("deepseek_v2")
    config.topk_method, config.n_group, config.topk_group = "group_limited_greedy", 4, 2
    return from_config(config, "deepseek_v2")


def test_group_limited_greedy_routing_is_read_and_reproduced(tmp_path):
    """The group score is read from the graph (a max over each group: its best one expert), so the whole block
    runs in the runtime and verifies."""
    spec, result = adapt(_deepseek_v2_greedy(), tmp_path / "b")
    routers = {(layer.mlp.router.n_group, layer.mlp.router.topk_group, layer.mlp.router.group_score_top)
               for layer in spec.layers if layer.mlp.kind == "moe"}
    assert routers == {(4, 2, 1)}
    assert result.passed and not read_decision(tmp_path / "b").refused
    assert result.swaps["moe_block"]["made"] == result.expected > 0


def test_a_reading_that_does_not_verify_falls_back_to_what_does(tmp_path, monkeypatch):
    """With the group score planted wrong (the sum of the best two, DeepSeek-V3's), the whole-block reading fails
    verification: adapt gives the block back, keeps the model's router, runs the experts alone, verifies, and
    records why; the loss, which was not at fault, stays in the runtime."""
    import onboard.inspect.patterns.moe as moe_patterns

    real = moe_patterns.Router

    def v3_scoring(*args, **kwargs):
        router = real(*args, **kwargs)
        router.group_score_top = 2 if router.group_limited else router.group_score_top
        return router

    monkeypatch.setattr(moe_patterns, "Router", v3_scoring)
    _, result = adapt(_deepseek_v2_greedy(), tmp_path / "b")
    decision = read_decision(tmp_path / "b")
    assert result.passed and list(decision.refused) == ["moe:mlp"]
    assert "did not verify" in decision.refused["moe:mlp"] and "group-limited" in decision.refused["moe:mlp"]
    assert {e.takes for e in decision.moe} == {"experts"} and decision.loss.takes
    assert "did not verify" in (tmp_path / "b" / "REVIEW.md").read_text()
