"""What `onboard report` reads: run logs (runtime/runlog.py) condensed into one `RunData` per run and one
`ExpertLayer` per MoE layer of a run, the damage of each file, and which runs the figures compare.

EP-rank loads come from `runtime.moe.placement`: an expert's tokens are split evenly over its copies, so a
step's imbalance is the busiest EP rank's tokens over the mean, under the placement the step line names (the
static contiguous layout when it names none).
"""

from __future__ import annotations

import functools
import json
import statistics
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from onboard.errors import OnboardError
from runtime.runlog import Run, read_runs

HOT, COLD = 1.5, 0.5  # times the uniform share of a layer's tokens
MOST = 0.5  # "stayed hot": above the threshold in more than this fraction of the steps


@dataclass(frozen=True)
class Flag:
    """An expert that stayed hot or cold: its share of the layer's tokens over the run, in uniform shares, and
    the fraction of steps it spent past the threshold."""
    expert: int
    ratio: float
    steps: float


@dataclass
class ExpertLayer:
    """Tokens per expert of one MoE layer over the steps that recorded them, and the placement of each step."""
    index: int  # among the run's MoE layers
    steps: list[int]
    counts: np.ndarray  # steps x experts, tokens over the whole world
    placements: list  # per step: a runtime.moe.placement.Placement, or None where loads are unknown
    hot_factor: float = HOT
    cold_factor: float = COLD

    @property
    def experts(self) -> int:
        return self.counts.shape[1]

    def ratios(self) -> np.ndarray:
        """Per step and expert: its tokens over the uniform share (NaN for a step that routed nothing)."""
        return self._ratios

    @functools.cached_property
    def _ratios(self) -> np.ndarray:
        totals = self.counts.sum(axis=1, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(totals > 0, self.counts * self.experts / totals, np.nan)

    def rank_loads(self) -> list[np.ndarray | None]:
        """Per step: tokens each EP rank computes (None where the placement is unknown)."""
        return list(self._per_step[0])

    def imbalance(self) -> list[float | None]:
        """Per step: the busiest EP rank's tokens over the mean (1.0 when nothing was routed)."""
        return list(self._per_step[1])

    @functools.cached_property
    def _per_step(self) -> tuple[list, list]:
        """Rank loads and imbalance of every step, computed once per placement for all the steps under it (the
        figures, the table and the summary all ask)."""
        loads: list[np.ndarray | None] = [None] * len(self.steps)
        ratio: list[float | None] = [None] * len(self.steps)
        by_placement: dict = {}
        for i, placement in enumerate(self.placements):
            if placement is not None:
                by_placement.setdefault(placement, []).append(i)
        for placement, rows in by_placement.items():
            block = self.counts[rows] @ _load_matrix(placement)
            means = block.mean(axis=1)
            with np.errstate(invalid="ignore", divide="ignore"):
                worst = np.where(means > 0, block.max(axis=1) / means, 1.0)
            for row, load, value in zip(rows, block, worst):
                loads[row], ratio[row] = load, float(value)
        return loads, ratio

    def changes(self) -> list[int]:
        """Steps whose placement differs from the one before it."""
        return [step for step, before, now in zip(self.steps[1:], self.placements, self.placements[1:])
                if before is not None and now is not None and _layout(before) != _layout(now)]

    def share(self) -> np.ndarray:
        """Per expert: its share of the layer's tokens over the whole run, in uniform shares."""
        total = self.counts.sum()
        return self.counts.sum(axis=0) * self.experts / total if total > 0 else np.ones(self.experts)

    def _flagged(self, past: np.ndarray) -> list[Flag]:
        counted = ~np.isnan(self.ratios()).all(axis=1)
        if not counted.any():
            return []
        fraction = past[counted].mean(axis=0)
        share = self.share()
        return [Flag(e, float(share[e]), float(fraction[e])) for e in np.flatnonzero(fraction > MOST)]

    def hot(self) -> list[Flag]:
        """Experts above `hot_factor` uniform shares in most steps, hottest first."""
        with np.errstate(invalid="ignore"):
            past = self.ratios() > self.hot_factor
        return sorted(self._flagged(past), key=lambda f: (-f.ratio, f.expert))

    def cold(self) -> list[Flag]:
        """Experts below `cold_factor` uniform shares in most steps, coldest first."""
        with np.errstate(invalid="ignore"):
            past = self.ratios() < self.cold_factor
        return sorted(self._flagged(past), key=lambda f: (f.ratio, f.expert))


def _layout(placement):
    """What decides where tokens go: a layout that only gained unused replica rows has not changed."""
    return getattr(placement, "owners", None), getattr(placement, "replicas", None), placement.experts


@functools.lru_cache(maxsize=64)
def _load_matrix(placement) -> np.ndarray:
    """experts x ranks: the fraction of an expert's tokens each rank computes, read off `rank_loads` one expert
    at a time so the split rule stays the placement module's."""
    if isinstance(placement, _SingleRank):
        return np.ones((placement.experts, 1))
    from runtime.moe.placement import rank_loads

    unit = [0.0] * placement.experts
    rows = []
    for e in range(placement.experts):
        unit[e] = 1.0
        rows.append(rank_loads(unit, placement))
        unit[e] = 0.0
    return np.array(rows)


@dataclass
class RunData:
    """One run of a log, condensed for the figures, the page and the summary."""
    index: int  # 1-based: "r<index>" names the run everywhere in the report
    path: Path
    run: Run
    steps: list[dict]  # sorted by step number
    layers: list[ExpertLayer] = field(default_factory=list)
    bad_expert_steps: int = 0  # steps whose expert counts or placement could not be read

    @property
    def name(self) -> str:
        return f"r{self.index}"

    @property
    def model_name(self) -> str:
        return str(self.run.model.get("name") or self.run.model.get("model_type") or "unnamed")

    @property
    def label(self) -> str:
        """Short enough for a legend: the run, the model without its parenthesised note, its size, the plan."""
        model = self.run.model
        short = self.model_name.split(" (")[0]
        size = f" {model['layers']}L/{model['hidden']}d" if model.get("layers") and model.get("hidden") else ""
        return f"{self.name} {short}{size} · {plan_summary(self.run.plan, brief=True)}"

    @property
    def ep(self) -> int:
        ep = self.run.plan.get("ep")
        return ep if isinstance(ep, int) and not isinstance(ep, bool) and ep > 0 else 1

    def series(self, key: str) -> tuple[list[int], list[float]]:
        pairs = [(s["step"], float(s[key])) for s in self.steps if _number(s.get(key))]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def evals(self) -> tuple[list[int], list[float]]:
        pairs = sorted((e["step"], float(e["loss"])) for e in self.run.evals)
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def memory(self) -> tuple[list[int], list[list[int]], bool]:
        """Steps, peak bytes per rank at each, and whether ranks beyond 0 were recorded."""
        steps, per_rank, by_rank = [], [], False
        for s in self.steps:
            ranks = s.get("peak_memory_bytes_by_rank")
            if isinstance(ranks, list) and ranks and all(_number(b) for b in ranks):
                by_rank = True
            elif _number(s.get("peak_memory_bytes")):  # older logs: the one figure they have is rank 0's
                ranks = [s["peak_memory_bytes"]]
            else:
                continue
            steps.append(s["step"])
            per_rank.append([int(b) for b in ranks])
        return steps, per_rank, by_rank

    def median(self, key: str) -> float | None:
        """Median of a step field, leaving out the first (warm-up) step when there are more."""
        values = self.series(key)[1]
        values = values[1:] if len(values) > 1 else values
        return statistics.median(values) if values else None

    def final(self, key: str) -> float | None:
        values = self.series(key)[1]
        return values[-1] if values else None

    def worst_imbalance(self) -> float | None:
        values = [v for layer in self.layers for v in layer.imbalance() if v is not None]
        return max(values) if values else None

    def hottest(self) -> tuple[float, int, int] | None:
        """(share in uniform shares, layer, expert) of the expert with the largest share of its layer."""
        best = None
        for layer in self.layers:
            share = layer.share()
            e = int(share.argmax())
            if best is None or share[e] > best[0]:
                best = (float(share[e]), layer.index, e)
        return best


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value)


