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
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from onboard.bundle_files import bundle_source, load_adapter, read_bundle, read_verification
from onboard.errors import OnboardError, one_line
from onboard.train_request import TrainRequest
from runtime.plan import Plan
from runtime.train.job import FILE as JOB_FILE
from runtime.train.job import TrainJob

# twin config fields that grow with --width (head count grows, head size stays)
_WIDE = ("hidden", "heads", "kv_heads", "ffn", "expert_ffn", "shared_ffn")


def read_plan(path) -> Plan:
    try:
        return Plan.load(path)
    except (ValueError, TypeError) as exc:
        raise OnboardError(f"plan {path}: {exc}") from None


def train_config(bundle, *, layers: int | None = None, width: int = 1, trust_remote_code: bool = False) -> dict:
    """The config the loop trains: the bundle's tiny twin, or its first `layers` layers at twin width,
    `width` times wider (more heads of the same size, wider MLPs)."""
    bundle, _, origin = read_bundle(bundle)
    return scaled_config(bundle_source(origin, trust_remote_code), layers=layers, width=width, name=str(bundle))


def scaled_config(source, *, layers: int | None = None, width: int = 1, name: str = "") -> dict:
    """`source`'s tiny twin config, or its first `layers` layers at twin width, `width` times wider."""
    from onboard.config_dict import get, put, truncate_layers, walk
    from onboard.shrink import meaning_of
    from onboard.twin import build_twin
    from onboard.twin_config import twin_config

    if width < 1 or (layers is not None and layers < 1):
        raise OnboardError("--layers and --width must be at least 1")
    bundle = name or source.name
    if layers is None:
        twin = build_twin(source, run_check=False)
        cfg, shrinks = twin.config.to_dict(), twin.shrinks
    else:
        plan = twin_config(source)  # shrunk by field names, or by what the fields drive where names fall short
        cfg, shrinks, key = plan.cfg, plan.shrinks, plan.layers_key
        if key is None:
            raise OnboardError(f"{bundle}: the model config has no layer count to set")
        full = get(cfg, key)
        if layers > full:
            raise OnboardError(f"{bundle}: the model has {full} layers; --layers may not exceed that")
        truncate_layers(cfg, key, full, layers)
    if width > 1:
        shrunk = {s.path: s.meaning for s in shrinks}  # meanings found by behaviour where the names had none
        for path, key, value in list(walk(cfg)):
            if (shrunk.get(path, meaning_of(key)) in _WIDE and isinstance(value, int) and not isinstance(value, bool)
                    and value > 0):
                put(cfg, path, value * width)
    return cfg


_FIELD_MEANINGS = {"hidden": "hidden", "heads": "heads", "kv_heads": "kv_heads", "head_dim": "head_dim",
                  "ffn": "ffn", "vocab": "vocab", "experts": "experts", "top_k": "top_k",
                  "expert_ffn": "expert_ffn", "shared_experts": "n_shared"}
# a mixer's size -> the meaning (onboard.twin.MEANINGS) of the config field that holds it; linear attention
# and state-space mixers keep their head counts and head sizes in fields of their own, looked at first
_MIXER_MEANINGS = {"heads": "heads", "head_dim": "head_dim", "v_head_dim": "v_head_dim", "window": "window",
                   "index_topk": "index_topk", "index_heads": "index_heads", "index_head_dim": "index_head_dim",
                   "state_size": "ssm_state"}
_FAMILY_MEANINGS = {"linear:": {"heads": ("linear_v_heads", "linear_heads", "linear_k_heads"),
                                "head_dim": ("linear_head_dim",)},
                    "ssm:": {"heads": ("ssm_heads",), "head_dim": ("ssm_head_dim",)}}


