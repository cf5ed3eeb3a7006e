"""Issue 37 item 1: what an MoE layer costs beyond its FLOPs (`predictors.moe_cost`), one behaviour per test, each
against its published figure or a planted change that must move it."""

import dataclasses

import numpy as np
import pytest

from predictors import costmodel, moe_cost, pipeline
from predictors.costmodel import estimate
from predictors.hardware import find
from runtime.dims import Dims
from runtime.plan import LoRA, Plan

FINE = {"name": "fine", "layers": 8, "hidden": 2048, "heads": 16, "kv_heads": 4, "head_dim": 128, "ffn": 8192,
        "vocab": 32000, "experts": 128, "top_k": 8, "expert_ffn": 768, "shared_experts": 0, "moe_layers": 8}


def test_small_gemms_follow_the_published_grouped_gemm_curve():
    """DeepGEMM's H800 FP8 table (moe_cost.M_FILL's comment): grouped GEMMs at N = 4096, K = 7168 reach 0.69, 0.77
    and 0.92 of the 4096-8192-row rate at 256, 512 and 1024 rows per expert; its dense GEMMs at M = 4096 reach 0.53,
    0.79 and 0.82 of the K = 16384 rate at K = 512, 1536, 2048, and N = 2112 reaches 0.80 of N = 4096. The model's
    curve stays within 0.06 of each."""
    hw = find("H800")
    eff = lambda m, n, k: moe_cost.gemm_efficiency(m, k, n, hw, "fp8")  # noqa: E731
    for rows, share in ((256, 0.69), (512, 0.77), (1024, 0.92)):
        assert eff(rows, 4096, 7168) / eff(8192, 4096, 7168) == pytest.approx(share, abs=0.06), rows
    for depth, share in ((512, 0.53), (1536, 0.79), (2048, 0.82)):
        assert eff(4096, 7168, depth) / eff(4096, 7168, 16384) == pytest.approx(share, abs=0.06), depth
    assert eff(4096, 2112, 7168) / eff(4096, 4096, 7168) == pytest.approx(1009 / 1265, abs=0.02)
    # below the ridge a GEMM waits on memory: few rows against a big weight matrix
    assert eff(8, 4096, 7168) < 8 / (8 + moe_cost.M_FILL) * 0.5


def test_fewer_tokens_per_expert_or_narrower_experts_run_slower():
    d, hw = Dims.from_record(FINE), find("H100")
    base = Plan(dp_shard=8, ep=8, seq_len=4096, micro_batch=1)
    # ep gathers the group's tokens for each local expert: more rows per GEMM
    assert moe_cost.local_gemm(d, base)[0] == 4096 * 8 * 8 / 128
    assert moe_cost.expert_efficiency(d, dataclasses.replace(base, ep=1), hw) < moe_cost.expert_efficiency(d, base, hw)
    wide = Dims.from_record({**FINE, "experts": 32, "top_k": 2, "expert_ffn": 3072})  # the same active FLOPs
    assert wide.routed_flops_per_token() == d.routed_flops_per_token()
    assert moe_cost.expert_efficiency(wide, base, hw) > moe_cost.expert_efficiency(d, base, hw)
    # the cost model charges the difference as the experts' GEMM time, nothing else
    fine, coarse = estimate(d, base, hw), estimate(wide, base, hw)
    assert fine.expert_gemm_s > coarse.expert_gemm_s >= 0  # wide experts run as well as the dense GEMMs
    assert fine.compute_s == pytest.approx(coarse.compute_s, rel=1e-2)  # (the routers differ: 128 or 32 logits)
    # LoRA freezes the experts: no weight gradients, whose depth is the few tokens each expert gets (256 here)
    few = dataclasses.replace(base, ep=1)
    lora = dataclasses.replace(few, lora=LoRA(rank=8, alpha=16, targets=("attention",)))
    assert moe_cost.expert_efficiency(d, lora, hw) > moe_cost.expert_efficiency(d, few, hw)
    # a model whose every GEMM is small (the CPU twins) is not charged twice: relative to its own dense GEMMs
    assert moe_cost.expert_efficiency(d, base, find("cpu"), "fp32") <= 1.0


