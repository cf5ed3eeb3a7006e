"""One training job: every option of a run, defined once, with its default and its help.

`TrainJob` is what `runtime.train.train` reads, what `python -m runtime.train` (torchrun's program) takes as
`--job job.json` or as flags, what `onboard train` offers on its command line, and what a run writes into its
checkpoint folder as `job.json` (versioned JSON), where a resumed run checks that the options that decide the
math of the steps already taken are the same. Every command-line option is generated from the fields here
(`add_arguments`), so a new option is one field:

    steps: int = option(10, "optimizer steps in the whole run, resumed runs included", kind="positive")

Fields marked `internal` (the model factory's keyword arguments, the run log's extra header fields) are set by
the program that launches a run, not typed by a user. `Options` does the same for any other dataclass of
options (`onboard.train.launch.TrainRequest`: what onboard needs to build the model and prepare the data).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from runtime import bounded

SCHEMA_VERSION = 1
FILE = "job.json"  # in a run's checkpoint folder
# what a resumed run must share with the run that wrote its checkpoints: they decide the steps already taken
RESUME_FIXED = ("model", "seed", "data", "lr", "weight_decay", "betas", "clip", "expert_replicas")


def option(default, help: str, *, kind: str | None = None, flag: str | None = None, metavar: str | None = None,
           internal: bool = False):
    """A field of an options dataclass: its default, its help line, and how the command line reads it. `kind`:
    positive / non_negative (whole numbers), float, text, json, pair (two numbers), switch (a flag that sets
    True), no_switch (a --no-X flag that sets False), plan (a plan.json path read into its dict)."""
    metadata = {"help": help, "kind": kind, "flag": flag, "metavar": metavar, "internal": internal}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def whole_number(least: int):
    """An argparse type: a whole number of at least `least`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        return value
    return parse