def trained_record(spec: dict, full: dict, cfg: dict, model: torch.nn.Module, found: list | None = None) -> dict:
    """The run log's model fields for what is really trained: the spec's full-scale numbers, each taken
    from the config field that holds it at full scale (`full`) and read back from the trained config. Fields
    of no known name count too where the twin shrank them by what they were seen to drive (`found`: the
    `onboard.shrink.Shrink`s of `onboard.twin_config`), after every named one."""
    import dataclasses
    import hashlib

    from onboard.config_dict import get, walk
    from onboard.shrink import meaning_of
    from runtime.dims import grouped, mixers_of
    from runtime.model_tree import find_layer_stack
    from runtime.moe.block import MoEBlock
    from runtime.runlog import mixer_fields, model_record

    record = model_record(spec)
    full_hidden = record["hidden"] or 0
    sizes = [(path, key, value) for path, key, value in walk(full) if meaning_of(key) and isinstance(value, int)]

    def trained(value, meanings) -> tuple[bool, object]:
        """(whether a full-scale field holds `value`, the trained config's value of the likeliest one: the
        first of `meanings`, then any other)."""
        rank = {meaning: i for i, meaning in enumerate(meanings)}
        holders = [(rank.get(meaning_of(key), len(rank)), path) for path, key, v in sizes if v == value]
        holders += [(len(rank) + 1, f.path) for f in found or () if f.full == value and f.meaning != "layers"]
        return bool(holders), get(cfg, min(holders)[1]) if holders else None

    for name, meaning in _FIELD_MEANINGS.items():
        value = record.get(name)
        held, got = trained(value, (meaning,))
        if isinstance(got, int) and not isinstance(got, bool):
            record[name] = got
        elif name == "head_dim" and value and record.get("heads") and not held:  # implied: hidden / heads
            record[name] = record["hidden"] // record["heads"]
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    if blocks:
        record["experts"], record["top_k"] = blocks[0].spec.num_experts, blocks[0].spec.top_k
    record["layers"] = next((cfg[k] for k in ("num_hidden_layers", "num_layers", "n_layer") if k in cfg), None) \
        or len(find_layer_stack(model)[1])  # no field named for it: count the decoder layers

    def scaled(mixer):
        family = next((m for prefix, m in _FAMILY_MEANINGS.items() if mixer.kind.startswith(prefix)), {})
        changes = {}
        for name, meaning in _MIXER_MEANINGS.items():
            value = getattr(mixer, name)
            if not value:
                continue
            held, got = trained(value, (*family.get(name, ()), meaning))
            if isinstance(got, int) and not isinstance(got, bool):
                changes[name] = got
            elif name == "head_dim" and not held and mixer.heads and value == full_hidden // mixer.heads:
                changes[name] = record["hidden"] // changes.get("heads", mixer.heads)  # implied: hidden / heads
        return dataclasses.replace(mixer, **changes)

    # the twin and --layers N both train a prefix of the full model's layers; shapes that differed at full
    # scale may coincide once shrunk, hence grouped again
    kept = mixers_of(layer.get("attention", {}) for layer in spec.get("layers", [])[:record["layers"]])
    record.update(mixer_fields(grouped(scaled(m) for m in kept)))
    record["moe_layers"] = len(blocks)
    record["name"] = f"{spec.get('name')} (trained config)"
    total = sum(p.numel() for p in model.parameters())
    idle = sum(sum(p.numel() for p in b.experts.parameters()) * (1 - b.spec.top_k / b.spec.num_experts)
               for b in blocks)
    embedding = model.get_input_embeddings().weight.numel() if hasattr(model, "get_input_embeddings") else 0
    record["params_total"], record["params_active"] = total, int(total - idle - embedding)
    record["digest"] = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return record