def test_the_exchange_is_priced_by_where_the_group_s_peers_are():
    """Inside an HGX board all of an EP group's peers are on NVLink; two boards send half over the NIC, which sets
    the pace; an NVL72 rack keeps 64 ranks on NVLink."""
    h100, gb200 = find("H100"), find("GB200")
    sent = 1e9
    eight = moe_cost.all_to_all_s(sent, 8, 1, h100)
    assert eight == pytest.approx(sent * 7 / 8 / (h100.scale_up_gbs * moe_cost.A2A_SCALE_UP_SHARE * 1e9))
    sixteen = moe_cost.all_to_all_s(sent, 16, 1, h100)
    assert sixteen == pytest.approx(sent * 8 / 16 / (h100.scale_out_gbs * 1e9))
    # the same 16 ranks tp = 2 apart span 32 devices: only 4 per board
    assert moe_cost.all_to_all_s(sent, 16, 2, h100) == pytest.approx(sent * 12 / 16 / (h100.scale_out_gbs * 1e9))
    rack = moe_cost.all_to_all_s(sent, 64, 1, gb200)
    assert rack == pytest.approx(sent * 63 / 64 / (gb200.scale_up_gbs * moe_cost.A2A_SCALE_UP_SHARE * 1e9))
    assert moe_cost.all_to_all_s(sent, 1, 1, h100) == 0.0
    # in the step: dispatch and combine, forward and backward, every MoE layer, the busiest rank's share
    d = Dims.from_record(FINE)
    plan = Plan(dp_shard=16, ep=16, seq_len=4096, overlap=False)
    est = estimate(d, plan, h100, imbalance=1.5)
    per_token = 4 * moe_cost.all_to_all_s(d.top_k * d.hidden * 2 * 1.5, 16, 1, h100)
    assert est.ep_s == pytest.approx(per_token * 4096 * d.moe_layers)


def test_overlap_hides_what_the_runtime_hides_and_no_more():
    d, hw = Dims.from_record(FINE), find("H100")
    waits = estimate(d, Plan(dp_shard=16, ep=16, seq_len=4096, overlap=False), hw)
    hides = estimate(d, Plan(dp_shard=16, ep=16, seq_len=4096, overlap=True), hw)
    assert waits.ep_s == pytest.approx(hides.ep_s)
    assert waits.step_time_s - hides.step_time_s == pytest.approx(moe_cost.RUNTIME_OVERLAP * waits.ep_s)


def test_routing_and_permutation_are_priced_as_memory_traffic():
    d, hw = Dims.from_record(FINE), find("H100")
    plan = Plan(dp_shard=8, ep=8, seq_len=4096, micro_batch=2, grad_accum=3)
    est = estimate(d, plan, hw)
    per_pass = 2 * (d.top_k + 1) * d.hidden * 2 + 4 * d.experts * 4
    assert moe_cost.permutation_bytes(d, 2) == 2 * per_pass
    tokens = 2 * 4096 * 3
    assert est.permute_s == pytest.approx(tokens * d.moe_layers * 2 * per_pass / (hw.memory_bw_gbs * 1e9))
    full = estimate(d, dataclasses.replace(plan, recompute="full"), hw)
    assert full.permute_s == pytest.approx(est.permute_s * 3 / 2)  # the recomputed forward permutes again


