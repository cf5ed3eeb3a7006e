"""`onboard export CHECKPOINT_DIR`: the newest checkpoint of a run on released weights, as a PEFT adapter or a
HuggingFace checkpoint, rebuilt with the bundle the run was written by (launch.json's digest) and the run's own job."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from onboard import contract
from onboard.errors import OnboardError, one_line
from onboard.train.launch import LAUNCH, LaunchRecord, bundle_code_digest, run
from onboard.train.request import TrainRequest
from runtime.plan import Plan
from runtime.train.job import FILE as JOB_FILE
from runtime.train.job import TrainJob


def _launch(launch_file: Path) -> tuple[LaunchRecord, Plan]:
    """launch.json's record and plan; one line naming the file and field for anything else."""
    record = LaunchRecord.from_dict(contract.load(launch_file), str(launch_file))
    try:
        plan = Plan.from_dict(record.plan)
    except (ValueError, TypeError, KeyError) as exc:
        raise OnboardError(f"{launch_file}: 'plan' is not a plan ({one_line(exc, 80)})") from None
    return record, plan


def _check_lora(launch_file: Path, plan, newest: Path, trust: bool) -> None:
    """The plan must train what the checkpoint holds: LoRA adapters exactly where it has them (launch.json edited
    to LoRA on a full fine-tune failed inside every rank, a DCP traceback in the line)."""
    if trust:
        return  # (a trusted checkpoint's index is torch's to read; its own error then says what differs)
    from runtime.lora import PREFIX
    from runtime.train.checkpoint_reader import read_metadata

    keys = read_metadata(newest).state_dict_metadata
    adapters = any(f".{PREFIX}" in key for key in keys if key.startswith("model."))
    if adapters != (plan.lora is not None):
        raise OnboardError(f"{launch_file}: its plan {'trains LoRA adapters' if plan.lora else 'is a full fine-tune'}"
                           f" but {newest.name} {'holds none' if plan.lora else 'holds LoRA adapters'}: launch.json "
                           f"was edited, or is another run's")


def export(checkpoint, fmt: str, out, *, bundle=None, weights=None, trust_remote_code: bool = False,
           trust_checkpoint: bool = False) -> int:
    """`onboard export CHECKPOINT_DIR --format peft|hf --out DIR [--bundle B] [--weights W]`: the newest checkpoint
    of a run trained on released weights, exported as `onboard train --export-*` does at the end of a run: the
    run's own plan (and process count) resumes it with nothing left to train, then writes the export shard by
    shard. The bundle whose code runs is named here (default: the folder above BUNDLE/checkpoints) and must be
    the one the checkpoint was written by (launch.json's digest of its code); consent to run the model's own code
    comes from `trust_remote_code` alone, and with it the released model must be named here too; consent to
    read the checkpoint's pickles with torch's own readers from `trust_checkpoint` alone (never job.json's)."""
    from runtime.train.checkpoint import checkpoints

    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        raise OnboardError(f"{checkpoint}: no such checkpoint folder")
    folder = checkpoint.parent if (checkpoint / ".metadata").is_file() else checkpoint
    launch_file = folder / LAUNCH
    if not launch_file.is_file():
        raise OnboardError(f"{checkpoint}: no checkpoints of a run on released weights here ({LAUNCH} is missing: "
                           f"train with --weights)")
    if fmt not in ("peft", "hf"):
        raise OnboardError(f"unknown export format {fmt!r}: choose peft or hf")
    launch, plan = _launch(launch_file)
    bundle = Path(bundle) if bundle is not None else folder.resolve().parent
    if not (bundle / "adapter.py").is_file():
        raise OnboardError(f"{bundle} is not a bundle: name the bundle the run trained with --bundle")
    if bundle_code_digest(bundle) != launch.bundle_sha256:
        raise OnboardError(f"{bundle} is not the bundle these checkpoints were written by (its adapter, generated code "
                           f"or spec differ from the run's): name that bundle with --bundle")
    if trust_remote_code and weights is None:
        raise OnboardError("--trust-remote-code runs the released model's own code: name the model with --weights "
                           "(a path in launch.json is not consent)")
    saved = checkpoints(folder)
    if not saved:
        raise OnboardError(f"{folder}: no complete checkpoint to export")
    if folder != checkpoint and checkpoint.resolve() != saved[-1][1].resolve():
        raise OnboardError(f"{checkpoint} is not the newest checkpoint of {folder} ({saved[-1][1].name}): export "
                           f"the folder, or move the newer ones away")
    from runtime.train.checkpoint import incomplete

    broken = incomplete(saved[-1][1], trust_checkpoint)  # Unsafe (one line) where its index names code
    if broken:  # resuming would pass over it and train from an older state, or from the released weights
        raise OnboardError(f"{saved[-1][1]} is incomplete ({broken}): export needs the newest checkpoint whole; "
                           f"move it away to export an older one")
    _check_lora(launch_file, plan, saved[-1][1], trust_checkpoint)
    print(f"running {bundle / 'adapter.py'} (the bundle's generated code) to rebuild the trained model", flush=True)
    recorded = folder / JOB_FILE
    try:  # the run's own options (its resume check needs them); never its consent or the code it ran
        job = TrainJob.load(recorded) if recorded.is_file() else TrainJob()
    except ValueError as exc:
        raise OnboardError(str(exc)) from None
    with tempfile.TemporaryDirectory(prefix="onboard-export-") as scratch:
        exports = {"export_hf": None, "export_peft": None, f"export_{fmt}": str(out)}
        job = dataclasses.replace(job, plan=plan.to_dict(), steps=saved[-1][0], checkpoint_dir=str(folder),
                                  trust_checkpoint=trust_checkpoint,
                                  runlog=str(Path(scratch) / "export.jsonl"), data=None, eval_data=None, **exports)
        request = TrainRequest(bundle=str(bundle), weights=weights or launch.weights,
                               trust_remote_code=trust_remote_code)
        return run(request, job, record=False)  # launch.json is the run's record: export never rewrites it
