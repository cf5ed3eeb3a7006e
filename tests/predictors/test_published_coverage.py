"""Issue 19, converter and plan coverage: one published-style row of each kind the converter used to refuse (a
GB200 / GB300 / B200 system, tokens/s without a global batch, TFLOP/s per GPU only, EP folded across tp x dp)
converts and is priced by the cost model, or is refused with a reason that says what to fix.

The rows are shaped like the benchmark tables they stand for (NeMo / Megatron-Core performance tables, torchtitan's
docs); their measured figures are made up for the test, and none of them ships in predictors/sources/.
"""

import dataclasses
import json
import math

import pytest

from predictors.costmodel import estimate
from predictors.features import load_dataset
from predictors.hardware import find, identify
from predictors.planner import search
from predictors.published import MODEL_FLOPS, convert_file, convert_row
from runtime.dims import Dims
from runtime.parallel.runnable import not_runnable
from runtime.plan import Plan

# a Llama-3-70B-shaped dense row, 64 GPUs as tp 2 x pp 4 x dp 8
DENSE = {"source": "test row (NeMo performance table shape)", "model": "Llama-3-70B", "layers": 80, "hidden": 8192,
         "heads": 64, "kv_heads": 8, "ffn": 28672, "vocab": 128256, "seq_len": 8192, "experts": None, "top_k": None,
         "expert_ffn": None, "shared_experts": None, "tp": 2, "pp": 4, "dp": 8, "ep": None, "cp": 1,
         "micro_batch": 1, "global_batch": 128, "recompute": None, "gpu": "GB200 NVL72", "num_gpus": 64,
         "measured": {"step_time_s": 6.0}, "notes": "", "precision": "BF16"}
# a Qwen3-30B-A3B-shaped MoE row, 16 GPUs as tp 4 x dp 4
MOE = {"source": "test row (Megatron-Core MoE table shape)", "model": "Qwen3-30B-A3B", "layers": 48, "hidden": 2048,
       "heads": 32, "kv_heads": 4, "ffn": None, "vocab": 151936, "seq_len": 4096, "experts": 128, "top_k": 8,
       "expert_ffn": 768, "shared_experts": 0, "tp": 4, "pp": 1, "dp": 4, "ep": 16, "cp": 1, "micro_batch": 1,
       "global_batch": 256, "recompute": None, "gpu": "H100-SXM-80GB", "num_gpus": 16,
       "measured": {"tokens_per_s_per_gpu": 9000.0}, "notes": "", "precision": "BF16"}


def priced(run: dict):
    """The converted run as the predictor's training reads it, priced by the cost model."""
    d, plan, hw = Dims.from_record(run["model"]), Plan.from_dict(run["plan"]), identify(run["hardware"])
    est = estimate(d, plan, hw, run["precision"])
    assert math.isfinite(est.step_time_s) and est.step_time_s > 0
    return d, plan, hw, est


# -- GB200 / GB300 / B200 systems -----------------------------------------------------------------------------
@pytest.mark.parametrize("described, name, domain", [
    ("GB200 NVL72", "GB200", 72), ("NVIDIA GB200 (NVL72 rack, 186GB)", "GB200", 72),
    ("GB300 NVL72 (Blackwell Ultra)", "GB300", 72), ("DGX B200", "B200", 8), ("B200-SXM-180GB", "B200", 8),
])
def test_blackwell_systems_convert_and_are_priced(described, name, domain):
    run = convert_row({**DENSE, "gpu": described})
    assert run["hardware"] == {"name": name, "devices": 64, "described": described}
    _, _, hw, _ = priced(run)
    assert hw.name == name and hw.domain == domain


def test_an_nvl72_rack_keeps_64_gpus_on_nvlink_where_a_b200_board_does_not():
    """The scale-up domain decides which collectives ride NVLink: on GB200 the dp and pp groups of 64 GPUs stay on
    the rack's NVLink; the same spec with an 8-GPU domain, like the B200 board, sends them over the network."""
    d, plan, gb200, rack = priced(convert_row(DENSE))
    board = estimate(d, plan, dataclasses.replace(gb200, scale_up_domain=8))
    assert gb200.link_gbs(64) == gb200.scale_up_gbs == 900 and find("B200").link_gbs(64) == 50
    assert rack.dp_s < board.dp_s / 10 and rack.pp_s < board.pp_s / 10
    assert rack.step_time_s < board.step_time_s and rack.compute_s == board.compute_s


