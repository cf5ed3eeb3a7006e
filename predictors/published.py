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
MFU is never used: sources define it differently. `meta.derived_from` records which rule applied.

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

import json
import re
import sys
from pathlib import Path

from runtime.dims import count_params
from runtime.plan import Plan
from runtime.runlog import MODEL_FIELDS, RunLogWriter

DATA_DIR = Path(__file__).parent / "data"
SOURCE_DIR = Path(__file__).parent / "sources"  # the rows as published, before conversion
FILES = ("published_runs.jsonl", "published_runs_vtrain_single_node.jsonl")

# (substring of the source citation, short source name); first match wins
SOURCES = (
    ("ground_truth_single", "vtrain-single-node"),
    ("ground_truth_multi", "vtrain-multi-node"),
    ("llm-foundry", "llm-foundry"),
    ("Narayanan", "megatron-2021"),
    ("torchtitan", "torchtitan"),
    ("NeMo docs", "nemo-performance"),
    ("NVIDIA/NeMo", "nemo-performance"),
    ("dgxc-benchmarking", "dgxc-benchmarking"),
)


def short_source(citation: str) -> str:
    return next((short for key, short in SOURCES if key in citation), citation.split()[0])


# (pattern in a row's GPU description, bundled spec name), first match wins: GB300 and GB200 before B200 (an NVL72
# rack's GPU is a B200 die with a 72-GPU NVLink domain), H200 before H20
GPUS = (
    (r"GB300", "GB300"), (r"GB200", "GB200"), (r"B200", "B200"),
    (r"H200", "H200"), (r"H800", "H800"), (r"H100", "H100"), (r"\bH20\b", "H20"),
    (r"MI355X", "MI355X"), (r"MI325X", "MI325X"), (r"MI300X", "MI300X"),
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


def _step_time(row: dict, tokens_per_step: int, params_active: int) -> tuple[float, str]:
    got = row.get("measured") or {}
    if got.get("step_time_s"):
        return float(got["step_time_s"]), "step_time_s"
    if got.get("tokens_per_s"):
        return tokens_per_step / got["tokens_per_s"], "tokens_per_s"
    if got.get("tokens_per_s_per_gpu"):
        return tokens_per_step / (got["tokens_per_s_per_gpu"] * row["num_gpus"]), "tokens_per_s_per_gpu"
    if got.get("tflops_per_gpu") and "Narayanan" in row["source"]:
        s, layer, h, v = row["seq_len"], row["layers"], row["hidden"], row["vocab"]
        flops = 96 * row["global_batch"] * s * layer * h * h * (1 + s / (6 * h) + v / (16 * layer * h))
        return flops / (got["tflops_per_gpu"] * 1e12 * row["num_gpus"]), "tflops_per_gpu (Narayanan Eq. 3)"
    if got.get("tflops_per_gpu"):
        flops = tokens_per_step * model_flops_per_token(row, params_active)
        return flops / (got["tflops_per_gpu"] * 1e12 * row["num_gpus"]), f"tflops_per_gpu ({MODEL_FLOPS})"
    raise ValueError("reports none of step_time_s, tokens_per_s, tokens_per_s_per_gpu or tflops_per_gpu (MFU alone "
                     "is not converted: sources define it differently): add one of them from the source")


def convert_row(row: dict) -> dict:
    """Header fields and the one step of a published row; ValueError when it cannot be converted, saying what to
    fix."""
    missing = [k for k in REQUIRED if not (isinstance(row.get(k), int) and not isinstance(row.get(k), bool)
                                           and row[k] >= 1)]
    missing += [k for k in ("model", "source", "gpu") if not (isinstance(row.get(k), str) and row[k].strip())]
    if missing:
        raise ValueError(f"{', '.join(missing)} missing, or not a positive whole number / a name: fill in from the "
                         f"source")
    name = row["model"]
    text = f"{row['source']} {row.get('notes', '')} {row.get('framework') or ''}"
    gated = any(k in name.lower() for k in ("llama", "grok"))
    dims = {k: row.get(k) for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "experts", "top_k",
                                    "expert_ffn", "shared_experts")}
    dims = {k: v or 0 for k, v in dims.items()}
    dims["kv_heads"] = dims["kv_heads"] or dims["heads"]
    dims["head_dim"] = dims["hidden"] // dims["heads"]
    dims["moe_layers"] = dims["layers"] if dims["experts"] else 0
    total, active = count_params(**dims, gated=gated, tied=not gated)
    model = {k: None for k in MODEL_FIELDS}
    model.update({k: v or None for k, v in dims.items()}, name=name, model_type="published",
                 params_total=total, params_active=active, linear_attention_layers=0, sparse_attention_layers=0)
    model["moe_layers"] = dims["moe_layers"]
    fsdp = "FSDP" in text or ("ZeRO-3" in text and row["tp"] * row["pp"] == 1)
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
                seq_len=row["seq_len"], recompute=_recompute(row.get("recompute")), dtype=precision, etp=etp)
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