def test_routing_buffers_count_in_the_fit_check(monkeypatch):
    """Planted: without moe_cost.activation_bytes the activations shrink by exactly its saved bytes per MoE layer
    and its exchange buffers for the layer in flight."""
    d, hw = Dims.from_record(FINE), find("H100")
    plan = Plan(dp_shard=8, ep=8, seq_len=4096, micro_batch=2)
    with_routing = estimate(d, plan, hw).memory["activations"]
    saved, in_flight = moe_cost.activation_bytes(d)
    assert saved == d.experts * 4 + d.top_k * 12 and in_flight == 2 * d.top_k * d.hidden * 2
    monkeypatch.setattr(moe_cost, "activation_bytes", lambda d: (0.0, 0.0))
    without = estimate(d, plan, hw).memory["activations"]
    tokens = 2 * 4096
    assert with_routing - without == pytest.approx(tokens * (saved * d.layers + saved + in_flight))


def test_pipeline_stages_are_balanced_with_the_moe_layers_costs():
    """A stack of dense and MoE layers: priced with what its MoE layers cost beyond their FLOPs, the balanced cut
    gives the MoE layers' stage fewer layers, and the planner prices its stages the same way."""
    from runtime.dims import Mixer

    d = dataclasses.replace(Dims.from_record({**FINE, "moe_layers": 4}),
                            mixers=(Mixer("softmax", 8, heads=16, head_dim=128),),
                            stack=tuple((0, i >= 4) for i in range(8)))
    flat = pipeline.layers_per_stage(d, 2, 4096)
    heavy = pipeline.layers_per_stage(d, 2, 4096, moe_extra=d.layer_flops(4096)[-1])
    assert sum(heavy) == 8 and heavy[1] < flat[1]
    plan = Plan(pp=2, dp_shard=8, ep=8, grad_accum=8, seq_len=4096)
    extra = costmodel.moe_extra_flops(d, plan, find("H100"))
    assert extra > 0
    assert pipeline.share(d, dataclasses.replace(plan, pp_layers=pipeline.layers_per_stage(d, 2, 4096, extra)),
                          extra) <= pipeline.share(d, dataclasses.replace(plan, pp_layers=flat), extra)


def test_fp8_pays_for_casting_its_operands():
    d, hw = Dims.from_record(FINE), find("H100")
    plan = Plan(dp_shard=8, ep=8, seq_len=4096)
    bf16, fp8 = estimate(d, plan, hw, "bf16"), estimate(d, plan, hw, "fp8")
    cast = 4096 * costmodel.fp8_cast_bytes_per_token(d) * d.layers / (hw.memory_bw_gbs * 1e9)
    assert fp8.memory_s - bf16.memory_s == pytest.approx(cast)
    assert cast > 0 and np.isfinite(fp8.step_time_s)


# -- the learned predictor on MoE runs (issue 37 items 2-4) ------------------------------------------------------
def test_a_far_moe_run_falls_back_to_what_moe_runs_needed_and_a_dense_one_to_the_cost_model():
    """`Fallback`: the least of its sources' median corrections over their accelerator MoE runs when they all lean
    the same way, else none (dense and CPU runs do not move it); a far accelerator MoE run takes it, a far dense or
    CPU run none."""
    from predictors import learned
    from predictors.features import FEATURES

    X = np.zeros((7, len(FEATURES)))
    X[:5, FEATURES.index("log_tokens_per_expert")] = 5.0
    X[4, FEATURES.index("host_computes")] = 1.0  # a CPU MoE run
    target = np.array([0.1, 0.2, 0.3, 0.9, -2.0, 5.0, 5.0])  # the last two are dense
    sources = ["a", "a", "b", "b", "cpu", "a", "b"]
    fb = learned.Fallback.fit(X, target, sources)
    assert fb.moe == pytest.approx(0.15)  # source a needed 0.15 (0.1, 0.2), source b 0.6 (0.3, 0.9): the least
    assert fb.of(X).tolist() == pytest.approx([0.15] * 4 + [0.0] * 3)
    assert learned.Fallback.fit(X, target, ["a"] * 7).moe == pytest.approx(0.25)  # one source: its median
    assert learned.Fallback.fit(X[5:], target[5:], sources[5:]).moe == 0.0  # no MoE runs: the cost model
    disagree = np.array([0.1, 0.2, -0.3, -0.9, -2.0, 5.0, 5.0])  # a leans slow, b fast: no shared correction
    assert learned.Fallback.fit(X, disagree, sources).moe == 0.0
    # far from every training run (weight 0) the multiplier is the fallback's; near (weight 1) the trees'
    assert learned.shrunk(np.array([0.5]), np.array([0.0]), 0.3)[0] == pytest.approx(np.exp(0.3))
    assert learned.shrunk(np.array([0.5]), np.array([1.0]), 0.3)[0] == pytest.approx(np.exp(0.5))
    # the bundled version carries it, and a far MoE plan's correction is its multiplier
    model = learned.load()
    assert model.fallback is not None and model.fallback.moe > 0
    far = np.zeros((1, len(FEATURES)))
    far[0, FEATURES.index("log_tokens_per_expert")] = 5.0
    far[0, FEATURES.index("log_cost_step")] = 1e3  # nothing like a training run
    assert model.correction(far)[0] == pytest.approx(np.exp(model.fallback.moe))