def test_a_gpu_without_a_spec_is_refused_with_what_to_add():
    with pytest.raises(ValueError, match=r"no hardware spec for GPU 'TPU v5p': add predictors/hardware/"):
        convert_row({**DENSE, "gpu": "TPU v5p"})
    assert convert_row({**DENSE, "gpu": "NVIDIA H20"})["hardware"]["name"] == "H20"  # not H200
    assert convert_row({**DENSE, "gpu": "H200-SXM-141GB"})["hardware"]["name"] == "H200"


# -- tokens per second without a global batch ------------------------------------------------------------------
def test_the_global_batch_comes_from_tokens_per_second_and_step_time():
    tokens = 128 * 8192
    whole = convert_row({**DENSE, "global_batch": None,
                         "measured": {"step_time_s": 6.0, "tokens_per_s": tokens / 6.0 * 1.004}})  # printed rounded
    per_gpu = convert_row({**DENSE, "global_batch": None,
                           "measured": {"step_time_s": 6.0, "tokens_per_s_per_gpu": tokens / 6.0 / 64}})
    for run in (whole, per_gpu):
        assert Plan.from_dict(run["plan"]).global_batch == 128 and run["step"]["step_time_s"] == 6.0
        assert "step_time_s / seq_len" in run["meta"]["global_batch"] and run["meta"]["derived_from"] == "step_time_s"
        priced(run)
    assert "tokens_per_s_per_gpu x num_gpus" in per_gpu["meta"]["global_batch"]
    assert "global_batch" not in convert_row(DENSE)["meta"]  # a row that gives it keeps it, and says nothing


def test_a_row_without_a_global_batch_is_refused_when_nothing_sizes_the_step():
    with pytest.raises(ValueError, match="no step_time_s with tokens/s to derive it from: add the source's global"):
        convert_row({**DENSE, "global_batch": None, "measured": {"tokens_per_s": 170000.0}})
    with pytest.raises(ValueError, match=r"131\.0 sequences .* not a multiple of micro_batch\*dp = 8 within 2%"):
        convert_row({**DENSE, "global_batch": None, "measured": {"step_time_s": 1.0, "tokens_per_s": 131 * 8192}})


# -- TFLOP/s per GPU only ---------------------------------------------------------------------------------------
def test_tflops_per_gpu_from_any_source_through_model_flops():
    """6 N_active + 12 l h d s per token (PaLM's count): N_active by hand for a gated dense model, the input
    embedding left out and the LM head kept."""
    row = {**DENSE, "source": "torchtitan performance docs", "measured": {"tflops_per_gpu": 900.0}}
    run = convert_row(row)
    h, layers, heads, kv, ffn, vocab, s = 8192, 80, 64, 8, 28672, 128256, 8192
    head = h // heads
    n_active = layers * (2 * h * head * (heads + kv) + 3 * h * ffn) + vocab * h
    flops = 128 * s * (6 * n_active + 12 * layers * heads * head * s)
    assert run["step"]["step_time_s"] == pytest.approx(flops / (900e12 * 64), rel=1e-12)
    assert run["meta"]["derived_from"] == f"tflops_per_gpu ({MODEL_FLOPS})" and "6*N_active" in MODEL_FLOPS
    priced(run)
    # a Narayanan et al. row keeps their Eq. 3, which counts the recompute forward: a shorter step for the same figure
    narayanan = convert_row({**row, "source": "Narayanan et al. 2021, Table 1"})
    assert narayanan["meta"]["derived_from"] == "tflops_per_gpu (Narayanan Eq. 3)"
    assert narayanan["step"]["step_time_s"] > run["step"]["step_time_s"]


def test_tflops_alone_without_a_global_batch_or_mfu_alone_is_refused():
    with pytest.raises(ValueError, match="add the source's global batch"):
        convert_row({**DENSE, "global_batch": None, "measured": {"tflops_per_gpu": 900.0}})
    with pytest.raises(ValueError, match="nor an mfu with the formula and peak its source states.*add one of them"):
        convert_row({**DENSE, "measured": {"mfu": 0.41}})
    # a formula without the peak it divides by is not enough either
    with pytest.raises(ValueError, match="nor an mfu with the formula"):
        convert_row({**DENSE, "measured": {"mfu": 0.41}, "mfu_formula": "palm"})


