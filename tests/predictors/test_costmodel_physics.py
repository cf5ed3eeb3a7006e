"""Issue 19 item 3: the cost model's physics changes, one test each (fast).

- full recompute reruns the forward's two tensor-parallel all-reduces (six per layer and micro-step, not four);
- under FP8 the linear layers run at the FP8 rate (at most `hardware.FP8_GEMM_SPEEDUP` times BF16's) and the
  attention core at the BF16 rate;
- a run that all-reduces its gradients after the whole backward (no bucketing) hides none of that traffic;
- the loss's passes over the logits are HBM traffic on the last stage, V / tp logits a token (issue 37).
"""

import dataclasses
import json

import pytest

from predictors import costmodel
from predictors.costmodel import estimate
from predictors.hardware import find
from runtime.dims import Dims
from runtime.plan import Plan


def _dense(hidden: int = 4096, layers: int = 32) -> Dims:
    return Dims.from_record({"name": "dense", "layers": layers, "hidden": hidden, "heads": 32, "kv_heads": 8,
                             "head_dim": hidden // 32, "ffn": 4 * hidden, "vocab": 32000})


def test_full_recompute_charges_the_recomputed_forwards_tensor_parallel_all_reduces():
    d, hw = _dense(), find("H100")
    plain = estimate(d, Plan(tp=8, dp_shard=1, seq_len=4096, micro_batch=1, grad_accum=4, recompute="none"), hw)
    full = estimate(d, Plan(tp=8, dp_shard=1, seq_len=4096, micro_batch=1, grad_accum=4, recompute="full"), hw)
    selective = estimate(d, Plan(tp=8, dp_shard=1, seq_len=4096, micro_batch=1, grad_accum=4,
                                 recompute="selective"), hw)
    assert full.tp_s == pytest.approx(plain.tp_s * 6 / 4)
    assert selective.tp_s == pytest.approx(plain.tp_s)  # the attention core reruns inside the tp group


def test_fp8_runs_the_linear_layers_at_the_fp8_rate_and_attention_at_bf16():
    from predictors.hardware import FP8_GEMM_SPEEDUP

    d, hw = _dense(), find("H100")
    plan = Plan(dp_shard=8, seq_len=8192, micro_batch=1, grad_accum=4, recompute="none")
    bf16, fp8 = estimate(d, plan, hw, "bf16"), estimate(d, plan, hw, "fp8")
    fwd, mixing = d.forward_flops_per_token(plan.seq_len), d.mixing_flops(plan.seq_len)
    share = mixing / fwd
    assert 0.05 < share < 0.5
    # H100's FP8 peak is twice its BF16 peak (1979 and 989 TFLOPS); a training-sized FP8 GEMM gains 1.5x (torchao)
    assert hw.peak_flops("fp8") == pytest.approx(2 * hw.peak_flops("bf16"), rel=1e-3) and 1 < FP8_GEMM_SPEEDUP < 2
    assert hw.matmul_rate("fp8") == pytest.approx(FP8_GEMM_SPEEDUP * hw.matmul_rate("bf16"))
    ratio = 1 / FP8_GEMM_SPEEDUP
    assert fp8.compute_s == pytest.approx(bf16.compute_s * ((1 - share) * ratio + share))
    assert bf16.compute_s / 2 < fp8.compute_s < bf16.compute_s
    # selective recompute reruns the attention core alone: no FP8 speed-up there
    sel = Plan(dp_shard=8, seq_len=8192, micro_batch=1, grad_accum=4, recompute="selective")
    assert estimate(d, sel, hw, "fp8").recompute_s == pytest.approx(estimate(d, sel, hw, "bf16").recompute_s)
    # a chip without FP8 (A100) runs it at the BF16 rate, as before
    a100 = find("A100-80G")
    assert estimate(d, plan, a100, "fp8").compute_s == pytest.approx(estimate(d, plan, a100, "bf16").compute_s)


def test_a_run_without_gradient_bucketing_hides_none_of_its_data_parallel_traffic(tmp_path):
    """vTrain's validation runs all-reduce gradients after the whole backward ("no gradient bucketing" in the
    row's notes): the converter records it in the run's meta, and the dataset prices the run with the data-parallel
    traffic exposed."""
    from predictors.features import load_dataset
    from predictors.published import convert_file

    row = {"source": "VIA-Research/vTrain data/ground_truth_multi.csv (test row)", "model": "GPT (test)",
           "layers": 24, "hidden": 2048, "heads": 16, "kv_heads": 16, "ffn": 8192, "vocab": 50257, "seq_len": 2048,
           "experts": None, "top_k": None, "expert_ffn": None, "shared_experts": None, "tp": 1, "pp": 1, "dp": 16,
           "ep": None, "cp": 1, "micro_batch": 4, "global_batch": 64, "recompute": "full", "gpu": "A100-SXM-80GB",
           "num_gpus": 16, "measured": {"step_time_s": 2.0}, "precision": "mixed",
           "notes": "Measured iteration time. full recompute, 1F1B, no gradient bucketing."}
    bucketed = {**row, "notes": "Measured iteration time. full recompute, 1F1B."}
    src = tmp_path / "rows.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in (row, bucketed)) + "\n")
    assert convert_file(src, tmp_path / "runs.jsonl") == (2, [])
    data = load_dataset([tmp_path / "runs.jsonl"])
    unbucketed_step, bucketed_step = data.cost_step
    d = Dims.from_record({"name": "g", "layers": 24, "hidden": 2048, "heads": 16, "kv_heads": 16, "head_dim": 128,
                          "ffn": 8192, "vocab": 50257})
    plan = Plan(dp_replicate=16, dp_shard=1, seq_len=2048, micro_batch=4, grad_accum=1, recompute="full")
    hw = find("A100-80G")
    hidden, exposed = estimate(d, plan, hw), estimate(d, plan, hw, gradient_overlap=False)
    assert exposed.dp_s == hidden.dp_s > 0
    assert exposed.step_time_s - hidden.step_time_s == pytest.approx(min(hidden.dp_s, costmodel.DP_OVERLAP *
                                                                         (hidden.compute_s + hidden.recompute_s)))
    assert unbucketed_step > bucketed_step


def test_the_loss_over_the_logits_is_priced_as_hbm_traffic_split_by_tensor_parallelism(monkeypatch):
    """38 bytes a logit (`costmodel.loss_bytes_per_token`): the vocabulary, not the layers, sets it, so a model with
    twice the vocabulary moves twice the bytes and tp splits them; with no host time to combine with (`dispatch_s`),
    the step grows by exactly its time."""
    hw = dataclasses.replace(find("H100"), op_dispatch_us=0.0)
    small, large = _dense(hidden=1024, layers=12), Dims.from_record({
        "name": "dense", "layers": 12, "hidden": 1024, "heads": 32, "kv_heads": 8, "head_dim": 32, "ffn": 4096,
        "vocab": 64000})
    plan = Plan(dp_shard=8, seq_len=4096, micro_batch=4, grad_accum=2, recompute="none")
    a, b = estimate(small, plan, hw), estimate(large, plan, hw)
    tokens = plan.micro_batch * plan.seq_len * plan.grad_accum
    assert a.loss_s == pytest.approx(tokens * 32000 * costmodel.LOSS_BYTES_PER_LOGIT / (hw.memory_bw_gbs * 1e9))
    assert b.loss_s == pytest.approx(2 * a.loss_s)
    assert a.overhead_s == 0
    assert a.loss_s <= a.memory_s
    tp = estimate(small, Plan(tp=2, dp_shard=4, seq_len=4096, micro_batch=4, grad_accum=2, recompute="none"), hw)
    assert tp.loss_s == pytest.approx(a.loss_s / 2)
    # a chunked loss saves memory, not traffic
    chunked = estimate(small, Plan(dp_shard=8, seq_len=4096, micro_batch=4, grad_accum=2, recompute="none",
                                   loss_chunk=1024), hw)
    assert chunked.loss_s == pytest.approx(a.loss_s)
    monkeypatch.setattr(costmodel, "LOSS_BYTES_PER_LOGIT", 0)
    assert estimate(small, plan, hw).step_time_s == pytest.approx(a.step_time_s - a.loss_s)


def test_a_measured_peak_is_not_discounted_twice():
    """A vendor's peak is discounted to what training matmuls reach (hardware.MATMUL_EFFICIENCY); the CPU's peaks are
    this machine's measured matmul rates already, so its spec says matmul_efficiency: 1 and the rate is the peak."""
    from predictors import hardware

    cpu, h100 = find("cpu"), find("H100")
    assert cpu.matmul_efficiency == 1.0 and cpu.matmul_rate("fp32") == pytest.approx(cpu.peak_flops("fp32"))
    assert h100.matmul_rate("bf16") == pytest.approx(hardware.MATMUL_EFFICIENCY * h100.peak_flops("bf16"))
