"""`onboard train BUNDLE`: train a bundle's model, adapted, with the shared runtime's training loop.

The model is built at a size the user chooses (here: the bundle's tiny twin config, optionally deeper
and wider) with random fp32 weights, and the bundle's `adapt(model)` swaps in the runtime blocks. The
training loop itself is `runtime.train`; this module only resolves the bundle, the plan and the model.
World size 1 runs in this process; larger plans go through torchrun with the same command as the
bundle's `train.sh`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from onboard import contract
from onboard.bundle.files import read_bundle, read_verification
from onboard.bundle.launcher import FACTORY
from onboard.errors import OnboardError
from onboard.train.model import build_model, train_config, weights_source
from onboard.train.request import TrainRequest
from runtime import bounded
from runtime.plan import Plan
from runtime.runlog import why_not_appendable
from runtime.train.checkpoint import newest
from runtime.train.job import FILE as JOB_FILE
from runtime.train.job import TrainJob



def command(job_file, world: int) -> list[str]:
    """The torchrun command line of a job whose file is `job_file`, for `world` processes."""
    return ["torchrun", "--standalone", f"--nproc-per-node={world}", "-m", "runtime.train", "--job", str(job_file)]


def run(request: TrainRequest, job: TrainJob, *, record: bool = True) -> int:
    """`onboard train`: check the bundle, the plan and the job, then train in this process or through torchrun.
    `request.weights` (MODEL): the released model instead of the twin (`weights_source`); `job.data` /
    `job.eval_data`: token files, or text tokenised with the model's tokenizer into packed corpora
    (`onboard.train.data`). `record=False` (an export, which reads launch.json) leaves launch.json as it is."""
    bundle, _, _ = read_bundle(request.bundle)
    weights = request.weights
    if (job.export_hf or job.export_peft) and weights is None:
        raise OnboardError("--export-hf / --export-peft write the released model trained: give --weights MODEL")
    if weights is not None:
        if request.layers is not None or request.width != 1:
            raise OnboardError("--weights trains the model as released: --layers and --width do not apply")
        weights = str(weights_source(bundle, weights, online=request.online,
                                     trust_remote_code=request.trust_remote_code).path)
    data, eval_data = (_prepared(bundle, path, weights, request.mask_prompt, request.text_field)
                       for path in (job.data, job.eval_data))
    plan = Plan.from_dict(job.plan) if job.plan is not None else (
        Plan.load(bundle / "plan.json") if (bundle / "plan.json").is_file() else Plan(dtype="fp32", seq_len=32))
    from runtime.parallel.runnable import not_runnable

    problems = not_runnable(plan)  # what runtime.train would refuse on every rank, said once before it starts
    if problems:
        where = "--plan" if job.plan is not None else f"plan {bundle / 'plan.json'}"
        raise OnboardError(f"{where} cannot run: {'; '.join(problems)}")
    if (job.rebalance_every or job.expert_replicas) and plan.ep == 1:
        raise OnboardError("--rebalance-every / --expert-replicas place experts on expert-parallel ranks: the "
                           "plan has ep=1")
    for path in (data, eval_data):
        if path is not None and not Path(path).exists():
            raise OnboardError(f"{path}: no such token file")
    checkpoint_dir = Path(job.checkpoint_dir) if job.checkpoint_dir else bundle / "checkpoints"
    if checkpoint_dir.is_dir():  # a checkpoint whose index names code is refused here, before any rank reads it
        newest(checkpoint_dir, job.trust_checkpoint)
    runlog = Path(job.runlog) if job.runlog else bundle / "runs" / "train.jsonl"
    why = why_not_appendable(runlog)  # before anything is built or any rank starts
    if why:
        raise OnboardError(why)
    if weights is not None and record:
        record_launch(checkpoint_dir, bundle, weights, plan)
    kwargs = {"bundle": str(bundle), "layers": request.layers, "width": request.width,
              "trust_remote_code": request.trust_remote_code, "weights": weights}
    exports = {f"export_{kind}": str(Path(place).resolve()) if place else None
               for kind, place in (("hf", job.export_hf), ("peft", job.export_peft))}
    job = dataclasses.replace(job, plan=plan.to_dict(), data=str(data) if data else None,
                              eval_data=str(eval_data) if eval_data else None, checkpoint_dir=str(checkpoint_dir),
                              runlog=str(runlog), model=FACTORY, model_kwargs=kwargs, **exports)
    if plan.world_size == 1:
        from runtime.train import train

        if job.threads:
            torch.set_num_threads(job.threads)
        try:
            train(lambda: build_model(**kwargs), plan, job)
        except ValueError as exc:  # the runtime's one-line complaints about its inputs
            raise OnboardError(str(exc)) from None
        return 0
    with tempfile.TemporaryDirectory(prefix="onboard-train-") as scratch:
        if weights is None:  # the twin's config, computed once here for every rank
            model_config = train_config(bundle, layers=request.layers, width=request.width,
                                        trust_remote_code=request.trust_remote_code)
            config = Path(scratch) / "config.json"
            config.write_text(json.dumps(model_config, sort_keys=True))
            job.model_kwargs = {**kwargs, "config": str(config)}
        else:
            model_config = _released_config(weights)
        # what every rank would refuse with the model's own expert count, said once before any rank starts
        problems = plan.problems(num_experts=experts_of(model_config))
        if problems:
            raise OnboardError(f"the plan cannot run on this model: {'; '.join(problems)}")
        job_file = Path(scratch) / JOB_FILE
        job_file.write_text(job.to_json())
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        try:
            return torchrun(job_file, plan.world_size, env)
        except KeyboardInterrupt:
            return 130


def _released_config(weights) -> dict:
    """The config.json of released weights (a folder); {} where it cannot be read (the ranks then say why)."""
    try:
        config = bounded.read_json(Path(weights) / "config.json", "bundle file")
    except bounded.Refused:
        return {}
    return config if isinstance(config, dict) else {}


def experts_of(config: dict) -> int | None:
    """The routed expert count of a model config (the first field whose name means it, at any depth: a
    multimodal config's text model), or None for a dense model."""
    from onboard.twin.fields import sizes_by_meaning

    return next((value for _, value in sizes_by_meaning(config).get("experts", []) if value > 1), None)


def torchrun(job_file: Path, world: int, env: dict) -> int:
    """Run `python -m runtime.train --job job_file` on `world` processes of this node under torchrun; its exit code.
    (The one place a multi-process run starts: the tests' zygote takes its place where a test is about the run, not
    the launcher.)"""
    return subprocess.call([sys.executable, "-m", "torch.distributed.run", *command(job_file, world)[1:]], env=env)


LAUNCH = "launch.json"  # in a checkpoint folder: what `onboard export` needs to rebuild the trained model
LAUNCH_VERSION = 1
LAUNCH_READABLE = (0, 1)  # version 0: the same fields without schema_version, as runs wrote them before


@dataclass
class LaunchRecord(contract.Document):
    """launch.json: what a run on released weights was launched from. Export reads the plan from it and checks the
    bundle against its digest; it never takes consent (trust_remote_code) or a path to run code from it, so a
    field of that kind is not one of its fields and refused."""

    bundle: str  # where the bundle was (a record: export names the bundle on its command line or finds it above)
    bundle_sha256: str  # `bundle_code_digest` of the bundle whose code wrote the checkpoints
    weights: str  # the released model's folder (a record: --weights names it again for remote code)
    plan: dict  # the run's `runtime.plan.Plan`, as JSON
    schema_version: int = LAUNCH_VERSION

    @classmethod
    def from_dict(cls, data, where: str = LAUNCH) -> LaunchRecord:
        """The record read back; one line (OnboardError) naming `where` and the field that does not fit."""
        return contract.read(cls, data, where, version=LAUNCH_VERSION, readable=LAUNCH_READABLE)


def bundle_code_digest(bundle: Path) -> str:
    """sha256 of the code a bundle runs in training (adapter.py, generated/*.py) and its spec: what a checkpoint
    records of the bundle that wrote it, so an export runs that code and no other."""
    digest = hashlib.sha256()
    for path in [bundle / "spec.json", bundle / "adapter.py", *sorted((bundle / "generated").glob("*.py"))]:
        if path.is_file():
            digest.update(path.relative_to(bundle).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def record_launch(checkpoint_dir: Path, bundle: Path, weights: str, plan: Plan) -> None:
    """launch.json (`LaunchRecord`): the run's plan and what it was made from."""
    from onboard.outputs import write_atomically

    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    record = LaunchRecord(str(Path(bundle).resolve()), bundle_code_digest(Path(bundle)), str(Path(weights).resolve()),
                          plan.to_dict())
    write_atomically(checkpoint_dir / LAUNCH, record.to_json())


def _prepared(bundle: Path, path, weights: str | None, mask_prompt: bool, text_field: str):
    """`path` as the loop reads it: token files as they are; text tokenised into a packed corpus under
    BUNDLE/data/ with the model's tokenizer, refused where the adapted model lets packed documents see each
    other (its verification says so)."""
    from onboard.train.data import is_text, prepare_text

    if path is None or not is_text(path):
        if mask_prompt and path is not None:
            raise OnboardError(f"{path}: --mask-prompt applies to text data (.jsonl / .parquet with prompts)")
        return path
    if weights is None:
        raise OnboardError(f"{path}: text is tokenised with the model's own tokenizer: give --weights MODEL (the "
                           f"tiny twin's shrunken vocabulary fits no real tokenizer)")
    verification = read_verification(bundle)
    if verification is None:
        raise OnboardError(f"{bundle}: no verification.json, which says whether the adapted model keeps packed "
                           f"documents apart: verify the bundle first (onboard verify {bundle})")
    packed = verification.packed
    if packed and not packed.get("kept_apart"):
        raise OnboardError(f"{bundle}: training on packed text needs documents kept apart, and this adapted model "
                           f"lets them see each other ({packed.get('why', 'see verification.json')})")
    return prepare_text(path, weights, bundle / "data", mask_prompt=mask_prompt, text_field=text_field,
                        vocab_size=_released_config(weights).get("vocab_size"))