def test_an_mfu_under_its_stated_formula_converts_as_the_tflops_it_stands_for():
    """Issue 37 item 3: MFU x the peak the source divides by is the TFLOP/s the formula counted, so the row prices as
    the same figure given in TFLOP/s would (PaLM's formula: MODEL_FLOPS; Megatron's: Narayanan et al.'s Eq. 3)."""
    as_tflops = convert_row({**DENSE, "measured": {"tflops_per_gpu": 400.0}})
    for formula in ("palm", "megatron"):
        row = {**DENSE, "measured": {"mfu": 0.4}, "mfu_formula": formula, "mfu_peak_tflops": 1000}
        run = convert_row(row)
        assert f"mfu x 1000 TFLOP/s ({formula})" in run["meta"]["derived_from"]
        if formula == "palm":
            assert run["step"]["step_time_s"] == pytest.approx(as_tflops["step"]["step_time_s"], rel=1e-12)
        else:  # Eq. 3 counts the recompute forward: more FLOPs for the same rate, a longer step
            narayanan = convert_row({**DENSE, "source": "Narayanan et al. 2021", "measured": {"tflops_per_gpu": 400.0}})
            assert run["step"]["step_time_s"] == pytest.approx(narayanan["step"]["step_time_s"], rel=1e-12)
    with pytest.raises(ValueError, match="nor an mfu"):
        convert_row({**DENSE, "measured": {"mfu": 0.4}, "mfu_formula": "our own", "mfu_peak_tflops": 1000})


def test_a_catalogue_model_takes_its_inspected_dimensions_and_says_what_it_assumed():
    """A row naming a catalogue model is priced with its full-scale inspection (Qwen3's head_dim 128, not hidden /
    heads = 64; its real parameter counts); a row without a vocabulary takes the catalogue's and says so; a row that
    runs fewer layers (a proxy) keeps its own shape; a shape that contradicts the catalogue is refused."""
    run = convert_row({**MOE, "catalogue": "qwen3-30b-a3b", "vocab": None})
    model = run["model"]
    assert model["name"] == "qwen3-30b-a3b" and model["head_dim"] == 128 and model["mixers"]
    assert model["params_active"] == 3041867776 and model["vocab"] == 151936
    assert run["meta"]["assumed"] == ["vocab 151936 from catalogue model qwen3-30b-a3b"]
    priced(run)
    own = convert_row(MOE)
    assert own["model"]["head_dim"] == 64 and "assumed" not in own["meta"]
    proxy = convert_row({**MOE, "catalogue": "qwen3-30b-a3b", "layers": 4})
    assert proxy["model"]["layers"] == 4 and "PROXY" in proxy["meta"]["assumed"][0]
    with pytest.raises(ValueError, match="expert_ffn differ from catalogue model qwen3-30b-a3b"):
        convert_row({**MOE, "catalogue": "qwen3-30b-a3b", "expert_ffn": 1536})
    with pytest.raises(ValueError, match="catalogue 'no-such-model'"):
        convert_row({**MOE, "catalogue": "no-such-model"})
    # a family's vocabulary, for a model the catalogue does not hold
    mixtral = convert_row({**MOE, "model": "Mixtral-8x22B", "vocab": None, "experts": 8, "top_k": 2, "ep": 4})
    assert mixtral["model"]["vocab"] == 32768 and "mistralai/Mixtral-8x22B" in mixtral["meta"]["assumed"][0]
    with pytest.raises(ValueError, match="vocab missing"):
        convert_row({**MOE, "model": "Unknown-MoE", "vocab": None})


def test_an_moe_row_says_whether_its_exchange_overlapped_and_whether_its_routing_was_balanced():
    """Megatron-Core waits on its All-to-All unless told to overlap it: a row is priced without overlap unless it
    says `a2a_overlap`; a benchmark that forced the routing to balance (or dropped tokens over capacity) says so."""
    plain = convert_row(MOE)
    assert plain["plan"]["overlap"] is False and "expert_balance" not in plain["meta"]
    assert convert_row({**MOE, "a2a_overlap": True})["plan"]["overlap"] is True
    forced = convert_row({**MOE, "notes": "we force-balance the token distribution among experts"})
    assert forced["meta"]["expert_balance"] == "forced"
    # a dense row's plan keeps the default (it has no exchange to overlap)
    assert convert_row(DENSE)["plan"]["overlap"] is True
    # the notes of a table that has an FSDP column set to 0 do not make the run FSDP
    assert convert_row({**MOE, "notes": "FSDP column=0 (DDP)"})["plan"]["dp_shard"] == 1
    assert convert_row({**MOE, "fsdp": True})["plan"]["dp_shard"] == 4