def plan_summary(plan: dict, brief: bool = False) -> str:
    """The plan in a few words: degrees above 1, micro-batch (and accumulation), and, unless brief, what else
    shapes a step."""
    names = (("dp_replicate", "dp"), ("dp_shard", "fsdp"), ("tp", "tp"), ("pp", "pp"), ("cp", "cp"), ("ep", "ep"))
    words = [f"{short}{plan[key]}" for key, short in names if isinstance(plan.get(key), int) and plan[key] > 1]
    words = words or ["1 rank"]
    words.append(f"mb{plan.get('micro_batch', '?')}")
    if isinstance(plan.get("grad_accum"), int) and plan["grad_accum"] > 1:
        words.append(f"ga{plan['grad_accum']}")
    if brief:
        return " ".join(words)
    for key in ("recompute", "offload"):
        if plan.get(key) not in (None, "none"):
            words.append(f"{key} {plan[key]}")
    if plan.get("lora"):
        words.append("lora")
    words += [f"seq {plan.get('seq_len', '?')}", str(plan.get("dtype", ""))]
    return " ".join(w for w in words if w)


def hardware_summary(hardware: dict) -> str:
    return f"{hardware.get('devices', '?')} x {hardware.get('name', '?')}"


def _expert_layers(steps: list[dict], ep: int, hot: float, cold: float) -> tuple[list[ExpertLayer], int]:
    """The run's MoE layers from the steps whose counts have the run's usual shape (the others counted bad)."""
    shapes = [_shape(s.get("expert_tokens")) for s in steps]
    common = Counter(shape for shape in shapes if shape is not None).most_common(1)
    if not common:
        return [], sum(s.get("expert_tokens") is not None for s in steps)
    shape = common[0][0]
    kept, placements, bad = [], [], 0
    for s, its in zip(steps, shapes):
        if its != shape:
            bad += s.get("expert_tokens") is not None
            continue
        per_layer = _placements(s.get("expert_placement"), shape, ep)
        if per_layer is None:
            bad += 1
            per_layer = [None] * len(shape)
        kept.append(s)
        placements.append(per_layer)
    layers = []
    for i in range(len(shape)):
        counts = np.array([s["expert_tokens"][i] for s in kept], dtype=float)
        layers.append(ExpertLayer(i, [s["step"] for s in kept], counts, [p[i] for p in placements], hot, cold))
    return layers, bad


