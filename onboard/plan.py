"""Planner front end: a ModelSpec and a device count in, ranked parallel plans (predictors/) out.

Turns the spec into the key dimensions the predictors read (`runtime.runlog.model_record`, the same
fields a run log carries), runs the search, and explains what would fit when nothing does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from onboard.errors import OnboardError
from onboard.inspect.accounting import dims_of
from onboard.inspect.spec import ModelSpec
from onboard.outputs import write_atomically
from onboard.source import resolve
from predictors import learned
from predictors.errors import PredictorError
from predictors.features import features
from predictors.hardware import Hardware, find
from predictors.planner import Candidate, SearchResult, default_global_batch, search
from runtime.dims import Dims
from runtime.plan import MAX_DEGREE, LoRA, Plan

GB = 1e9


def load_spec(ref: str, *, trust_remote_code: bool = False, online: bool = False, cache: bool = True) -> ModelSpec:
    """A spec.json written by `onboard inspect --json` / `onboard adapt`, or any model `inspect` accepts (its
    inspection kept in the spec cache, `onboard.inspect.cache`, unless `cache` is False)."""
    path = Path(ref)
    if path.suffix == ".json" and path.is_file():
        try:
            data = json.loads(path.read_text())
            if isinstance(data, dict):
                data.pop("costs", None)  # `onboard inspect --json` adds them beside the spec
            return ModelSpec.from_dict(data)
        except (ValueError, RecursionError) as e:
            raise OnboardError(f"{path} is not a ModelSpec JSON: {' '.join(str(e).split())}") from None
    from onboard.inspect.cache import cached_spec, catalogue_spec

    if cache and (shipped := catalogue_spec(ref)) is not None:
        return shipped
    source = resolve(ref, trust_remote_code=trust_remote_code, online=online)  # a wrong name fails in a second
    if cache:  # the twin's imports (torch, transformers) take several seconds; inspecting it, several more
        return cached_spec(source)[0]
    from onboard.inspect.inspection import inspect_source

    return inspect_source(source)[0]


def hardware(name: str) -> Hardware:
    try:
        return find(name)
    except PredictorError as e:
        raise OnboardError(str(e)) from None


def load_predictor(path: str | None = None):
    try:
        return learned.load(path)
    except PredictorError as e:
        raise OnboardError(str(e)) from None


@dataclass
class PlanReport:
    spec: ModelSpec
    hardware: Hardware
    devices: int
    result: SearchResult
    global_batch: int
    predictor_label: str
    suggestions: list
    load: object = None  # predictors.imbalance.ExpertLoad measured from --runlog, when given
    assumed_imbalance: float | None = None  # --imbalance, when given
    left_out: str | None = None  # --runlog's runs of other models, said in a line

    def imbalance_note(self) -> str | None:
        """What expert load imbalance the ranking priced, for the best plan's EP degree (and which runs of
        --runlog were of another model, left out)."""
        note = self._imbalance()
        return f"{self.left_out}; {note}" if note and self.left_out else note

    def _imbalance(self) -> str | None:
        c = self.best or self.fastest
        if c is None or (self.load is None and self.assumed_imbalance is None):
            return None
        if c.plan.ep == 1:
            return "expert load imbalance: the best plan has ep=1 (every rank computes its own tokens): not charged"
        if self.load is None:
            return f"expert load imbalance: assumed {self.assumed_imbalance:.2f}x the mean on the busiest EP rank"
        placed = self.load.factor(c.plan.ep, rebalanced=True)
        return (f"expert load imbalance measured in {len(self.load.counts)} layer-steps: at ep={c.plan.ep} the busiest "
                f"rank gets {c.estimate.imbalance:.2f}x the mean tokens in the static layout (priced); a placement "
                f"from the same counts leaves {placed:.2f}x (onboard train --rebalance-every N)")

    @property
    def best(self) -> Candidate | None:
        """The fastest plan that fits and that the runtime runs (what plan.json gets)."""
        return next((c for c in self.result.ranked if not c.not_runnable), None)

    @property
    def fastest(self) -> Candidate | None:
        """The fastest plan that fits, runnable or not."""
        return self.result.ranked[0] if self.result.ranked else None


def _stamp(c: Candidate, hw: Hardware, devices: int, label: str) -> Plan:
    c.plan.predicted = {"step_time_s": round(c.step_time_s, 6), "tokens_per_s": round(c.tokens_per_s, 1),
                        "step_time_interval_s": [round(c.low_s, 6), round(c.high_s, 6)],
                        "memory_per_device_bytes": int(c.memory_bytes), "cost_model_step_time_s":
                        round(c.estimate.step_time_s, 6), "hardware": hw.name, "devices": devices,
                        "predictor": label, "extrapolates_on": c.extrapolates_on}
    return c.plan


def suggest(d: Dims, devices: int, hw: Hardware, *, lora: LoRA | None, seq_len: int, infeasible: list) -> list[str]:
    """What would fit when nothing does: LoRA, more devices; the memory policies were already tried."""
    out = []
    if infeasible:
        c = infeasible[0]
        out.append(f"the leanest plan (tp={c.plan.tp} pp={c.plan.pp} cp={c.plan.cp} ep={c.plan.ep}, "
                   f"recompute={c.plan.recompute}, offload={c.plan.offload}) needs {c.memory_bytes / GB:.1f} GB "
                   f"per device; {hw.name} has {hw.memory_gb:g} GB")
    if lora is None and search(d, devices, hw, lora=LoRA(), seq_len=seq_len).ranked:
        out.append(f"LoRA (--mode lora) fits on {devices} devices")
    for factor in (2, 4, 8, 16, 32, 64):
        more = devices * factor
        if search(d, more, hw, lora=lora, seq_len=seq_len).ranked:
            out.append(f"{more} devices would fit")
            break
    else:
        out.append(f"nothing fits even on {devices * 64} devices")
    return out


IDENTITY = ("model_type", "layers", "hidden", "vocab", "experts", "top_k", "expert_ffn", "moe_layers")


def _other_model(run, mine: dict) -> str | None:
    """How a run's model differs from the one planned (the first field both know and disagree on), or None.
    Names are not compared: one model goes by a hub id, a catalogue name and a folder."""
    theirs = run.model if isinstance(run.model, dict) else {}
    for key in IDENTITY:
        if theirs.get(key) is not None and mine.get(key) is not None and theirs[key] != mine[key]:
            return f"{key} {theirs[key]!r}, the model planned has {mine[key]!r}"
    return None


def expert_load(runlogs, spec: ModelSpec):
    """The per-expert token counts of run logs (files or folders) of `spec`'s model, for `plan_model`'s imbalance,
    and a line naming the runs of other models left out; one-line errors."""
    from predictors.imbalance import ExpertLoad
    from runtime.runlog import model_record, read_runs

    for path in map(Path, runlogs):
        if not path.exists():
            raise OnboardError(f"--runlog {path}: no such file or folder")
        if not path.is_dir() and not path.is_file():
            raise OnboardError(f"--runlog {path}: not a regular file")
    runs, _ = read_runs([p for p in runlogs])
    if not runs:
        raise OnboardError(f"--runlog {', '.join(map(str, runlogs))}: no complete runs in it")
    mine = model_record(spec.to_dict())
    if not mine.get("experts"):
        raise OnboardError("--runlog prices expert load imbalance, and the model has no routed experts")
    others = [(run, why) for run in runs if (why := _other_model(run, mine))]
    runs = [run for run in runs if not _other_model(run, mine)]
    note = None
    if others:
        run, why = others[0]
        if not runs:
            raise OnboardError(f"--runlog: no run of this model (run {run.header.get('run_id')!r} has {why})")
        note = (f"--runlog: {len(others)} run(s) of another model left out (run {run.header.get('run_id')!r} has "
                f"{why})")
    try:
        return ExpertLoad.from_runs(runs, mine["experts"]), note
    except ValueError as e:
        raise OnboardError(f"--runlog: {e}") from None


def plan_model(spec: ModelSpec, *, devices: int, hardware_name: str, mode: str = "full", seq_len: int = 4096,
               global_batch: int | None = None, predictor: str | None = None, runlog=None,
               imbalance: float | None = None) -> PlanReport:
    """Ranked plans for `spec` on `devices` x `hardware_name`. `runlog` (paths): price each EP degree's expert load
    imbalance as these runs measured it (static layout); `imbalance`: an assumed busiest-rank / mean figure."""
    if not 1 <= devices <= MAX_DEGREE:
        raise OnboardError(f"--devices must be from 1 to {MAX_DEGREE}, got {devices}")
    if mode not in ("full", "lora"):
        raise OnboardError(f"--mode must be full or lora, got {mode!r}")
    if global_batch is not None and global_batch < 1:
        raise OnboardError(f"--global-batch must be positive, got {global_batch}")
    if runlog and imbalance is not None:
        raise OnboardError("--runlog measures the expert load imbalance and --imbalance assumes one: give one")
    if imbalance is not None and not 1 <= imbalance < 1e3:
        raise OnboardError(f"--imbalance is the busiest EP rank's tokens over the mean: 1 or more, got {imbalance}")
    hw = hardware(hardware_name)
    d = dims_of(spec)
    load, left_out = expert_load(runlog, spec) if runlog else (None, None)
    skew = load.factor if load is not None else (lambda ep: imbalance) if imbalance is not None else None
    model = load_predictor(predictor)
    lora = LoRA() if mode == "lora" else None
    batch = global_batch or default_global_batch(devices, seq_len)
    result = search(d, devices, hw, lora=lora, seq_len=seq_len, global_batch=batch, predictor=model, imbalance=skew)
    if not result.layouts:
        raise OnboardError(f"no legal layout of {devices} devices for global batch {batch} "
                           f"(it must be a multiple of the data-parallel degree)")
    for c in result.ranked:
        _stamp(c, hw, devices, model.label)
    suggestions = [] if result.ranked else suggest(d, devices, hw, lora=lora, seq_len=seq_len,
                                                   infeasible=result.infeasible)
    return PlanReport(spec, hw, devices, result, batch, model.label, suggestions, load, imbalance, left_out)


def write_plan(plan: Plan, path) -> Path:
    """The plan as JSON at `path` (checked beforehand with `outputs.output_file`), written atomically."""
    return write_atomically(Path(path), plan.to_json())


def predict_plan(spec: ModelSpec, plan_path, *, hardware_name: str, predictor: str | None = None) -> dict:
    plan = Plan.load(plan_path)
    d = dims_of(spec)
    problems = plan.problems(d.experts or None)
    if problems:
        raise OnboardError(f"plan {plan_path}: {'; '.join(problems)}")
    hw = hardware(hardware_name)
    model = load_predictor(predictor)
    step, est, outside = model.explain(d, plan, hw, plan.dtype)
    low, high = model.bounds([features(d, plan, hw, plan.dtype, est, model.feature_names)], [step])
    return {"model": spec.name, "hardware": hw.name, "devices": plan.world_size, "predictor": model.label,
            "extrapolates_on": outside,
            "step_time_s": step, "tokens_per_s": plan.tokens_per_step / step,
            "step_time_interval_s": [float(low[0]), float(high[0])], "interval_coverage": learned.COVERAGE,
            "cost_model_step_time_s": est.step_time_s,
            "memory_per_device_bytes": int(est.memory_per_device_bytes),
            "memory_capacity_bytes": int(hw.memory_bytes),
            "memory_parts_bytes": {k: int(v) for k, v in est.memory.items() if k != "total"}}


def plot_frontier(report: PlanReport, path) -> Path:
    """Predicted tokens/s against memory per device of every plan considered; fitting ones highlighted."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise OnboardError("--plot needs matplotlib (pip install 'onboard[plot]')") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    cap = report.hardware.memory_gb
    fit = report.result.ranked
    over = [c for c in report.result.infeasible if c.memory_bytes / GB <= 2 * cap]  # the far ones say nothing
    ax.scatter([c.memory_bytes / GB for c in over], [c.tokens_per_s for c in over], s=6, c="lightgray",
               label="over memory (cost model)")
    ax.scatter([c.memory_bytes / GB for c in fit], [c.tokens_per_s for c in fit], s=8, label="fits (predicted)")
    frontier, best = [], 0.0
    for c in sorted(fit, key=lambda c: c.memory_bytes):
        if c.tokens_per_s > best:
            best = c.tokens_per_s
            frontier.append((c.memory_bytes / GB, best))
    if frontier:
        ax.step(*zip(*frontier), where="post", color="black", linewidth=1, label="frontier")
    ax.axvline(cap, color="red", linestyle="--", label=f"{report.hardware.name} memory")
    ax.set_xlim(0, 2 * cap)
    ax.set_xlabel("memory per device (GB)")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{report.spec.name} on {report.devices} x {report.hardware.name}")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def train_predictor(logs: list[str] | None, out: str | None, jobs: int | None = None):
    try:
        return learned.train(logs or None, out, jobs=jobs)
    except PredictorError as e:
        raise OnboardError(str(e)) from None