# -- EP folded across tp x dp ------------------------------------------------------------------------------------
def test_ep_folded_across_tp_and_dp_converts_as_a_folded_plan():
    """ep=16 over dp=4: only Megatron-Core's MoE parallel folding lays that out (the expert mesh over the 16 ranks of
    tp x dp). The row converts to a folded plan (etp=1), written at schema version 4, priced, and runnable
    (runtime.parallel lays out folding at etp 1)."""
    run = convert_row(MOE)
    assert run["plan"]["etp"] == 1 and run["plan"]["schema_version"] == 4
    assert "MoE parallel folding" in run["meta"]["expert_layout"] and "etp=1" in run["meta"]["expert_layout"]
    d, plan, hw, est = priced(run)
    assert plan.folded and plan.expert_tp == 1 and est.ep_s > 0
    assert not_runnable(plan, d) == []


def test_a_folded_ep_group_is_priced_over_its_own_ranks():
    """Folded with etp=1, an EP group of 4 is 4 neighbouring ranks (on one H100 board's NVLink) and each expert is
    split 4 ways; unfolded, the same ep=4 is carved out of dp, its members tp=4 apart (16 ranks: over the network),
    and each expert is split tp x ep = 16 ways."""
    row = {**MOE, "ep": 4}
    folded, plain = convert_row({**row, "etp": 1}), convert_row(row)
    assert folded["plan"]["etp"] == 1 and "etp" not in plain["plan"] and plain["plan"]["schema_version"] == 3
    *_, f = priced(folded)
    *_, p = priced(plain)
    # folded, all 3 peers are on the board's NVLink; unfolded, 1 of its 3 peers is (members 4 apart, 2 to a board)
    # and the other 2 are reached at 50 GB/s
    assert f.ep_s < p.ep_s / 4
    assert f.memory["weights"] > p.memory["weights"]
    # etp = tp with ep inside dp is Megatron-Core's default layout: the plain plan
    assert "etp" not in convert_row({**row, "etp": 4})["plan"]


def test_an_ep_that_even_folding_cannot_lay_out_is_refused_with_what_to_check():
    with pytest.raises(ValueError, match=r"etp\*ep=1\*32 must divide .* tp\*dp\*cp=16.*check the row's ep, etp, tp"):
        convert_row({**MOE, "ep": 32})


# -- all kinds through the files the predictor trains on ---------------------------------------------------------
def test_every_kind_converts_into_run_logs_the_predictor_reads(tmp_path):
    rows = [{**DENSE, "gpu": "GB200 NVL72"}, {**DENSE, "gpu": "GB300 NVL72"}, {**DENSE, "gpu": "DGX B200"},
            {**DENSE, "global_batch": None, "measured": {"step_time_s": 6.0, "tokens_per_s": 128 * 8192 / 6.0}},
            {**DENSE, "source": "torchtitan docs", "measured": {"tflops_per_gpu": 900.0}},
            MOE,
            {**DENSE, "gpu": "TPU v5p"}, {**MOE, "ep": 32}, {**DENSE, "layers": None}, ["not", "a", "row"]]
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    written, left_out = convert_file(src, tmp_path / "runs.jsonl")
    assert written == 6 and len(left_out) == 4
    for reason, fix in zip(left_out, ("add predictors/hardware/", "check the row's ep", "fill in from the source",
                                      "compare the row with the schema")):
        assert fix in reason, reason
    data = load_dataset([str(tmp_path / "runs.jsonl")])
    assert len(data) == 6 and not data.skipped
    assert {"GB200", "GB300", "B200", "H100"} == set(data.hardware)
    assert all(math.isfinite(c) and c > 0 for c in data.cost_step)


# -- the planner prices folded layouts ----------------------------------------------------------------------------
def test_the_planner_prices_folded_layouts_and_runs_them_without_pipelining():
    d = Dims.from_record({"name": "moe", "layers": 8, "hidden": 2048, "heads": 16, "kv_heads": 4, "ffn": 8192,
                          "vocab": 32000, "experts": 64, "top_k": 4, "expert_ffn": 1024, "shared_experts": 1,
                          "moe_layers": 8})
    result = search(d, 16, find("GB200"), seq_len=4096)
    folded = [c for c in result.ranked if c.plan.folded]
    # only an ep the plain layouts cannot have (they draw ep from dp_shard x cp), and etp=1
    assert folded and all(c.plan.etp == 1 and (c.plan.dp_shard * c.plan.cp) % c.plan.ep for c in folded)
    # runtime.parallel lays out folding at etp 1, not under pipeline parallelism
    assert all(any("MoE parallel folding" in r for r in c.not_runnable) == (c.plan.pp > 1) for c in folded)
    assert any(not c.not_runnable for c in folded)
    assert max(c.plan.tp for c in result.ranked) == 8  # two 4-GPU trays of one NVL72 rack