def build_model(bundle, layers: int | None = None, width: int = 1, config: str | None = None,
                trust_remote_code: bool = False, weights: str | None = None):
    """Model factory for `runtime.train`: the adapted model and its run-log record.

    `config` is a JSON file written by `train_config` (the launcher computes it once for every rank).
    `weights` (a model directory with safetensors shards, as `weights_source` resolved it): the model of that
    directory's config, built on the meta device and adapted, with what the loop needs to read its weights
    once it is parallelised (`runtime.train.weights.Pretrained`).
    """
    from onboard.twin_config import twin_config

    if weights is not None:
        return _pretrained_model(bundle, weights, trust_remote_code)
    bundle, spec, origin = read_bundle(bundle)
    cfg = json.loads(Path(config).read_text()) if config else train_config(
        bundle, layers=layers, width=width, trust_remote_code=trust_remote_code)
    source = bundle_source(origin, trust_remote_code)
    try:
        model_config = type(source.config).from_dict(cfg)
    except Exception as exc:  # noqa: BLE001 - config validators we do not own
        raise OnboardError(f"{bundle}: the training config is invalid: {one_line(exc)}") from None
    model = source.build(model_config, experts_implementation="grouped_mm")
    load_adapter(bundle).adapt(model)
    twin = twin_config(source)  # the fields the twin shrank by what they drive, where names fell short
    record = trained_record(spec, source.config.to_dict(), cfg, model, twin.shrinks if twin.why_probed else [])
    declare_tensor_parallel(model, spec, source.config.to_dict(), cfg)
    return model, record


def declare_tensor_parallel(model: torch.nn.Module, spec: dict, full: dict, cfg: dict) -> None:
    """Tell `runtime.parallel` which modules of the adapted `model` tensor parallelism may split: the spec's
    softmax-family attention layers and dense MLPs, in the layers the model has, and every layer's attention and
    MLP (the blocks sequence parallelism gathers the sequence for). Head counts are the trained
    config's (`cfg`), read from the fields that hold the spec's at full scale (`full`), as the run log's are. The
    runtime adds the shared experts of its MoE blocks itself."""
    from runtime.parallel.mesh import TP_ATTENTION
    from runtime.parallel.tensor import Heads, declare

    prefix = spec["layers_path"]
    kept = list(enumerate(spec.get("layers", [])))[:len(model.get_submodule(prefix))]
    split = [(i, layer) for i, layer in kept if (layer.get("attention") or {}).get("kind") in TP_ATTENTION]
    attention = {}
    if split:  # the record of the split layers alone: its first attention's heads are theirs, not a linear one's
        record = trained_record({**spec, "layers": [layer for _, layer in split]}, full, cfg, model)
        if record.get("heads") and record.get("kv_heads"):
            heads = Heads(record["heads"], record["kv_heads"])
            attention = {f"{prefix}.{i}.{layer['attention']['path']}": heads for i, layer in split}
    mlps = [f"{prefix}.{i}.{layer['mlp']['path']}" for i, layer in kept
            if (layer.get("mlp") or {}).get("kind") == "dense" and layer["mlp"].get("path")]
    blocks = [f"{prefix}.{i}.{part['path']}" for i, layer in kept
              for part in (layer.get("attention") or {}, layer.get("mlp") or {}) if part.get("path")]
    declare(model, attention=attention, mlps=mlps, blocks=blocks)


def weights_source(bundle, model: str, *, online: bool = False, trust_remote_code: bool = False):
    """The model directory `--weights MODEL` names (a local directory, the HuggingFace cache, or the Hub with
    `online`), checked against the bundle: same model type, safetensors present."""
    from onboard.source import resolve

    bundle, _, origin = read_bundle(bundle)
    source = resolve(model, online=online, trust_remote_code=trust_remote_code)
    if source.path is None or not any(Path(source.path).glob("*.safetensors")):
        raise OnboardError(f"{model}: no *.safetensors weights in {source.path or 'it (a config only)'}")
    ours = bundle_source(origin, trust_remote_code).config.model_type
    if source.config.model_type != ours:
        raise OnboardError(f"{model}: a {source.config.model_type} model; the bundle {bundle} adapts {ours}")
    return source


def _pretrained_model(bundle, weights: str, trust_remote_code: bool):
    """(model on the meta device, adapted; run-log record; Pretrained) for `build_model(weights=...)`."""
    from onboard.source import resolve
    from runtime.train.weights import Pretrained

    bundle, spec, _ = read_bundle(bundle)
    source = resolve(weights, trust_remote_code=trust_remote_code)
    model = source.build(device="meta", experts_implementation="grouped_mm")
    try:
        pretrained = Pretrained.prepare(model, source.path, load_adapter(bundle).adapt)
    except ValueError as exc:
        raise OnboardError(str(exc)) from None
    cfg = source.config.to_dict()
    record = trained_record(spec, cfg, cfg, model)
    declare_tensor_parallel(model, spec, cfg, cfg)
    return model, record, pretrained