def _shape(expert_tokens) -> tuple[int, ...] | None:
    """Experts per layer when the counts are lists of finite non-negative numbers, else None."""
    if not isinstance(expert_tokens, list) or not expert_tokens:
        return None
    shape = []
    for layer in expert_tokens:
        if not isinstance(layer, list) or not layer:
            return None
        values = np.array(layer)
        if values.ndim != 1 or values.dtype.kind not in "iuf" or not np.isfinite(values).all() or (values < 0).any():
            return None
        shape.append(len(layer))
    return tuple(shape)


def _placements(record, shape: tuple[int, ...], ep: int) -> list | None:
    """Per layer: the step's placement (the contiguous layout where it names none; None where that cannot
    exist); None for the whole step when the record is not a placement list of the right length."""
    if record is None:
        record = [None] * len(shape)
    if not isinstance(record, list) or len(record) != len(shape):
        return None
    out = []
    for experts, entry in zip(shape, record):
        if entry is None:
            out.append(_SingleRank(experts) if ep == 1 else _contiguous(experts, ep))
            continue
        placement = _placement(entry) if isinstance(entry, dict) else None
        if placement is None or placement.experts != experts:
            return None
        out.append(placement)
    return out


@dataclass(frozen=True)
class _SingleRank:
    """The layout of a run without expert parallelism: runtime.moe (and with it torch) is imported only for
    runs that have some."""
    experts: int


@functools.lru_cache(maxsize=None)
def _contiguous(experts: int, ep: int):
    from runtime.moe.placement import Placement

    try:
        return Placement.contiguous(experts, ep)
    except ValueError:  # experts that do not split evenly: the runtime could not have run this layout either
        return None


def _placement(entry: dict):
    from runtime.moe.placement import Placement

    try:
        return Placement.from_dict(entry)
    except (ArithmeticError, TypeError, ValueError):  # a log's bytes: whatever they hold, the loads are unknown
        return None


def condense(index: int, path: Path, run: Run, hot: float = HOT, cold: float = COLD) -> RunData:
    steps = sorted(run.steps, key=lambda s: s["step"])
    ep = RunData(index, path, run, steps).ep
    layers, bad = _expert_layers(steps, ep, hot, cold)
    return RunData(index, path, run, steps, layers, bad)


# --- reading ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Damage:
    """The lines of one file that could not be read, said once."""
    path: Path
    lines: int
    first: int
    reason: str

    @property
    def why(self) -> str:
        return " ".join(self.reason.split())[:120]

    def warning(self) -> str:
        return (f"warning: {self.path}: {self.lines} damaged line{'s' if self.lines > 1 else ''} skipped "
                f"(first at line {self.first}: {self.why})")


