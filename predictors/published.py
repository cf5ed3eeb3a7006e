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
     96 B s l h^2 (1 + s / 6h + V / 16 l h) (it counts the recompute forward), over tflops * num_gpus.
MFU is never used: sources define it differently. `meta.derived_from` records which rule applied.
"""

from __future__ import annotations

import json
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


def hardware_name(gpu: str) -> str:
    if "A100" in gpu:
        return "A100-40G" if "40GB" in gpu else "A100-80G"
    if "H100" in gpu:
        return "H100"
    raise ValueError(f"no hardware spec for {gpu!r}")


def _recompute(value) -> str:
    text = str(value or "none").lower()
    return "full" if text == "full" else "selective" if text.startswith("selective") else "none"


def _step_time(row: dict, tokens_per_step: int) -> tuple[float, str]:
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
    raise ValueError("no step time, tokens/s or convertible TFLOP/s")


def convert_row(row: dict) -> dict:
    """Header fields and the one step of a published row; ValueError when it cannot be converted."""
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
    dp, mb = row["dp"], row["micro_batch"] or 1
    if row["global_batch"] % (mb * dp):
        raise ValueError(f"global batch {row['global_batch']} is not a multiple of micro_batch*dp = {mb * dp}")
    precision = "fp8" if any(k in str(row["precision"]).lower() for k in ("fp8", "float8")) else "bf16"
    plan = Plan(dp_replicate=1 if fsdp else dp, dp_shard=dp if fsdp else 1, tp=row["tp"], pp=row["pp"],
                cp=row["cp"] or 1, ep=row["ep"] or 1, micro_batch=mb, grad_accum=row["global_batch"] // (mb * dp),
                seq_len=row["seq_len"], recompute=_recompute(row["recompute"]), dtype=precision)
    problems = plan.problems(row["experts"])
    if plan.world_size != row["num_gpus"]:
        problems.append(f"degrees multiply to {plan.world_size}, not the {row['num_gpus']} GPUs reported")
    if problems:
        raise ValueError("; ".join(problems))
    step_time, rule = _step_time(row, plan.tokens_per_step)
    peak = (row.get("measured") or {}).get("peak_memory_gib")
    return {
        "source": short_source(row["source"]), "model": model, "plan": plan.to_dict(), "precision": precision,
        "hardware": {"name": hardware_name(row["gpu"]), "devices": row["num_gpus"], "described": row["gpu"]},
        "meta": {"citation": row["source"], "derived_from": rule, "proxy": "PROXY" in row.get("notes", ""),
                 "notes": row.get("notes", "")},
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
        except (ValueError, KeyError, TypeError, ZeroDivisionError) as e:
            left_out.append(f"{src.name}:{number}: {e}")
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
