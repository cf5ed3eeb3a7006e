"""Published training runs (predictors/sources/) converted into the runtime's run-log format.

The rows as gathered from papers and benchmark tables are in predictors/sources/ (its README.md says where
they come from; hardware.md holds the sources of the hardware/*.yaml figures). They stay out of
predictors/data/ because run-log readers take every *.jsonl under a directory they are given. Each row
becomes one header and one step line, `source` naming the paper or benchmark, so the predictor reads one
format only; the converted files ship in predictors/data/ and are what it trains on. After changing the
rows or this conversion, regenerate them with

    python -m predictors.published [SOURCE_DIR]

(SOURCE_DIR defaults to predictors/sources/); a test checks the shipped files are current.

Step time, in order of preference, from what a row reports:
  1. `step_time_s` as measured;
  2. `tokens_per_s` (whole job): global_batch * seq_len / tokens_per_s;
  3. `tokens_per_s_per_gpu`: global_batch * seq_len / (tokens_per_s_per_gpu * num_gpus);
  4. `tflops_per_gpu` from Narayanan et al. 2021, whose FLOPs per iteration are their Eq. 3,
     96 B s l h^2 (1 + s / 6h + V / 16 l h) (it counts the recompute forward), over tflops * num_gpus;
  5. `tflops_per_gpu` from any other source: model FLOPs per step over tflops * num_gpus, the model FLOPs
     per token being 6 N_active + 12 l h d s (`MODEL_FLOPS`: PaLM's, Chowdhery et al. 2022 App. B, which
     torchtitan, llm-foundry and Megatron-Core's throughput logs also use: forward and backward of the
     active parameters, N_active without the input embedding, plus attention over the whole, non-causal
     sequence of s tokens in l layers of h heads of size d; no recompute counted).
  6. `mfu` with the formula its source states (`mfu_formula`: "megatron" for Narayanan et al.'s Eq. 3, "palm" for
     MODEL_FLOPS) and the per-GPU peak it divides by (`mfu_peak_tflops`): tflops_per_gpu = mfu * peak, then rule 4
     or 5. An MFU whose formula the row does not state is never used: sources define it differently.
`meta.derived_from` records which rule applied.

The model, in order of preference:
  - `catalogue`: a model of onboard's catalogue (onboard/catalogue/<name>/spec.json, the full-scale inspection of
    its released config): its exact dimensions and mixers (MLA, sliding windows, linear attention, dense layers)
    and parameter counts, checked against the row's own shape fields; a row that runs fewer layers (a PROXY) keeps
    its own shape;
  - the row's shape fields (layers, hidden, heads, ...; `moe_layers` and `head_dim` where the row gives them).
A row without a vocabulary takes its catalogue model's, or its family's (`FAMILY_VOCAB`, each with its config's
source). Every value taken from elsewhere than the row is listed in `meta.assumed`, so an evaluation can leave
those rows out (`onboard predictor eval --measured-only`).

MoE facts of the run the plan does not hold are written to `meta`: `overlap` (the plan's) is the row's
`a2a_overlap`, false where the row does not say: Megatron-Core, which every MoE source here runs, waits on its
All-to-All unless `--overlap-moe-expert-parallel-comm` is set (off by default); `meta.expert_balance` is "forced"
where the source forced the routing to balance or dropped tokens over capacity (NVIDIA's benchmarks say both), so
no imbalance is priced.

The global batch (sequences per step), when a row lacks it, is derived from its throughput and step time:
tokens_per_s (or tokens_per_s_per_gpu * num_gpus) * step_time_s / seq_len, rounded to a multiple of
micro_batch * dp where that is within BATCH_TOLERANCE (the figures are printed rounded); `meta.global_batch`
says so.

Hardware: `GPUS` maps a row's GPU description to a spec in predictors/hardware/ (GB200 and GB300 NVL72 racks
are their own specs, with a 72-GPU NVLink domain). MoE rows whose ep does not divide dp * cp (Megatron-Core's
MoE parallel folding: the expert mesh built from the tp x dp x cp ranks) become folded plans (`Plan.etp`, the
row's `etp` or 1, the expert-tensor-parallel degree folding is run with in Megatron-Core's recipes); the cost
model prices them and runtime.parallel marks them not runnable. Every row left out has a reason that names
what to fix in the row or in predictors/hardware/.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from pathlib import Path

from runtime.dims import count_params
from runtime.plan import Plan
from runtime.runlog import MODEL_FIELDS, RunLogWriter

DATA_DIR = Path(__file__).parent / "data"
SOURCE_DIR = Path(__file__).parent / "sources"  # the rows as published, before conversion
FILES = ("published_runs.jsonl", "published_runs_vtrain_single_node.jsonl", "published_moe_runs.jsonl")
# the catalogue's full-scale inspections; read as data (predictors never imports onboard)
CATALOGUE_DIR = Path(__file__).resolve().parent.parent / "onboard" / "catalogue"
# vocabulary sizes of model families, from their released config.json (vocab_size), for rows that leave it out
FAMILY_VOCAB = (
    ("mixtral-8x22b", 32768, "mistralai/Mixtral-8x22B-v0.1 config.json"),
    ("mixtral", 32000, "mistralai/Mixtral-8x7B-v0.1 config.json"),
    ("qwen3", 151936, "Qwen/Qwen3-30B-A3B and Qwen3-235B-A22B config.json"),
    ("qwen2", 151936, "Qwen/Qwen2-57B-A14B config.json"),
    ("deepseek-v3", 129280, "deepseek-ai/DeepSeek-V3 config.json"),
    ("deepseek-v2", 102400, "deepseek-ai/DeepSeek-V2 and V2-Lite config.json"),
    ("llama4", 202048, "meta-llama/Llama-4-Scout-17B-16E config.json"),
    ("grok", 131072, "xai-org/grok-1 release (vocab 131072)"),
)

# (substring of the source citation, short source name); first match wins
SOURCES = (
    ("ground_truth_single", "vtrain-single-node"),
    ("ground_truth_multi", "vtrain-multi-node"),
    ("llm-foundry", "llm-foundry"),
    ("Narayanan", "megatron-2021"),
    ("torchtitan", "torchtitan"),
    ("NeMo docs", "nemo-performance"),
    ("NVIDIA/NeMo", "nemo-performance"),
    ("docs.nvidia.com/nemo-framework", "nemo-performance"),
    ("dgxc-benchmarking", "dgxc-benchmarking"),
    ("Megatron-Bridge", "megatron-bridge"),
    ("MindSpeed", "mindspeed-llm"),
    ("Primus", "amd-primus"),
)


def short_source(citation: str) -> str:
    return next((short for key, short in SOURCES if key in citation), citation.split()[0])


# (pattern in a row's GPU description, bundled spec name), first match wins: GB300 and GB200 before B200 (an NVL72
# rack's GPU is a B200 die with a 72-GPU NVLink domain), H200 before H20
GPUS = (
    (r"GB300", "GB300"), (r"GB200", "GB200"), (r"B200", "B200"),
    (r"H200", "H200"), (r"H800", "H800"), (r"H100", "H100"), (r"\bH20\b", "H20"),
    (r"MI355X", "MI355X"), (r"MI325X", "MI325X"), (r"MI300X", "MI300X"),
    (r"910C", "Ascend-910C"), (r"910B", "Ascend-910B"),
)
# how far tokens/s x step time may be from a whole global batch (the sources print both rounded)
BATCH_TOLERANCE = 0.02
MODEL_FLOPS = "6*N_active + 12*l*h*d*s per token"  # rule 5 above
REQUIRED = ("layers", "hidden", "heads", "vocab", "seq_len", "tp", "pp", "dp", "num_gpus")


def hardware_name(gpu: str) -> str:
    if "A100" in gpu:
        return "A100-40G" if "40GB" in gpu else "A100-80G"
    for pattern, name in GPUS:
        if re.search(pattern, gpu, re.IGNORECASE):
            return name
    raise ValueError(f"no hardware spec for GPU {gpu!r}: add predictors/hardware/<name>.yaml (its figures' sources in "
                     f"predictors/sources/hardware.md) and its pattern to predictors.published.GPUS")


def model_flops_per_token(row: dict, params_active: int) -> float:
    """Training FLOPs per token as most sources count them for TFLOP/s: 6 N_active + 12 l h d s (`MODEL_FLOPS`)."""
    head_dim = row["hidden"] // row["heads"]
    return 6 * params_active + 12 * row["layers"] * row["heads"] * head_dim * row["seq_len"]


def _global_batch(row: dict, unit: int) -> tuple[int, str | None]:
    """(sequences per step, how it was derived: None when the row gives it)."""
    if row.get("global_batch") is not None:
        if not (isinstance(row["global_batch"], int) and row["global_batch"] >= 1):
            raise ValueError(f"global_batch must be a positive whole number of sequences, got {row['global_batch']!r}")
        return row["global_batch"], None
    got = row.get("measured") or {}
    rate = got.get("tokens_per_s") or (got.get("tokens_per_s_per_gpu") or 0) * row["num_gpus"]
    step = got.get("step_time_s")
    if not (rate and step):
        raise ValueError("no global_batch, and no step_time_s with tokens/s to derive it from: add the source's "
                         "global batch (sequences per step) to the row")
    sequences = rate * step / row["seq_len"]
    batch = max(1, round(sequences / unit)) * unit
    if abs(batch - sequences) > BATCH_TOLERANCE * sequences:
        raise ValueError(f"no global_batch, and tokens/s x step_time_s = {sequences:.1f} sequences of {row['seq_len']} "
                         f"tokens is not a multiple of micro_batch*dp = {unit} within {BATCH_TOLERANCE:.0%}: check "
                         f"the row's throughput, step time, micro_batch and dp, or add the source's global batch")
    rule = "tokens_per_s x step_time_s" if got.get("tokens_per_s") else "tokens_per_s_per_gpu x num_gpus x step_time_s"
    return batch, f"{rule} / seq_len = {sequences:.1f}, rounded to a multiple of micro_batch*dp"


def _expert_tp(row: dict, dp: int, cp: int) -> tuple[int | None, str | None]:
    """(Plan.etp, a note) for an MoE row: None where the EP group lies within dp * cp (the runtime's own layout)."""
    tp, ep, etp = row["tp"], row.get("ep") or 1, row.get("etp")
    if etp is None and ep > 1 and (dp * cp) % ep:
        return 1, (f"ep={ep} does not divide dp*cp={dp * cp}: read as Megatron-Core MoE parallel folding, the expert "
                   f"mesh over tp*dp*cp={tp * dp * cp} ranks, with etp=1 (the row gives no expert tensor-parallel "
                   f"degree)")
    if etp is None or (etp == tp and (dp * cp) % ep == 0):
        return None, None  # Megatron-Core's default etp = tp is the layout an unfolded plan describes
    return etp, f"etp={etp} as the row gives it: MoE parallel folding"


def _recompute(value) -> str:
    text = str(value or "none").lower()
    return "full" if text == "full" else "selective" if text.startswith("selective") else "none"


MFU_FORMULAS = ("megatron", "palm")


def _tflops(row: dict) -> tuple[float | None, str]:
    """(TFLOP/s per GPU the row reports or its MFU converts to, how)."""
    got = row.get("measured") or {}
    if got.get("tflops_per_gpu"):
        return float(got["tflops_per_gpu"]), "tflops_per_gpu"
    formula, peak = row.get("mfu_formula"), row.get("mfu_peak_tflops")
    if got.get("mfu") and formula in MFU_FORMULAS and isinstance(peak, (int, float)) and peak > 0:
        return float(got["mfu"]) * peak, f"mfu x {peak} TFLOP/s ({formula})"
    return None, ""


def _step_time(row: dict, tokens_per_step: int, params_active: int) -> tuple[float, str]:
    got = row.get("measured") or {}
    tflops, how = _tflops(row)
    if got.get("step_time_s"):
        return float(got["step_time_s"]), "step_time_s"
    if got.get("tokens_per_s"):
        return tokens_per_step / got["tokens_per_s"], "tokens_per_s"
    if got.get("tokens_per_s_per_gpu"):
        return tokens_per_step / (got["tokens_per_s_per_gpu"] * row["num_gpus"]), "tokens_per_s_per_gpu"
    if tflops and ("Narayanan" in row["source"] or row.get("mfu_formula") == "megatron"):
        s, layer, h, v = row["seq_len"], row["layers"], row["hidden"], row["vocab"]
        flops = 96 * (tokens_per_step // s) * s * layer * h * h * (1 + s / (6 * h) + v / (16 * layer * h))
        return flops / (tflops * 1e12 * row["num_gpus"]), f"{how} (Narayanan Eq. 3)"
    if tflops:
        flops = tokens_per_step * model_flops_per_token(row, params_active)
        return flops / (tflops * 1e12 * row["num_gpus"]), f"{how} ({MODEL_FLOPS})"
    raise ValueError("reports none of step_time_s, tokens_per_s, tokens_per_s_per_gpu or tflops_per_gpu, nor an mfu "
                     "with the formula and peak its source states (mfu_formula, mfu_peak_tflops): add one of them "
                     "from the source")


def _family_vocab(name: str) -> tuple[int, str] | None:
    key = re.sub(r"[\s_]+", "-", name.lower()).replace("×", "x")
    for family, vocab, source in FAMILY_VOCAB:
        if family in key or family.replace("-", "") in key.replace("-", ""):
            return vocab, source
    return None


def _catalogue_record(slug: str) -> dict:
    """The run-log model record of a catalogue model, from its shipped full-scale inspection (a copy of the one
    read: a file converts dozens of rows of the same model, some twice: vocabulary, then shape)."""
    return dict(_read_catalogue_record(slug))


@functools.lru_cache(maxsize=None)
def _read_catalogue_record(slug: str) -> dict:
    from runtime.runlog import model_record

    path = CATALOGUE_DIR / slug / "spec.json"
    try:
        shipped = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        raise ValueError(f"catalogue {slug!r}: no readable {path.relative_to(CATALOGUE_DIR.parent.parent)}; name a "
                         f"model of onboard's catalogue or leave catalogue null") from None
    record = model_record(shipped["spec"])
    record["name"] = slug
    return record


def _model(row: dict, assumed: list) -> dict:
    """The run's model record: its catalogue model's, or rebuilt from the row's shape fields."""
    slug = row.get("catalogue")
    if slug:
        record = _catalogue_record(slug)
        if record["layers"] == row["layers"]:
            mismatched = [k for k in ("hidden", "experts", "top_k", "expert_ffn") if row.get(k) is not None
                          and record.get(k) is not None and row[k] != record[k]]
            if mismatched:
                raise ValueError(f"{', '.join(mismatched)} differ from catalogue model {slug}'s: fix the row or its "
                                 f"catalogue name")
            return record
        assumed.append(f"a {row['layers']}-layer PROXY of {slug} ({record['layers']} layers): its shape from the row")
    name = row["model"]
    gated = any(k in name.lower() for k in ("llama", "grok")) or bool(row.get("experts"))
    dims = {k: row.get(k) for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "experts", "top_k",
                                    "expert_ffn", "shared_experts")}
    dims = {k: v or 0 for k, v in dims.items()}
    dims["kv_heads"] = dims["kv_heads"] or dims["heads"]
    dims["head_dim"] = row.get("head_dim") or dims["hidden"] // dims["heads"]
    moe_layers = row.get("moe_layers")
    dims["moe_layers"] = (moe_layers if isinstance(moe_layers, int) else dims["layers"]) if dims["experts"] else 0
    total, active = count_params(**dims, gated=gated, tied=not gated)
    model = {k: None for k in MODEL_FIELDS}
    model.update({k: v or None for k, v in dims.items()}, name=name, model_type="published",
                 params_total=total, params_active=active, linear_attention_layers=0, sparse_attention_layers=0)
    model["moe_layers"] = dims["moe_layers"]
    return model


def _fill_vocab(row: dict, assumed: list) -> dict:
    """The row with a vocabulary from its catalogue model or family where it gives none."""
    if row.get("vocab"):
        return row
    if row.get("catalogue"):
        vocab, where = _catalogue_record(row["catalogue"])["vocab"], f"catalogue model {row['catalogue']}"
    else:
        found = _family_vocab(str(row.get("model") or ""))
        if found is None:
            return row
        vocab, where = found
    assumed.append(f"vocab {vocab} from {where}")
    return {**row, "vocab": vocab}


def convert_row(row: dict) -> dict:
    """Header fields and the one step of a published row; ValueError when it cannot be converted, saying what to
    fix."""
    assumed: list[str] = [str(a) for a in row.get("assumed") or []]  # what the transcription itself assumed
    row = _fill_vocab(row, assumed)
    missing = [k for k in REQUIRED if not (isinstance(row.get(k), int) and not isinstance(row.get(k), bool)
                                           and row[k] >= 1)]
    missing += [k for k in ("model", "source", "gpu") if not (isinstance(row.get(k), str) and row[k].strip())]
    if missing:
        raise ValueError(f"{', '.join(missing)} missing, or not a positive whole number / a name: fill in from the "
                         f"source")
    text = f"{row['source']} {row.get('notes', '')} {row.get('framework') or ''}"
    model = _model(row, assumed)
    active = model["params_active"]
    if isinstance(row.get("fsdp"), bool):
        fsdp = row["fsdp"]
    else:
        fsdp = ("FSDP" in text and "FSDP column=0" not in text) or ("ZeRO-3" in text and row["tp"] * row["pp"] == 1)
    dp, mb, cp = row["dp"], row.get("micro_batch") or 1, row.get("cp") or 1
    hardware = hardware_name(str(row.get("gpu") or ""))
    global_batch, batch_rule = _global_batch(row, mb * dp)
    if global_batch % (mb * dp):
        raise ValueError(f"global batch {global_batch} is not a multiple of micro_batch*dp = {mb * dp}: check the "
                         f"row's global_batch, micro_batch and dp")
    etp, expert_note = _expert_tp(row, dp, cp)
    precision = "fp8" if any(k in str(row.get("precision")).lower() for k in ("fp8", "float8")) else "bf16"
    plan = Plan(dp_replicate=1 if fsdp else dp, dp_shard=dp if fsdp else 1, tp=row["tp"], pp=row["pp"],
                cp=cp, ep=row.get("ep") or 1, micro_batch=mb, grad_accum=global_batch // (mb * dp),
                seq_len=row["seq_len"], recompute=_recompute(row.get("recompute")), dtype=precision, etp=etp,
                overlap=row.get("a2a_overlap") is True if row.get("experts") else True)
    problems = plan.problems(row.get("experts"))
    if problems and expert_note:
        problems.append(f"({expert_note}; check the row's ep, etp, tp and dp)")
    if plan.world_size != row["num_gpus"]:
        problems.append(f"degrees multiply to {plan.world_size}, not the {row['num_gpus']} GPUs reported")
    if problems:
        raise ValueError("; ".join(problems))
    step_time, rule = _step_time(row, plan.tokens_per_step, active)
    peak = (row.get("measured") or {}).get("peak_memory_gib")
    meta = {"citation": row["source"], "derived_from": rule, "proxy": "PROXY" in row.get("notes", ""),
            "notes": row.get("notes", "")}
    if batch_rule:
        meta["global_batch"] = batch_rule
    if expert_note:
        meta["expert_layout"] = expert_note
    if assumed:
        meta["assumed"] = assumed
    if row.get("experts") and re.search(r"force-balance|token-?drop|capacity.factor", text, re.I):
        # NVIDIA's dropless benchmarks force-balance the routing; token-dropping runs cap every expert at its capacity
        meta["expert_balance"] = "forced"
    if re.search(r"no gradient bucketing", text, re.I):
        # gradients all-reduced in one go after the whole backward (vTrain's Megatron-DeepSpeed validation runs):
        # nothing hides the data-parallel traffic. runtime.plan.Plan has no field for it (its `overlap` is the MoE
        # All-to-All's), so it is a fact of the run, which predictors.features passes to the cost model
        meta["gradient_overlap"] = False
    return {
        "source": short_source(row["source"]), "model": model, "plan": plan.to_dict(), "precision": precision,
        "hardware": {"name": hardware, "devices": row["num_gpus"], "described": row["gpu"]},
        "meta": meta,
        "step": {"step_time_s": step_time, "tokens_per_s": plan.tokens_per_step / step_time,
                 "peak_memory_bytes": int(peak * 2**30) if peak else None},
    }


def convert_file(src: Path, dst: Path) -> tuple[int, list[str]]:
    """Rewrite `dst` from `src`; returns (runs written, reasons for the rows left out)."""
    dst.unlink(missing_ok=True)
    written, left_out = 0, []
    for number, line in enumerate(src.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            run = convert_row(json.loads(line))
        except ValueError as e:
            left_out.append(f"{src.name}:{number}: {e}")
            continue
        except (KeyError, TypeError, ZeroDivisionError, AttributeError) as e:
            left_out.append(f"{src.name}:{number}: a field is missing or of the wrong type ({type(e).__name__}: "
                            f"{e}): compare the row with the schema in predictors/sources/README.md")
            continue
        step = run.pop("step")
        with RunLogWriter(dst, run_id=f"{src.stem}-{number}", **run) as log:
            log.step(0, **step)
        written += 1
    return written, left_out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    source = Path(argv[0]) if argv else SOURCE_DIR
    for name in FILES:
        written, left_out = convert_file(source / name, DATA_DIR / name)
        print(f"{name}: {written} runs written, {len(left_out)} left out")
        for reason in left_out:
            print(f"  {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
