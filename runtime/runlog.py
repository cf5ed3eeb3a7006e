"""Run logs: JSON lines that training runs write and the throughput predictor learns from.

One file may hold several runs. Each run starts with a header line and continues with step lines:

    {"kind": "run", "schema_version": 1, "run_id": ..., "source": ..., "model": {...}, "plan": {...},
     "hardware": {"name": ..., "devices": N}, "precision": "fp32"}
    {"kind": "step", "run_id": ..., "step": 3, "step_time_s": ..., "tokens_per_s": ..., "peak_memory_bytes": ...,
     "loss": ..., "expert_tokens": [[...], ...], "comm_time_s": ...,
     "peak_memory_bytes_by_rank": [...], "expert_placement": [null | {...}, ...]}

`model` holds the key dimensions (MODEL_FIELDS; unknown ones are null), a digest of the spec they came
from and, when the writer knows them, `mixers`: the token mixers grouped by kind and shape
(`runtime.dims.Mixer` dicts), which price token mixing layer by layer; records without them (older logs,
published runs) are priced from the linear / sparse layer counts (`runtime.dims.Dims.from_record`).
`expert_tokens` holds, per MoE layer, the
tokens each expert received in the step (all ranks); `expert_placement` (optional, with rebalancing) each layer's
`runtime.moe.placement.Placement` dict in effect for the step, null for the static layout.
`plan` is a `runtime.plan.Plan` dict. Published runs from papers convert into the same format with a
single step line (`source` names the paper), so the predictor reads one format only.

Reading never crashes on a bad line: `read_runs` returns the runs it could rebuild and, for every line or
run it had to drop, where and why.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from runtime import bounded
from runtime.dims import Mixer, mixers_of

SCHEMA_VERSION = 1

MODEL_FIELDS = ("name", "model_type", "layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab",
                "experts", "top_k", "expert_ffn", "shared_experts", "moe_layers", "linear_attention_layers",
                "sparse_attention_layers", "params_total", "params_active")
STEP_NUMBERS = ("step_time_s", "tokens_per_s", "peak_memory_bytes", "loss", "comm_time_s")


def model_record(spec: dict) -> dict:
    """Key dimensions of a model from its ModelSpec JSON (onboard/inspect/spec.py field names), plus a digest."""
    layers = spec.get("layers") or []
    moe = [layer["mlp"] for layer in layers if layer.get("mlp", {}).get("kind") == "moe"]
    dense = [layer["mlp"] for layer in layers if layer.get("mlp", {}).get("kind") == "dense"]
    attn = [layer.get("attention", {}) for layer in layers]
    softmaxish = [a for a in attn if a.get("num_heads")]
    first_moe = moe[0] if moe else {}
    first_attn = softmaxish[0] if softmaxish else {}
    record = {
        "name": spec.get("name"),
        "model_type": spec.get("model_type"),
        "layers": spec.get("num_layers"),
        "hidden": spec.get("hidden_size"),
        "heads": first_attn.get("num_heads"),
        "kv_heads": first_attn.get("num_kv_heads"),
        "head_dim": first_attn.get("head_dim"),
        "ffn": dense[0].get("ffn") if dense else None,
        "vocab": spec.get("vocab_size"),
        "experts": first_moe.get("num_experts"),
        "top_k": first_moe.get("top_k"),
        "expert_ffn": first_moe.get("expert_ffn"),
        "shared_experts": first_moe.get("num_shared_experts") if moe else None,
        "moe_layers": len(moe),
        "params_total": spec.get("params_total"),
        "params_active": spec.get("params_active"),
        **mixer_fields(mixers_of(attn)),
    }
    record["digest"] = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    return record


def mixer_fields(mixers: tuple[Mixer, ...]) -> dict:
    """A record's mixer list and its linear / sparse layer counts (what readers older than the list use)."""
    return {"linear_attention_layers": sum(m.layers for m in mixers if m.linear),
            "sparse_attention_layers": sum(m.layers for m in mixers if m.sparse),
            "mixers": [m.to_dict() for m in mixers]}