def retrain_predictor(logs: list[str], out: str | None, *, make_default: bool = False, jobs: int | None = None):
    """A new version on what ships plus `logs`, held back where it is worse (`predictors.retrain`)."""
    from predictors.retrain import retrain

    try:
        return retrain(logs, out=out, make_default=make_default, jobs=jobs)
    except PredictorError as e:
        raise OnboardError(str(e)) from None


def predictor_versions(directory: str | None) -> tuple[list[tuple[str, dict]], str | None]:
    """(label, metadata) of each version in `directory` (default: the package's), and the default's label."""
    place = Path(directory) if directory else learned.MODELS_DIR
    if not place.is_dir():
        raise OnboardError(f"{place} is not a directory of predictor versions")
    found = [(f"{learned.STEM}-v{v}", meta) for v, _, meta in learned.versions(place)]
    if not found:
        raise OnboardError(f"no trained predictor in {place}; run `onboard predictor train`")
    try:
        default = f"{learned.STEM}-v{int(learned.latest(place).stem.rsplit('-v', 1)[1])}"
    except PredictorError:
        default = None
    return found, default


def evaluate_predictor(logs: list[str] | None, by: str = "model", measured_only: bool = False,
                       jobs: int | None = None):
    try:
        return learned.evaluate(logs or None, by=by, measured_only=measured_only, jobs=jobs)
    except PredictorError as e:
        raise OnboardError(str(e)) from None