def log_files(paths) -> list[Path]:
    """The files named, and the *.jsonl files under the folders named, each once."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            files += sorted(path.rglob("*.jsonl"))
        elif path.exists() or path.is_symlink():
            files.append(path)
        else:
            raise OnboardError(f"{path}: no such file or directory")
    for path in files:
        if not path.is_file():  # a FIFO with no writer would block the report, not grow it
            raise OnboardError(f"{path}: not a regular file (a run log is a file runtime.train appends to)")
    return list(dict.fromkeys(files))


def read_logs(files: list[Path], *, growing: bool = False, hot: float = HOT,
              cold: float = COLD) -> tuple[list[RunData], list[Damage]]:
    """Every run with steps in `files`, numbered in file order, and the damage of each file. `growing`: the
    files are still being written, so a last line without its newline is not damage yet, only unfinished."""
    runs: list[RunData] = []
    damage: list[Damage] = []
    with tempfile.TemporaryDirectory(prefix="onboard-report-") as tmp:
        for n, path in enumerate(files):
            found, skipped = _read_snapshot(path, Path(tmp) / f"{n}.jsonl", growing)
            runs += [condense(len(runs) + i + 1, path, run, hot, cold) for i, run in enumerate(found)]
            if skipped:
                damage.append(Damage(path, len(skipped), skipped[0][0], skipped[0][1]))
    return runs, damage


def _read_snapshot(path: Path, copy: Path, growing: bool) -> tuple[list[Run], list[tuple[int, str]]]:
    """The runs of one file and its damaged lines (number, reason). read_runs takes paths, so it reads a copy
    of the bytes read here once: one consistent view of a file being appended to, and garbage bytes that are not
    UTF-8 spoil their own lines, not the whole file."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        if growing:  # removed since it was listed: nothing to show from it now
            return [], []
        raise OnboardError(f"{path}: no such file or directory") from None
    except OSError as exc:
        raise OnboardError(f"cannot read {path}: {exc.strerror or exc}") from None
    if growing and not data.endswith(b"\n"):
        data = data[:data.rfind(b"\n") + 1]
    copy.write_text(data.decode("utf-8", errors="replace"))
    runs, skipped = read_runs([copy])
    lines = []
    for s in skipped:  # "file:line" for a line; "file run <id>" for a header with no steps (not damage)
        number = s.where.rsplit(":", 1)[-1]
        if s.where.startswith(f"{copy}:") and number.isdigit():
            lines.append((int(number), s.reason))
    return runs, sorted(lines)


# --- choosing what to draw -------------------------------------------------------------------------------

MAX_CURVES = 8  # runs overlaid in one figure before the lines stop being tellable apart
MAX_EXPERT_RUNS = 6  # runs whose MoE layers get figures of their own


def _config(run: RunData) -> str:
    """What makes two runs repeats of each other: the same model, plan and hardware."""
    plan = {k: v for k, v in run.run.plan.items() if k != "predicted"}
    return json.dumps([run.run.model, plan, run.run.hardware], sort_keys=True, default=str)


def _distinct(runs: list[RunData]) -> list[RunData]:
    """The newest run of each configuration (a repeat measures the same thing again), in run order."""
    newest = {_config(r): r for r in runs}
    return [r for r in runs if newest[_config(r)] is r]


def pick_curves(runs: list[RunData], limit: int = MAX_CURVES) -> tuple[list[RunData], str]:
    """The runs to overlay, and a note saying how they were chosen when they are not all of them: repeats left
    out, then the rest spread from the slowest to the fastest median tokens/s."""
    if len(runs) <= limit:
        return runs, ""
    distinct = _distinct(runs)
    if len(distinct) <= limit:
        return distinct, f"{len(distinct)} distinct configurations of {len(runs)} runs (repeats left out)"
    ranked = sorted(distinct, key=lambda r: (r.median("tokens_per_s") or 0.0, r.index))
    chosen = {ranked[round(i * (len(ranked) - 1) / (limit - 1))].index for i in range(limit)}
    return ([r for r in runs if r.index in chosen],
            f"{len(chosen)} of {len(runs)} runs, spread from the slowest to the fastest median tokens/s (repeats "
            f"left out); every run is in the table")


def pick_expert_runs(runs: list[RunData], limit: int = MAX_EXPERT_RUNS) -> tuple[list[RunData], str]:
    """The runs whose MoE layers get figures: all that counted tokens per expert when they are few, else the
    most imbalanced ones (across EP ranks first, then by their hottest expert)."""
    counted = [r for r in runs if r.layers]
    if len(counted) <= limit:
        return counted, ""

    def worst(r: RunData):
        return (-(r.worst_imbalance() or 1.0), -(r.hottest() or (0.0,))[0], r.index)

    chosen = {r.index for r in sorted(_distinct(counted), key=worst)[:limit]}
    return ([r for r in counted if r.index in chosen],
            f"the {len(chosen)} most imbalanced of {len(counted)} runs with expert counts (busiest EP rank over the "
            f"mean, then the hottest expert's share)")