def why_not_appendable(path) -> str | None:
    """Why a run may not be appended to `path` (None: it may): only a new file or a run log is written to, never a
    file of the user's that happens to be named (`--runlog notes.txt`), a FIFO or a device."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return None
    if not bounded.is_regular(path):
        return f"{path}: not a regular file; a run log is appended to a run log or a new file"
    with open(path, "rb") as f:
        first = f.readline(1 << 20)
    if not first.strip():
        return None if path.stat().st_size == 0 else f"{path}: does not start with a run log's header line"
    try:
        header = bounded.loads(first, str(path), "run log")
    except bounded.Refused:
        header = None
    if not (isinstance(header, dict) and header.get("kind") == "run" and "schema_version" in header):
        return f"{path}: not a run log (its first line is no run header); name a new file or a run log"
    return None


class RunLogWriter:
    """Appends one run to a JSON-lines file; each line is flushed so a killed run keeps what it wrote. A file that
    is not a run log is refused (`why_not_appendable`, ValueError)."""

    def __init__(self, path, *, model: dict, plan: dict, hardware: dict, precision: str, source: str = "runtime",
                 run_id: str | None = None, meta: dict | None = None):
        self.path = Path(path)
        self.run_id = run_id or f"{int(time.time() * 1000):x}"
        why = why_not_appendable(self.path)
        if why:
            raise ValueError(why)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")  # noqa: SIM115 - held for the whole run, closed by close()
        record = {k: model.get(k) for k in (*MODEL_FIELDS, "digest")}
        if model.get("mixers") is not None:  # optional: published runs know no per-layer mixers
            record["mixers"] = model["mixers"]
        self._write({"kind": "run", "schema_version": SCHEMA_VERSION, "run_id": self.run_id, "source": source,
                     "model": record, "plan": plan, "hardware": hardware, "precision": precision, "meta": meta or {}})

    def step(self, step: int, *, step_time_s: float, tokens_per_s: float, peak_memory_bytes: int | None = None,
             loss: float | None = None, expert_tokens: list | None = None, comm_time_s: float | None = None,
             peak_memory_bytes_by_rank: list | None = None, expert_placement: list | None = None):
        record = {"kind": "step", "run_id": self.run_id, "step": step, "step_time_s": step_time_s,
                  "tokens_per_s": tokens_per_s, "peak_memory_bytes": peak_memory_bytes, "loss": loss,
                  "expert_tokens": expert_tokens, "comm_time_s": comm_time_s}
        if peak_memory_bytes_by_rank is not None:
            record["peak_memory_bytes_by_rank"] = peak_memory_bytes_by_rank
        if expert_placement is not None:
            record["expert_placement"] = expert_placement
        self._write(record)

    def eval(self, step: int, *, loss: float, tokens: int):
        """The held-out loss after `step` steps (mean over `tokens` target tokens of every rank) and its
        perplexity."""
        self._write({"kind": "eval", "run_id": self.run_id, "step": step, "loss": loss,
                     "perplexity": math.exp(min(loss, 700.0)), "tokens": tokens})

    def _write(self, record: dict):
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self):
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclass
class Run:
    header: dict
    steps: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)  # held-out losses, when the run had eval data

    @property
    def model(self) -> dict:
        return self.header["model"]

    @property
    def plan(self) -> dict:
        return self.header["plan"]

    @property
    def hardware(self) -> dict:
        return self.header["hardware"]

    @property
    def source(self) -> str:
        return self.header.get("source", "runtime")

    def step_time_s(self, warmup: int = 1) -> float:
        """Median step time, leaving out the first `warmup` steps when there are more than that."""
        times = [s["step_time_s"] for s in sorted(self.steps, key=lambda s: s["step"])]
        if len(times) > warmup:
            times = times[warmup:]
        return statistics.median(times)


@dataclass
class Skipped:
    where: str  # "file:line" or "file run <id>"
    reason: str


def _check_header(record: dict) -> str | None:
    if record.get("schema_version") != SCHEMA_VERSION:
        return f"schema version {record.get('schema_version')!r} is not {SCHEMA_VERSION}"
    for key, kind in (("run_id", str), ("model", dict), ("plan", dict), ("hardware", dict)):
        if not isinstance(record.get(key), kind):
            return f"header field {key!r} missing or not a {kind.__name__}"
    return None


def _check_step(record: dict) -> str | None:
    if not isinstance(record.get("step"), int):
        return "step number missing or not an integer"
    t = record.get("step_time_s")
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 < t < math.inf:
        return f"step_time_s must be a positive finite number, got {t!r}"
    for key in STEP_NUMBERS[1:]:
        v = record.get(key)
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)):
            return f"{key} must be a number or null, got {v!r}"
        if v is not None and key != "loss" and not math.isfinite(v):  # a diverged run's loss is worth seeing
            return f"{key} must be finite, got {v!r}"
    return None


def _check_eval(record: dict) -> str | None:
    if not isinstance(record.get("step"), int):
        return "eval step missing or not an integer"
    if not isinstance(record.get("loss"), (int, float)) or isinstance(record.get("loss"), bool):
        return f"eval loss must be a number, got {record.get('loss')!r}"
    return None


def read_runs(paths) -> tuple[list[Run], list[Skipped]]:
    """Every complete run in `paths` (files or directories of *.jsonl), and what was skipped and why."""
    files: list[Path] = []
    for p in map(Path, [paths] if isinstance(paths, (str, Path)) else paths):
        files.extend(sorted(p.rglob("*.jsonl")) if p.is_dir() else [p])
    runs: dict[tuple[str, str], Run] = {}
    skipped: list[Skipped] = []
    for path in files:
        try:
            # a regular file of bounded size (a FIFO would block the reader, a device never end); bytes that are
            # not UTF-8 (a torn write, a stray binary) spoil their own line, not the file
            lines = bounded.read_text(path, "run log", errors="replace").splitlines()
        except bounded.Refused as e:
            skipped.append(Skipped(str(path), e.reason))
            continue
        for number, line in enumerate(lines, 1):
            where = f"{path}:{number}"
            if not line.strip():
                continue
            try:
                record = bounded.loads(line, where, "run log")
            except bounded.Refused as e:
                skipped.append(Skipped(where, e.reason))
                continue
            if not isinstance(record, dict):
                skipped.append(Skipped(where, "not a JSON object"))
                continue
            kind = record.get("kind")
            if kind == "run":
                problem = _check_header(record)
                if problem:
                    skipped.append(Skipped(where, problem))
                else:
                    runs[(str(path), record["run_id"])] = Run(record)
            elif kind in ("step", "eval"):
                run = runs.get((str(path), record.get("run_id")))
                problem = (_check_step(record) if kind == "step" else _check_eval(record)) or (
                    None if run else f"no header for run {record.get('run_id')!r}")
                if problem:
                    skipped.append(Skipped(where, problem))
                else:
                    (run.steps if kind == "step" else run.evals).append(record)
            else:
                skipped.append(Skipped(where, f"unknown record kind {kind!r}"))
    complete = []
    for (path, run_id), run in runs.items():
        if run.steps:
            complete.append(run)
        else:
            skipped.append(Skipped(f"{path} run {run_id}", "no valid step lines"))
    return complete, skipped
