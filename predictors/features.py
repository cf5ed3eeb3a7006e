"""Run logs → rows the learned predictor trains on: cost-model features and the measured step time.

A run whose model, plan or hardware cannot be understood is skipped with a reason, like a bad line in
`runtime.runlog.read_runs`; nothing here raises on bad data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from predictors.costmodel import Estimate, estimate
from predictors.errors import PredictorError
from predictors.hardware import Hardware, identify
from predictors.moe_cost import local_gemm
from runtime.dims import Dims
from runtime.plan import Plan
from runtime.runlog import Skipped, read_runs

RECOMPUTE_LEVEL = {"none": 0, "selective": 1, "full": 2}
# Regime, not identity: no hardware name, no MoE / LoRA flag. The published runs hold two GPU kinds and
# one MoE model, so an identity feature would copy their quirks onto every unseen chip or MoE model;
# the cost model's parts (communication shares, micro-step size) carry over instead.
FEATURES = (
    "log_cost_step", "log_compute_per_micro", "log_tokens_per_device_micro", "log_hidden", "log_layers_stage",
    "frac_recompute", "frac_bubble", "frac_memory", "frac_tp", "frac_cp", "frac_pp", "frac_dp", "frac_ep",
    "frac_offload", "log2_tp", "log2_pp", "log2_cp", "log2_ep", "fsdp", "log2_world", "recompute", "fp8",
    "attention_share", "log_seq_len", "log_vocab_over_hidden", "grad_accum_log2",
    "frac_expert_gemm", "frac_permute", "log_tokens_per_expert", "expert_efficiency", "host_computes",
)
# A feature's old name -> its name now. Only the name changed (not its value or place in the vector), so
# the models trained before the rename, whose metadata lists the old name, still load and predict as before.
RENAMED = {"frac_swap": "frac_offload"}


def features(d: Dims, plan: Plan, hw: Hardware, precision: str, est: Estimate, names=FEATURES) -> list[float]:
    """The feature vector `names` lists (FEATURES for a new model; a saved version's own list, so versions trained
    before a feature was added still predict from what they were trained on)."""
    total = est.step_time_s
    fwd = d.forward_flops_per_token(plan.seq_len)
    values = {
        "log_cost_step": math.log(total),
        "log_compute_per_micro": math.log(max(est.compute_s / plan.grad_accum, 1e-9)),
        "log_tokens_per_device_micro": math.log(plan.micro_batch * plan.seq_len / (plan.cp * plan.tp)),
        "log_hidden": math.log(d.hidden),
        "log_layers_stage": math.log(math.ceil(d.layers / plan.pp)),
        "frac_recompute": est.recompute_s / total, "frac_bubble": est.bubble_s / total,
        "frac_memory": est.memory_s / total, "frac_tp": est.tp_s / total, "frac_cp": est.cp_s / total,
        "frac_pp": est.pp_s / total, "frac_dp": est.dp_s / total, "frac_ep": est.ep_s / total,
        "frac_offload": est.offload_s / total,
        "log2_tp": math.log2(plan.tp), "log2_pp": math.log2(plan.pp), "log2_cp": math.log2(plan.cp),
        "log2_ep": math.log2(plan.ep), "fsdp": float(plan.dp_shard > 1), "log2_world": math.log2(plan.world_size),
        "recompute": RECOMPUTE_LEVEL.get(plan.recompute, 0), "fp8": float(precision == "fp8"),
        "attention_share": d.mixing_flops(plan.seq_len) / fwd,
        "log_seq_len": math.log(plan.seq_len), "log_vocab_over_hidden": math.log(d.vocab / d.hidden),
        "grad_accum_log2": math.log2(plan.grad_accum),
        # MoE regime (predictors.moe_cost): what the experts' GEMMs and permutation add, and the rows each local
        # expert's GEMM gets (0 and 1 for a dense model)
        "frac_expert_gemm": est.expert_gemm_s / total, "frac_permute": est.permute_s / total,
        "log_tokens_per_expert": math.log1p(local_gemm(d, plan)[0]) if d.moe_layers else 0.0,
        "expert_efficiency": est.expert_efficiency,
        # a regime, not a chip: the device computes on the threads that dispatch (a CPU), nothing runs ahead
        "host_computes": float(not hw.dispatch_overlaps),
    }
    return [float(values[name]) for name in names]


@dataclass
class Dataset:
    X: np.ndarray
    cost_step: np.ndarray  # the cost model's step time, seconds
    measured: np.ndarray  # median measured step time, seconds
    groups: list  # model names (leave-one-model-out)
    sources: list
    skipped: list  # runtime.runlog.Skipped
    files: list
    hardware: list = field(default_factory=list)  # the hardware each run ran on (its spec's name)
    moe: np.ndarray | None = None  # whether each run's model routes tokens to experts
    assumed: np.ndarray | None = None  # whether a value of the run was taken from elsewhere (`meta.assumed`)

    @property
    def target(self) -> np.ndarray:
        return np.log(self.measured / self.cost_step)

    def __len__(self) -> int:
        return len(self.measured)

    def subset(self, keep) -> Dataset:
        """The runs where `keep` (a boolean per run) is true."""
        keep = np.asarray(keep, dtype=bool)
        pick = lambda items: [x for x, k in zip(items, keep) if k]  # noqa: E731
        return Dataset(self.X[keep], self.cost_step[keep], self.measured[keep], pick(self.groups),
                       pick(self.sources), self.skipped, self.files, pick(self.hardware),
                       None if self.moe is None else self.moe[keep],
                       None if self.assumed is None else self.assumed[keep])


def load_dataset(paths) -> Dataset:
    paths = [paths] if isinstance(paths, str) else list(paths)
    runs, skipped = read_runs(paths)
    rows, cost, measured, groups, sources, chips, moe, assumed = [], [], [], [], [], [], [], []
    for run in runs:
        where = f"run {run.header.get('run_id')} ({run.source})"
        try:
            hw = identify(run.hardware)
            d = Dims.from_record(run.model)
            plan = Plan.from_dict(run.plan)
            problems = plan.problems(d.experts or None)
            if problems:
                raise PredictorError(problems[0])
            precision = str(run.header.get("precision") or plan.dtype)
            # facts of the run the Plan does not carry (predictors.published writes them into the header's meta)
            meta = run.header.get("meta") if isinstance(run.header.get("meta"), dict) else {}
            est = estimate(d, plan, hw, precision, gradient_overlap=meta.get("gradient_overlap") is not False)
            rows.append(features(d, plan, hw, precision, est))
        except (ValueError, TypeError, KeyError, ArithmeticError) as e:
            skipped.append(Skipped(where, str(e) or type(e).__name__))
            continue
        cost.append(est.step_time_s)
        measured.append(run.step_time_s())
        groups.append(d.name)
        sources.append(run.source)
        chips.append(hw.name)
        moe.append(bool(d.moe_layers))
        assumed.append(bool(meta.get("assumed")))
    X = np.array(rows, dtype=float).reshape(-1, len(FEATURES))
    return Dataset(X, np.array(cost), np.array(measured), groups, sources, skipped, [str(p) for p in paths], chips,
                   np.array(moe, dtype=bool), np.array(assumed, dtype=bool))