FACTORY = "onboard.train:build_model"


def command(job_file, world: int) -> list[str]:
    """The torchrun command line of a job whose file is `job_file`, for `world` processes."""
    return ["torchrun", "--standalone", f"--nproc-per-node={world}", "-m", "runtime.train", "--job", str(job_file)]


def run(request: TrainRequest, job: TrainJob) -> int:
    """`onboard train`: check the bundle, the plan and the job, then train in this process or through torchrun.
    `request.weights` (MODEL): the released model instead of the twin (`weights_source`); `job.data` /
    `job.eval_data`: token files, or text tokenised with the model's tokenizer into packed corpora
    (`onboard.data`)."""
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
        read_plan(bundle / "plan.json") if (bundle / "plan.json").is_file() else Plan(dtype="fp32", seq_len=32))
    from runtime.parallel.mesh import not_runnable

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
    runlog = Path(job.runlog) if job.runlog else bundle / "runs" / "train.jsonl"
    if weights is not None:
        _record_launch(checkpoint_dir, bundle, weights, plan)
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
            config = Path(scratch) / "config.json"
            config.write_text(json.dumps(train_config(bundle, layers=request.layers, width=request.width,
                                                      trust_remote_code=request.trust_remote_code), sort_keys=True))
            job.model_kwargs = {**kwargs, "config": str(config)}
        job_file = Path(scratch) / JOB_FILE
        job_file.write_text(job.to_json())
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        try:
            return subprocess.call([sys.executable, "-m", "torch.distributed.run",
                                    *command(job_file, plan.world_size)[1:]], env=env)
        except KeyboardInterrupt:
            return 130


LAUNCH = "launch.json"  # in a checkpoint folder: what `onboard export` needs to rebuild the trained model