def test_the_evaluation_reports_moe_runs_by_model_and_the_interval_coverage(tmp_path):
    """Held out by source: per source, the MoE runs by model and together, all runs, each with the share of runs
    inside the 90 % interval calibrated without their source; --measured-only leaves out the assumed runs."""
    from predictors import learned
    from predictors.learned import DATA_DIR

    moe_lines = (DATA_DIR / "published_moe_runs.jsonl").read_text().splitlines()
    dense_lines = (DATA_DIR / "published_runs.jsonl").read_text().splitlines()[:120]
    path = tmp_path / "runs.jsonl"
    path.write_text("\n".join(moe_lines + dense_lines) + "\n")
    scores, data = learned.evaluate([path], by="source")
    kinds = {s.kind for s in scores}
    assert kinds == {"source", "model", "moe", "all"} and scores[-1].kind == "all"
    moe = next(s for s in scores if s.kind == "moe")
    assert moe.runs == int(data.moe.sum()) > 100 and 0 <= moe.coverage <= 1
    assert all(s.coverage is not None for s in scores)
    assert sum(s.runs for s in scores if s.kind == "model") == moe.runs
    measured, kept = learned.evaluate([path], by="source", measured_only=True)
    assert data.assumed.any() and len(kept) == len(data) - int(data.assumed.sum())
    by_model, _ = learned.evaluate([path], by="model")
    assert all(s.coverage is None for s in by_model)  # coverage is measured held out by source only


def test_context_parallelism_prices_the_linear_cores_carry():
    """Issue 38 item 5: under cp a linear-attention core runs with K more value columns, about once more with K = V
    (`runtime.parallel.context.carry`); softmax layers pay the key / value exchange instead."""
    from runtime.dims import Mixer

    hybrid = dataclasses.replace(Dims.from_record({**FINE, "experts": 0, "moe_layers": 0}),
                                 mixers=(Mixer("linear:gated_deltanet", 6, heads=16, head_dim=128),
                                         Mixer("softmax", 2, heads=16, head_dim=128)))
    hw = find("H100")
    one = estimate(hybrid, Plan(dp_shard=4, seq_len=8192), hw)  # 4 sequences a step on 4 devices
    two = estimate(hybrid, Plan(dp_shard=4, cp=2, seq_len=8192), hw)  # the same 4 on 8, each split over 2
    carry = sum(m.flops(8192) for m in hybrid.mixers if m.linear)  # forward FLOPs per token
    assert carry > 0
    assert two.compute_s * 8 - one.compute_s * 4 == pytest.approx(4 * 8192 * 3 * carry / hw.matmul_rate("bf16"))
    assert two.cp_s > 0 and one.cp_s == 0