def finite_number(least: float):
    """An argparse type: a finite number of at least `least` (a negative clip norm flips the gradient, an infinite
    learning rate makes the weights inf / NaN: refused before anything is built)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < least:
            raise argparse.ArgumentTypeError(f"must be a finite number of at least {least:g}, got {text}")
        return value
    return parse


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON") from None


def _plan_file(text: str) -> dict:
    from runtime.plan import Plan

    try:
        return Plan.load(text).to_dict()
    except (OSError, ValueError) as exc:  # (Plan.load's own message names the file)
        raise argparse.ArgumentTypeError(str(exc)) from None


KINDS = {"positive": whole_number(1), "non_negative": whole_number(0), "float": float,
         "non_negative_float": finite_number(0.0), "text": str, "json": _json,
         "plan": _plan_file}


class Options:
    """Command-line options and JSON for a dataclass whose fields are made with `option`."""

    @classmethod
    def public(cls) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(cls) if not f.metadata.get("internal")]

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, *, defaults: dict | None = None,
                      skip: tuple[str, ...] = (), internal: bool = False) -> None:
        """One argparse option per public field not in `skip` (and per internal one, with `internal`: the
        launcher's own command line); `defaults` replaces a field's default where the program that offers it has
        its own."""
        for f in dataclasses.fields(cls) if internal else cls.public():
            if f.name in skip:
                continue
            meta, flag = f.metadata, f.metadata["flag"] or "--" + f.name.replace("_", "-")
            own = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            default = (defaults or {}).get(f.name, own)
            kind = meta["kind"]
            if kind == "switch":
                parser.add_argument(flag, dest=f.name, action="store_true", help=meta["help"])
            elif kind == "no_switch":
                parser.add_argument(flag, dest=f.name, action="store_false", help=meta["help"])
            elif kind == "pair":
                parser.add_argument(flag, dest=f.name, type=float, nargs=2, default=default, metavar=("B1", "B2"),
                                    help=meta["help"])
            elif kind == "positional":
                parser.add_argument(f.name, help=meta["help"])
            else:
                parser.add_argument(flag, dest=f.name, type=KINDS[kind or "text"], default=default,
                                    metavar=meta["metavar"], help=meta["help"])

    @classmethod
    def from_args(cls, args: argparse.Namespace, **given):
        """The options an argparse namespace holds, with `given` fields set as well."""
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        return cls(**_pairs_as_tuples(cls, {**values, **given}))

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        return {"schema_version": SCHEMA_VERSION, **{k: list(v) if isinstance(v, tuple) else v
                                                      for k, v in out.items()}}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict, where: str = "job"):
        if not isinstance(data, dict):
            raise ValueError(f"{where}: not a JSON object")
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"{where}: schema_version {data.get('schema_version')!r} is not {SCHEMA_VERSION}")
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(names) - {"schema_version"})
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}")
        values = {k: v for k, v in data.items() if k in names}
        for name, value in values.items():
            problem = _misfit(value, names[name])
            if problem:
                raise ValueError(f"{where}: {name} {problem}")
        return cls(**_pairs_as_tuples(cls, values))

    @classmethod
    def load(cls, path):
        # a checkpoint folder's job.json arrives with the folder: a regular file, bounded in size and depth (a FIFO
        # there held `onboard export`); Refused is a ValueError naming the file
        return cls.from_dict(bounded.read_json(path, "job"), str(path))


@dataclass
class TrainJob(Options):
    """Every option of a training run (module docstring)."""
    plan: dict | None = option(None, "plan.json: the parallel layout, micro-batch, memory policies, LoRA "
                                     "(onboard train: default BUNDLE/plan.json)", kind="plan", metavar="PLAN")
    steps: int = option(10, "optimizer steps in the whole run, resumed runs included (default 10)", kind="positive")
    lr: float = option(1e-3, "AdamW learning rate (default 1e-3)", kind="non_negative_float")
    weight_decay: float = option(0.0, "AdamW weight decay (default 0)", kind="non_negative_float")
    betas: tuple = option((0.9, 0.95), "AdamW betas (default 0.9 0.95)", kind="pair")
    clip: float = option(1.0, "largest gradient norm; 0 turns clipping off (default 1)", kind="non_negative_float")
    seed: int = option(0, "seed of the weights and the synthetic data (default 0)", kind="non_negative")
    data: str | None = option(None, "training data: text (.txt, .jsonl, .json, .parquet; onboard train tokenises "
                                    "it with the --weights model's tokenizer and packs it), token ids (.npy, or .bin "
                                    "of uint16) or a packed corpus folder; default: synthetic tokens")
    eval_data: str | None = option(None, "held-out data, as --data: its loss and perplexity go into the run log")
    eval_every: int = option(0, "steps between held-out losses (default 0: at the end)", kind="non_negative")
    eval_batches: int = option(4, "micro-batches per rank each held-out loss averages (default 4)", kind="positive")
    checkpoint_dir: str | None = option(None, "checkpoint folder; a rerun resumes from the newest checkpoint in it "
                                              "(onboard train: default BUNDLE/checkpoints)")
    checkpoint_every: int = option(0, "steps between checkpoints (default 0: at the end)", kind="non_negative")
    keep_checkpoints: int = option(2, "checkpoints kept, the newest (default 2)", kind="positive")
    trust_checkpoint: bool = option(False, "resume from checkpoints whose pickled index names more than DCP's own "
                                           "classes, reading them with torch's readers, which run what they name "
                                           "(only for checkpoints you wrote; never taken from a file)",
                                    kind="switch")
    runlog: str | None = option(None, "run log JSON lines (onboard train: default BUNDLE/runs/train.jsonl)")
    offload_dir: str | None = option(None, "where the plan's CPU offload keeps its file (default: the system "
                                           "temp folder)")
    export_hf: str | None = option(None, "after training: a HuggingFace checkpoint (sharded safetensors, LoRA "
                                         "merged) in DIR, a new folder (needs released weights)", metavar="DIR")
    export_peft: str | None = option(None, "after training: the LoRA adapters as a PEFT adapter in DIR, a new "
                                           "folder (needs released weights)", metavar="DIR")
    rebalance_every: int = option(0, "every N steps, place experts on the EP ranks from the load measured since "
                                     "the last placement (moves parameters and optimizer state; the math is "
                                     "unchanged; default 0: never)", kind="non_negative", metavar="N")
    expert_replicas: int = option(0, "replica rows per EP rank in every MoE layer for copies of hot experts "
                                     "(memory: K experts' weights and optimizer state per rank per layer; "
                                     "default 0)", kind="non_negative", metavar="K")
    threads: int | None = option(None, "torch threads per process (default: OMP_NUM_THREADS or torch's)",
                                 kind="positive")
    progress: bool = option(True, "no progress bar", kind="no_switch", flag="--no-progress")
    model: str | None = option(None, "model factory module:function (runtime.train builds the model with it)",
                               internal=True)
    model_kwargs: dict = option({}, "the factory's keyword arguments (JSON)", kind="json", internal=True)
    run_meta: dict = option({}, "extra fields of the run log's header (JSON)", kind="json", internal=True)

    def resume_conflicts(self, before: TrainJob) -> list[str]:
        """The options that decide the steps already taken and differ from the job that wrote the checkpoints."""
        return [f"{name} {getattr(before, name)!r} (this run: {getattr(self, name)!r})" for name in RESUME_FIXED
                if _comparable(getattr(before, name)) != _comparable(getattr(self, name))]

    def write(self, folder) -> Path:
        """job.json in `folder`, written beside its place and renamed into it."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=folder, prefix=f".{FILE}.", delete=False) as tmp:
            tmp.write(self.to_json())
        os.replace(tmp.name, folder / FILE)
        return folder / FILE


def _pairs_as_tuples(cls, values: dict) -> dict:
    """`values` with every `pair` field a tuple (argparse and JSON give lists)."""
    pairs = {f.name for f in dataclasses.fields(cls) if f.metadata.get("kind") == "pair"}
    return {k: tuple(v) if k in pairs and isinstance(v, list) else v for k, v in values.items()}


def _misfit(value, f: dataclasses.Field) -> str | None:
    """Why `value` cannot be field `f`'s (None when it can)."""
    kind = f.metadata.get("kind")
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if value is None:
        return None if f.default is None else "must not be null"
    if kind in ("switch", "no_switch"):
        return None if isinstance(value, bool) else "must be true or false"
    if kind in ("positive", "non_negative"):
        least = 1 if kind == "positive" else 0
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= least
        return None if ok else f"must be a whole number of at least {least}"
    if kind == "float":
        return None if number and value == value and abs(value) != float("inf") else "must be a finite number"
    if kind == "non_negative_float":
        return None if number and math.isfinite(value) and value >= 0 else "must be a finite number of at least 0"
    if kind == "pair":
        ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        return None if ok else "must be two numbers"
    if kind == "plan" or (f.default_factory is not dataclasses.MISSING and isinstance(f.default_factory(), dict)):
        return None if isinstance(value, dict) else "must be an object"
    if kind == "json":
        return None
    return None if isinstance(value, str) else "must be text"


def _comparable(value):
    return list(value) if isinstance(value, tuple) else value