def bundle_code_digest(bundle: Path) -> str:
    """sha256 of the code a bundle runs in training (adapter.py, generated/*.py) and its spec: what a checkpoint
    records of the bundle that wrote it, so an export runs that code and no other."""
    digest = hashlib.sha256()
    for path in [bundle / "spec.json", bundle / "adapter.py", *sorted((bundle / "generated").glob("*.py"))]:
        if path.is_file():
            digest.update(path.relative_to(bundle).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _record_launch(checkpoint_dir: Path, bundle: Path, weights: str, plan: Plan) -> None:
    """launch.json: the run's plan and what it was made from. Export reads the plan from it and checks the
    bundle against its digest; it never takes consent (trust_remote_code) or a path to run code from it."""
    from onboard.outputs import write_atomically

    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(checkpoint_dir / LAUNCH, json.dumps(
        {"bundle": str(Path(bundle).resolve()), "bundle_sha256": bundle_code_digest(Path(bundle)),
         "weights": str(Path(weights).resolve()), "plan": plan.to_dict()}, indent=2, sort_keys=True) + "\n")


def _launch(launch_file: Path) -> tuple[dict, Plan]:
    """launch.json's record and plan; one line naming the file and field for anything else."""
    try:
        launch = json.loads(launch_file.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise OnboardError(f"{launch_file}: not a launch record ({one_line(exc, 80)})") from None
    if not isinstance(launch, dict):
        raise OnboardError(f"{launch_file}: not a launch record (a JSON object)")
    for key in ("plan", "bundle_sha256", "weights"):
        if key not in launch:
            raise OnboardError(f"{launch_file}: no '{key}' (written by an older onboard? train again, or export with "
                               f"the onboard that wrote it)")
    if not isinstance(launch["plan"], dict) or not isinstance(launch["weights"], str):
        raise OnboardError(f"{launch_file}: 'plan' must be an object and 'weights' a path")
    try:
        plan = Plan.from_dict(launch["plan"])
    except (ValueError, TypeError, KeyError) as exc:
        raise OnboardError(f"{launch_file}: 'plan' is not a plan ({one_line(exc, 80)})") from None
    return launch, plan


def export(checkpoint, fmt: str, out, *, bundle=None, weights=None, trust_remote_code: bool = False) -> int:
    """`onboard export CHECKPOINT_DIR --format peft|hf --out DIR [--bundle B] [--weights W]`: the newest checkpoint
    of a run trained on released weights, exported as `onboard train --export-*` does at the end of a run: the
    run's own plan (and process count) resumes it with nothing left to train, then writes the export shard by
    shard. The bundle whose code runs is named here (default: the folder above BUNDLE/checkpoints) and must be
    the one the checkpoint was written by (launch.json's digest of its code); consent to run the model's own code
    comes from `trust_remote_code` alone, and with it the released model must be named here too."""
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
    if bundle_code_digest(bundle) != launch["bundle_sha256"]:
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

    broken = incomplete(saved[-1][1])
    if broken:  # resuming would pass over it and train from an older state, or from the released weights
        raise OnboardError(f"{saved[-1][1]} is incomplete ({broken}): export needs the newest checkpoint whole; "
                           f"move it away to export an older one")
    print(f"running {bundle / 'adapter.py'} (the bundle's generated code) to rebuild the trained model", flush=True)
    recorded = folder / JOB_FILE
    try:  # the run's own options (its resume check needs them); never its consent or the code it ran
        job = TrainJob.load(recorded) if recorded.is_file() else TrainJob()
    except ValueError as exc:
        raise OnboardError(str(exc)) from None
    with tempfile.TemporaryDirectory(prefix="onboard-export-") as scratch:
        exports = {"export_hf": None, "export_peft": None, f"export_{fmt}": str(out)}
        job = dataclasses.replace(job, plan=plan.to_dict(), steps=saved[-1][0], checkpoint_dir=str(folder),
                                  runlog=str(Path(scratch) / "export.jsonl"), data=None, eval_data=None, **exports)
        request = TrainRequest(bundle=str(bundle), weights=weights or launch["weights"],
                               trust_remote_code=trust_remote_code)
        return run(request, job)


def _prepared(bundle: Path, path, weights: str | None, mask_prompt: bool, text_field: str):
    """`path` as the loop reads it: token files as they are; text tokenised into a packed corpus under
    BUNDLE/data/ with the model's tokenizer, refused where the adapted model lets packed documents see each
    other (its verification says so)."""
    from onboard.data import is_text, prepare_text

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
    config = json.loads((Path(weights) / "config.json").read_text())
    return prepare_text(path, weights, bundle / "data", mask_prompt=mask_prompt, text_field=text_field,
                        vocab_size=config.get("vocab_size"))


DEVICES_PER_NODE = 8  # what train.slurm asks of each node when the plan's world divides into such nodes


def write_launcher(directory: Path, plan: Plan | None = None) -> None:
    """plan.json (one process by default), train.sh (the torchrun command for it, on one node or several) and
    train.slurm (the same on a Slurm cluster) into a bundle."""
    from onboard.codegen import environment

    plan = plan or Plan()
    (directory / "plan.json").write_text(plan.to_json())
    world = plan.world_size
    # train.sh passes its own arguments on to runtime.train, whose flags are TrainJob's fields
    cmd = ["torchrun", "--standalone", f"--nproc-per-node={world}", "-m", "runtime.train", "--model", FACTORY,
           "--model-kwargs", json.dumps({"bundle": ".", "layers": None, "width": 1}, sort_keys=True),
           "--plan", "plan.json", "--steps", "10", "--checkpoint-dir", "checkpoints", "--runlog", "runs/train.jsonl"]
    nodes = world // DEVICES_PER_NODE if world % DEVICES_PER_NODE == 0 and world > DEVICES_PER_NODE else 1
    program = cmd[cmd.index("-m"):]  # what follows torchrun's own options
    for name, text in (("train.sh", environment().get_template("train.sh.j2").render(
                            world=world, command=" ".join(shlex.quote(c) for c in cmd),
                            program=" ".join(shlex.quote(c) for c in program))),
                       ("train.slurm", environment().get_template("train.slurm.j2").render(
                            world=world, nodes=nodes, per_node=world // nodes))):
        (directory / name).write_text(text)
        (directory / name).chmod(0o755)
