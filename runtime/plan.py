"""Plan: how one training run is laid out over devices, as JSON with a schema version.

The planner (`onboard.plan`, `predictors/`) writes it, the training loop (`runtime.train`) and the
bundle's `train.sh` read it, and every run log carries it, so the predictor learns from exactly the
fields it later predicts for. Degrees multiply to the world size:

    world = dp_replicate * dp_shard * tp * pp * cp

Expert parallelism does not add a factor: the EP group is carved out of the data-parallel ranks
(dp_replicate * dp_shard * cp must be divisible by ep), as in torchtitan and Megatron-Core, so expert
weights are split `ep` ways and sharded by FSDP2 over the remaining data-parallel ranks.

MoE parallel folding (Megatron-Core, arXiv 2504.14960) builds the expert mesh from all the ranks of a stage
instead: its own `etp` x `ep` x edp over the tp x dp x cp ranks, so the MoE layers need not inherit the
attention's tp and ep may span tensor-parallel ranks (ep dividing tp * dp * cp / etp rather than dp * cp).
`etp` is that expert-tensor-parallel degree, Megatron-Core's `expert_tensor_parallel_size`: None (the default)
is the layout above; a number means the plan is folded. The cost model prices folded plans; runtime.parallel
does not lay them out yet (`runtime.parallel.runnable.not_runnable`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from runtime import bounded
from runtime.errors import InputError

SCHEMA_VERSION = 4  # 2: the field `swap` is called `offload`; 3: pipeline fields `pp_schedule`, `pp_layers`;
# 4: `etp` (MoE parallel folding). Version 1 differs only in that name, and measured run logs
# (predictors/data/runlogs/) keep their version-1 plans, so all are read (a plan without the pipeline fields or
# `etp` takes their defaults). A plan is written at the lowest version that holds it: one that is not folded
# leaves `etp` out and says 3, byte for byte what it was before version 4 (bundles and run logs stay current and
# a version-3 runtime still reads it); a folded plan says 4, so an older runtime refuses it by its version
# rather than as an unknown field.
READABLE_VERSIONS = (1, 2, 3, 4)
UNFOLDED_VERSION = 3  # what a plan without `etp` is written as
RENAMED = {"swap": "offload"}  # a field's old name -> its name now

RECOMPUTE = ("none", "selective", "full")  # selective: attention / MoE internals; full: whole decoder layers
OFFLOAD = ("none", "moe", "all")  # which matmul / grouped-matmul outputs are saved to host memory
DTYPES = ("fp32", "bf16", "fp16", "fp8")
PP_SCHEDULES = ("1f1b", "gpipe")  # torch.distributed.pipelining's Schedule1F1B and ScheduleGPipe
MAX_DEGREE = 2**20  # no layout has more ranks along one axis; larger figures are typos (1e9) or overflow
MAX_TOKENS = 2**26  # sequence length / loss chunk bound, far above any released context


@dataclass
class LoRA:
    rank: int = 16
    alpha: float = 32.0
    targets: list[str] = field(default_factory=lambda: ["attention", "experts"])


@dataclass
class Plan:
    dp_replicate: int = 1
    dp_shard: int = 1  # FSDP2 shard degree
    tp: int = 1
    ep: int = 1
    pp: int = 1
    cp: int = 1
    micro_batch: int = 1  # sequences per device per micro-step
    grad_accum: int = 1
    seq_len: int = 4096
    recompute: str = "none"
    offload: str = "none"
    loss_chunk: int | None = None  # tokens per loss chunk; None: full logits
    lora: LoRA | None = None  # None: full training
    dtype: str = "bf16"
    overlap: bool = True  # expert compute overlaps the All-to-All
    pp_schedule: str = "1f1b"  # the pipeline schedule (pp > 1), one of PP_SCHEDULES
    pp_layers: list[int] | None = None  # decoder layers per pipeline stage (the planner's cost balance); None: even
    etp: int | None = None  # MoE parallel folding's expert-tensor-parallel degree; None: not folded (module doc)
    # filled by the predictor; absent for a hand-written plan
    predicted: dict = field(default_factory=dict)  # step_time_s, tokens_per_s, memory_per_device_bytes

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def folded(self) -> bool:
        """Whether the expert mesh is folded over the tp x dp x cp ranks (Megatron-Core MoE parallel folding)."""
        return self.etp is not None

    @property
    def expert_tp(self) -> int:
        """Ways each expert's weights are split by tensor parallelism: etp when folded, else the attention's tp."""
        return self.etp if self.etp is not None else self.tp

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.micro_batch * self.grad_accum * self.dp

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def problems(self, num_experts: int | None = None) -> list[str]:
        """Why this plan cannot run (empty when it can)."""
        out = []
        for name in ("dp_replicate", "dp_shard", "tp", "ep", "pp", "cp", "micro_batch", "grad_accum", "seq_len"):
            if getattr(self, name) < 1:
                out.append(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.recompute not in RECOMPUTE:
            out.append(f"recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if self.offload not in OFFLOAD:
            out.append(f"offload must be one of {', '.join(OFFLOAD)}, got {self.offload!r}")
        if self.etp is not None:
            stage = self.tp * self.dp * self.cp  # the ranks of one pipeline stage, which the expert mesh folds
            if self.etp < 1:
                out.append(f"etp must be at least 1, got {self.etp}")
            elif stage % (self.etp * self.ep):
                out.append(f"folded, etp*ep={self.etp}*{self.ep} must divide the ranks of a pipeline stage "
                           f"tp*dp*cp={stage}")
        elif self.ep > 1 and (self.dp * self.cp) % self.ep:
            out.append(f"ep={self.ep} must divide the data-parallel ranks dp*cp={self.dp * self.cp} (or fold the "
                       f"expert mesh over tp*dp*cp={self.tp * self.dp * self.cp}: set etp, MoE parallel folding)")
        if num_experts is not None and self.ep > 1 and num_experts % self.ep:
            out.append(f"ep={self.ep} must divide the {num_experts} experts")
        if self.pp_layers is not None and len(self.pp_layers) != self.pp:
            out.append(f"pp_layers names {len(self.pp_layers)} stages for pp={self.pp}")
        if self.lora is not None and self.lora.rank < 1:
            out.append(f"LoRA rank must be at least 1, got {self.lora.rank}")
        return out

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if self.etp is None:  # not folded: the version-3 document, unchanged (see SCHEMA_VERSION)
            del d["etp"]
        d["schema_version"] = SCHEMA_VERSION if self.folded else UNFOLDED_VERSION
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        if not isinstance(d, dict):
            raise ValueError(f"a plan is a JSON object, got {type(d).__name__}")  # noqa: TRY004 - callers catch ValueError
        version = d.get("schema_version", SCHEMA_VERSION)
        if version not in READABLE_VERSIONS:
            raise ValueError(f"plan schema version {version} is not supported "
                             f"(this runtime reads {', '.join(map(str, READABLE_VERSIONS))})")
        values = dict(d)
        values.pop("schema_version", None)
        for old, new in RENAMED.items():
            if old in values and new in values:
                raise ValueError(f"plan has both {new!r} and its old name {old!r}; keep only {new!r}")
            if old in values:
                values[new] = values.pop(old)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown plan field(s): {', '.join(map(repr, unknown))}")
        if values.get("lora") is not None:
            values["lora"] = _lora(values["lora"])
        problems = _field_problems(values)
        if problems:
            raise ValueError("; ".join(problems))
        return cls(**values)

    @classmethod
    def load(cls, path) -> Plan:
        """A plan file: a regular file, bounded in size and depth, its fields checked; `InputError` (one line naming
        the file) otherwise: the one reader every verb that takes a plan file uses."""
        d = bounded.read_json(path, "plan")  # (Refused: an InputError naming the file)
        if not isinstance(d, dict):
            raise InputError(f"plan {path}: a plan is a JSON object")
        try:
            return cls.from_dict(d)
        except (ValueError, TypeError) as exc:
            raise InputError(f"plan {path}: {exc}") from None


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _field_problems(values: dict) -> list[str]:
    """What is wrong with the types and ranges of a plan's fields, one phrase each (checked as a plan enters)."""
    out = []
    for name in ("dp_replicate", "dp_shard", "tp", "ep", "pp", "cp", "micro_batch", "grad_accum"):
        if name in values and not (_whole(values[name]) and 1 <= values[name] <= MAX_DEGREE):
            out.append(f"{name} must be a whole number from 1 to {MAX_DEGREE}, got {values[name]!r}")
    if values.get("etp") is not None and not (_whole(values["etp"]) and 1 <= values["etp"] <= MAX_DEGREE):
        out.append(f"etp must be a whole number from 1 to {MAX_DEGREE} or null, got {values['etp']!r}")
    for name in ("seq_len", "loss_chunk"):
        value = values.get(name, 1)
        if not (value is None and name == "loss_chunk") and not (_whole(value) and 1 <= value <= MAX_TOKENS):
            out.append(f"{name} must be a whole number of tokens from 1 to {MAX_TOKENS}, got {value!r}")
    for name, allowed in (("recompute", RECOMPUTE), ("offload", OFFLOAD), ("dtype", DTYPES),
                          ("pp_schedule", PP_SCHEDULES)):
        if name in values and values[name] not in allowed:
            out.append(f"{name} must be one of {', '.join(allowed)}, got {values[name]!r}")
    layers = values.get("pp_layers")
    if layers is not None and not (isinstance(layers, list) and layers and all(_whole(n) and n >= 1 for n in layers)):
        out.append(f"pp_layers must be a list of positive layer counts or null, got {layers!r}")
    if "overlap" in values and not isinstance(values["overlap"], bool):
        out.append(f"overlap must be true or false, got {values['overlap']!r}")
    if "predicted" in values and not isinstance(values["predicted"], dict):
        out.append(f"predicted must be an object, got {values['predicted']!r}")
    return out


def _lora(value) -> LoRA:
    """A plan's LoRA settings, checked field by field."""
    if not isinstance(value, dict):
        raise ValueError(f"plan field lora must be an object or null, got {value!r}")
    unknown = sorted(set(value) - {f.name for f in dataclasses.fields(LoRA)})
    if unknown:
        raise ValueError(f"unknown LoRA field(s): {', '.join(map(repr, unknown))} (known: rank, alpha, targets)")
    lora = LoRA(**value)
    if not (_whole(lora.rank) and 1 <= lora.rank <= 65536):
        raise ValueError(f"LoRA rank must be a whole number from 1 to 65536, got {lora.rank!r}")
    if isinstance(lora.alpha, bool) or not isinstance(lora.alpha, (int, float)) or not 0 < lora.alpha < 1e6:
        raise ValueError(f"LoRA alpha must be a positive number, got {lora.alpha!r}")
    if not isinstance(lora.targets, list) or not lora.targets or not all(isinstance(t, str) for t in lora.targets):
        raise ValueError(f"LoRA targets must be a non-empty list of names, got {lora.targets!r}")
    return lora
