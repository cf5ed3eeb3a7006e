"""Released weights into the adapted model (`onboard train --weights`, `runtime.train.weights`), issue 16.

Tiny HuggingFace models of three families (a softmax MoE, a hybrid with linear attention, an MLA + shared-expert
MoE) are saved with `save_pretrained` in several safetensors shards (transformers writes the released layout:
Mixtral's experts one tensor each under `block_sparse_moe`, which loading merges into the model's stacks), adapted
into a bundle, and trained with their weights: the first step's loss is HuggingFace's own loss of
`from_pretrained` on the same batch, in one process and in four (FSDP2 + expert parallelism + LoRA). A checkpoint
that does not fit (missing shard, another model, a corrupt header, a missing tensor) is one line, before anything
is read.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from cli import main
from onboard.train.launch import LaunchRecord
from onboard.train.model import build_model
from runtime.plan import LoRA, Plan
from runtime.runlog import read_runs
from runtime.train import TrainJob, train
from runtime.train import data as token_data
from runtime.train.weights import HFLayout, Pretrained, ReleasedWeights, load_weights
from tests.helpers import ROOT, released_model, run_cli

FAMILIES = ("mixtral", "qwen3_next", "deepseek_v3")
SEQ = 16


@pytest.fixture(scope="module")
def released(released_models):
    """(model directory, bundle) by family: the session's released models (tests/runtime/conftest.py)."""
    return {family: released_models(family) for family in FAMILIES}


def _hf_loss(model_dir, dp: int) -> float:
    """HuggingFace's own loss of the saved model on the loop's first batch of every data-parallel rank, averaged."""
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = token_data.SyntheticTokens(ref.config.vocab_size, SEQ, 0)
    losses = []
    for rank in range(dp):
        ids = token_data.batch(tokens, 0, 0, rank, grad_accum=1, dp=dp, micro_batch=1)
        with torch.no_grad():
            losses.append(float(ref(input_ids=ids, labels=ids, use_cache=False).loss))
    return sum(losses) / dp


@pytest.mark.parametrize("family", FAMILIES)
def test_training_from_released_weights_starts_from_their_loss(family, released):
    model_dir, bundle = released[family]
    assert len(list(model_dir.glob("*.safetensors"))) > 2  # several shards, with an index
    result = train(lambda: build_model(bundle, weights=str(model_dir)), Plan(dtype="fp32", seq_len=SEQ),
                   TrainJob(steps=1, progress=False))
    assert result.steps[0].loss == pytest.approx(_hf_loss(model_dir, 1), rel=1e-6)


def test_tied_embeddings_stay_one_tensor(tmp_path):
    """A model whose head shares the embedding: its checkpoint holds the embedding once; after allocation the two
    are one tensor again (so they train as one) and the loss is HuggingFace's."""
    model_dir, bundle = released_model("qwen3_moe", tmp_path, tie_word_embeddings=True)
    built = {}

    def factory():
        made = build_model(bundle, weights=str(model_dir))
        built["model"] = made[0]
        return made

    result = train(factory, Plan(dtype="fp32", seq_len=SEQ), TrainJob(steps=1, progress=False))
    model = built["model"]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert result.steps[0].loss == pytest.approx(_hf_loss(model_dir, 1), rel=1e-6)


def test_released_experts_are_merged_into_the_runtime_stacks(released):
    """Mixtral's checkpoint holds each expert's w1 / w2 / w3; the adapted model holds the runtime's stacks (the
    same tensors as transformers' `gate_up_proj` / `down_proj`): every expert's rows land where transformers
    puts them."""
    model_dir, bundle = released["mixtral"]
    checkpoint = ReleasedWeights(model_dir)
    assert "model.layers.0.block_sparse_moe.experts.1.w3.weight" in checkpoint.keys()
    model, _, pretrained = build_model(bundle, weights=str(model_dir))
    model.to_empty(device="cpu")
    pretrained.load(model)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    theirs = reference.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, theirs[pretrained.names[key]]), key
    stack = model.get_submodule("model.layers.0.mlp.experts").gate_up
    ffn = stack.shape[1] // 2
    assert torch.equal(stack[1, ffn:], checkpoint.get("model.layers.0.block_sparse_moe.experts.1.w3.weight"))


def _copy_model(model_dir, to):
    shutil.copytree(model_dir, to)
    return to


def test_a_checkpoint_that_does_not_fit_is_one_line_before_reading(released, tmp_path):
    model_dir, bundle = released["mixtral"]
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    first_file = sorted(set(index["weight_map"].values()))[0]

    gone = _copy_model(model_dir, tmp_path / "gone")
    (gone / first_file).unlink()
    with pytest.raises(ValueError, match=f"{first_file}: missing"):
        ReleasedWeights(gone)

    corrupt = _copy_model(model_dir, tmp_path / "corrupt")
    (corrupt / first_file).write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        ReleasedWeights(corrupt)

    other_dir, _ = released["deepseek_v3"]
    model = AutoModelForCausalLM.from_config(AutoModelForCausalLM.from_pretrained(model_dir).config)
    with pytest.raises(ValueError, match=r"does not fit the model: \d+ model tensor\(s\) missing .*; \d+ checkpoint"):
        Pretrained.prepare(model, other_dir, adapt=lambda m: None)

    emptied = _copy_model(model_dir, tmp_path / "emptied")
    (emptied / "model.safetensors.index.json").unlink()
    for f in emptied.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors weights"):
        ReleasedWeights(emptied)


def test_a_tensor_of_the_wrong_shape_is_named(released, tmp_path):
    model_dir, _ = released["mixtral"]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.config.vocab_size += 1
    bigger = AutoModelForCausalLM.from_config(model.config)
    layout = HFLayout.of(bigger)
    with pytest.raises(ValueError, match=r"2 shape\(s\) differ \(first: lm_head.weight \(\d+, \d+\) in the "
                                         r"checkpoint, \(\d+, \d+\) in the model; model.embed_tokens.weight"):
        load_weights(bigger, ReleasedWeights(model_dir), layout, layout.names(bigger))


def test_cli_refuses_weights_of_another_model_and_twin_options(released, capsys, tmp_path):
    model_dir, bundle = released["mixtral"]
    other_dir, _ = released["qwen3_next"]
    assert main(["train", str(bundle), "--weights", str(other_dir), "--steps", "1"]) == 1
    assert "a qwen3_next model; the bundle" in capsys.readouterr().err
    assert main(["train", str(bundle), "--weights", str(model_dir), "--layers", "1"]) == 1
    assert "--layers and --width do not apply" in capsys.readouterr().err
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(model_dir / "config.json", config_only)
    assert main(["train", str(bundle), "--weights", str(config_only), "--steps", "1"]) == 1
    assert f"{config_only}: no *.safetensors weights" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_four_processes_with_fsdp_expert_parallelism_and_lora_start_from_the_released_loss_and_export_agreeing(forked_torchrun, 
        released, tmp_path):
    """One run of four processes (FSDP2 + EP + LoRA): the first step's loss is HuggingFace's own on every rank's
    batch, the adapters train, and the exports gather every shard and expert slice: the PEFT adapter on the
    released model and the merged checkpoint (written from the same trained state by another path) give the same
    logits."""
    from peft import PeftModel

    model_dir, bundle = released["mixtral"]
    plan = tmp_path / "plan.json"
    plan.write_text(Plan(dp_shard=4, ep=2, lora=LoRA(rank=4, alpha=8, targets=["attention", "experts"]),
                         dtype="fp32", seq_len=SEQ).to_json())
    log = tmp_path / "run.jsonl"
    assert main(["train", str(bundle), "--weights", str(model_dir), "--plan", str(plan), "--steps", "2", "--lr",
                 "0.01", "--runlog", str(log), "--checkpoint-dir", str(tmp_path / "ck"), "--threads", "1",
                 "--export-peft", str(tmp_path / "peft"), "--export-hf", str(tmp_path / "hf")]) == 0  # 1 thread a rank
    steps = [json.loads(line) for line in log.read_text().splitlines() if json.loads(line).get("kind") == "step"]
    assert steps[0]["loss"] == pytest.approx(_hf_loss(model_dir, 4), rel=1e-6)
    assert steps[1]["loss"] != steps[0]["loss"]  # the adapters trained
    ids = torch.randint(3, 200, (1, SEQ), generator=torch.Generator().manual_seed(7))
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    before = _logits(base, ids)
    via_peft = _logits(PeftModel.from_pretrained(base, tmp_path / "peft"), ids)
    via_hf = _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32), ids)
    assert _rel(via_peft, via_hf) < 1e-5 and _rel(via_hf, before) > 1e-3


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids, use_cache=False).logits


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_training_exports_a_peft_adapter_and_a_merged_checkpoint_that_reload_as_trained(family, released,
                                                                                             tmp_path):
    """LoRA on attention and expert stacks, trained a few steps, then exported: the PEFT adapter on the unmodified
    HuggingFace model, and the merged checkpoint through `from_pretrained`, give the trained model's logits."""
    from peft import PeftModel

    model_dir, bundle = released[family]
    built = {}

    def factory():
        made = build_model(bundle, weights=str(model_dir))
        built["model"] = made[0]
        return made

    plan = Plan(dtype="fp32", seq_len=SEQ, lora=LoRA(rank=4, alpha=8, targets=["attention", "experts"]))
    train(factory, plan, TrainJob(steps=3, lr=1e-2, progress=False, export_peft=str(tmp_path / "peft"),
                                     export_hf=str(tmp_path / "hf")))
    ids = torch.randint(3, 200, (1, SEQ), generator=torch.Generator().manual_seed(5))
    trained = _logits(built["model"], ids)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert _rel(_logits(base, ids), trained) > 1e-3  # the adapters learned something
    assert _rel(_logits(PeftModel.from_pretrained(base, tmp_path / "peft"), ids), trained) < 1e-5
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert _rel(_logits(merged, ids), trained) < 1e-5
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) >= 1


def test_a_full_fine_tune_exports_a_checkpoint_shard_by_shard(released, tmp_path):
    from runtime.train.export import export_hf

    model_dir, bundle = released["mixtral"]
    built = {}

    def factory():
        made = build_model(bundle, weights=str(model_dir))
        built["model"], built["pretrained"] = made[0], made[2]
        return made

    train(factory, Plan(dtype="fp32", seq_len=SEQ), TrainJob(steps=2, lr=1e-2, progress=False))
    export_hf(built["model"], built["pretrained"], tmp_path / "hf", shard_bytes=100_000)
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) > 2
    ids = torch.randint(3, 200, (1, SEQ), generator=torch.Generator().manual_seed(6))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert _rel(_logits(reloaded, ids), _logits(built["model"], ids)) < 1e-5


def test_onboard_export_writes_from_a_saved_checkpoint_what_the_run_exported(released, tmp_path, capsys):
    """`onboard export CHECKPOINT_DIR` resumes the run's newest checkpoint with its own plan and nothing left to
    train, and writes the same adapters the run exported at its end."""
    from safetensors.torch import load_file

    model_dir, bundle = released["mixtral"]
    plan = tmp_path / "plan.json"
    plan.write_text(Plan(dtype="fp32", seq_len=SEQ, lora=LoRA(rank=4, alpha=8, targets=["attention", "experts"]))
                    .to_json())
    ck = tmp_path / "ck"
    assert main(["train", str(bundle), "--weights", str(model_dir), "--plan", str(plan), "--steps", "2", "--lr",
                 "0.01", "--checkpoint-dir", str(ck), "--runlog", str(tmp_path / "run.jsonl"), "--export-peft",
                 str(tmp_path / "at-end")]) == 0
    # launch.json is a versioned record, and not consent: it has no field to switch remote code on with (refused
    # in one line), and an edit that names another bundle changes nothing
    launch = json.loads((ck / "launch.json").read_text())
    assert launch["schema_version"] == 1 and LaunchRecord.from_dict(launch).to_dict() == launch
    (ck / "launch.json").write_text(json.dumps({**launch, "trust_remote_code": True}))
    capsys.readouterr()
    assert main(["export", str(ck), "--format", "peft", "--out", str(tmp_path / "later"), "--bundle", str(bundle)]) == 1
    assert "'trust_remote_code' is not a field of LaunchRecord" in capsys.readouterr().err
    del launch["schema_version"]  # as runs wrote it before it had a version: read as version 0
    (ck / "launch.json").write_text(json.dumps({**launch, "bundle": str(tmp_path)}))
    assert main(["export", str(ck), "--format", "peft", "--out", str(tmp_path / "later"), "--bundle", str(bundle)]) == 0
    assert f"running {bundle / 'adapter.py'}" in capsys.readouterr().out
    assert json.loads((ck / "launch.json").read_text())["bundle"] == str(tmp_path)  # export never rewrites it
    at_end = load_file(tmp_path / "at-end" / "adapter_model.safetensors")
    later = load_file(tmp_path / "later" / "adapter_model.safetensors")
    assert at_end.keys() == later.keys() and all(torch.equal(at_end[k], later[k]) for k in at_end)
    capsys.readouterr()
    # issue 55: launch.json's plan edited to a full fine-tune of this LoRA run: refused in one line before any rank
    # (each rank failed inside DCP, its traceback in the line), and the refused export leaves launch.json as it was
    edited = json.dumps({**launch, "plan": {**launch["plan"], "lora": None}})
    (ck / "launch.json").write_text(edited)
    capsys.readouterr()
    assert main(["export", str(ck), "--format", "hf", "--out", str(tmp_path / "x"), "--bundle", str(bundle)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a full fine-tune but" in err[0] and "holds LoRA adapters" in err[0], err
    assert (ck / "launch.json").read_text() == edited
    (ck / "launch.json").write_text(json.dumps(launch))
    assert main(["export", str(tmp_path), "--format", "hf", "--out", str(tmp_path / "x")]) == 1
    assert "launch.json is missing" in capsys.readouterr().err
    # the bundle must be the one that wrote the checkpoints, named on the command line
    assert main(["export", str(ck), "--format", "hf", "--out", str(tmp_path / "x")]) == 1
    assert "is not a bundle: name the bundle the run trained with --bundle" in capsys.readouterr().err
    other = Path(shutil.copytree(bundle, tmp_path / "other"))
    with open(other / "adapter.py", "a") as f:
        f.write("# another bundle\n")
    assert main(["export", str(ck), "--format", "hf", "--out", str(tmp_path / "x"), "--bundle", str(other)]) == 1
    assert "is not the bundle these checkpoints were written by" in capsys.readouterr().err
    assert main(["export", str(ck), "--format", "hf", "--out", str(tmp_path / "x"), "--bundle", str(bundle),
                 "--trust-remote-code"]) == 1
    assert "name the model with --weights" in capsys.readouterr().err
    for broken in ("[]", "{}", '{"plan": 3, "bundle_sha256": "x", "weights": "w"}', "not json"):
        (ck / "launch.json").write_text(broken)
        assert main(["export", str(ck), "--format", "hf", "--out", str(tmp_path / "x"), "--bundle", str(bundle)]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "launch.json" in err[0] and "Traceback" not in err[0], err
    assert not (tmp_path / "x").exists()
    # issue 55: the newest checkpoint's index a pickle that names code, as a checkpoint handed over may: refused
    # in one line, and nothing ran (torch's reader runs it: tests/runtime/test_checkpoint_reader.py)
    import pickle

    from runtime.train.checkpoint import checkpoints

    (ck / "launch.json").write_text(json.dumps(launch))
    marker = tmp_path / "ran"
    planted = type("Planted", (), {"__reduce__": lambda self: (os.system, (f"touch {marker}",))})
    (checkpoints(ck)[-1][1] / ".metadata").write_bytes(pickle.dumps(planted()))
    assert main(["export", str(ck), "--format", "peft", "--out", str(tmp_path / "x"), "--bundle", str(bundle)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "posix.system" in err[0] and "--trust-checkpoint" in err[0], err
    assert not marker.exists() and not (tmp_path / "x").exists()


def test_exports_are_checked_before_training(released, tmp_path, capsys):
    model_dir, bundle = released["mixtral"]
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    assert main(["train", str(bundle), "--weights", str(model_dir), "--export-hf", str(taken)]) == 1
    assert "exists: an export never replaces anything" in capsys.readouterr().err
    assert (taken / "keep.txt").read_text() == "mine"
    assert main(["train", str(bundle), "--export-peft", str(tmp_path / "new")]) == 1
    assert "give --weights MODEL" in capsys.readouterr().err
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    assert main(["train", str(bundle), "--weights", str(model_dir), "--export-peft", str(a_file / "x")]) == 1
    assert "is not a writable folder" in capsys.readouterr().err
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if not os.access(locked, os.W_OK):  # root writes anywhere: nothing to refuse then
            assert main(["train", str(bundle), "--weights", str(model_dir), "--export-hf", str(locked / "x")]) == 1
            assert "is not a writable folder" in capsys.readouterr().err
    finally:
        locked.chmod(0o700)


def _run_losses(log: Path) -> list[float]:
    from runtime.runlog import read_runs

    runs, _ = read_runs([log])
    return [s["loss"] for run in runs for s in run.steps]


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return released_model("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))


def _train_args(bundle, model_dir, plan, ck, log, steps: int, *extra) -> list[str]:
    """`onboard train`'s arguments for the kill-and-resume runs: one torch thread in every process."""
    return ["train", str(bundle), "--weights", str(model_dir), "--plan", str(plan), "--steps", str(steps), "--lr",
            "0.01", "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--runlog", str(log), "--threads", "1",
            *map(str, extra)]


def _descendants(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            found += _descendants(child) + [child]
    return found


ADAPTERS = LoRA(rank=4, alpha=8, targets=["attention", "experts"])


# the gate: the full fine-tune on several processes (issue 33's bug) and LoRA in one; the other two pairs are the
# discovery lane's (pytest --discovery)
@pytest.mark.parametrize("layout, lora", [
    pytest.param({}, None, marks=pytest.mark.discovery),
    pytest.param({"dp_shard": 2, "ep": 2}, None, marks=pytest.mark.multiprocess),
    ({}, ADAPTERS),
    pytest.param({"dp_shard": 2, "ep": 2}, ADAPTERS, marks=[pytest.mark.multiprocess, pytest.mark.discovery]),
], ids=["full, one process", "full, fsdp2+ep", "lora, one process", "lora, fsdp2+ep"])
def test_a_fine_tune_on_released_weights_survives_sigkill_and_exports_what_it_trained(forked_torchrun, layout, lora, qwen3_moe,
                                                                                     tmp_path):
    """Issue 33's bug: no LoRA, released weights, a model whose MoE router the runtime holds under a second name.
    Allocating the released model gave the two names two tensors (the router trained one, the export read the
    other) and the optimizer state was named by whichever name a set gave first, which a resumed process did
    not find. Now: every process of the run killed with SIGKILL after a checkpoint, the same command resumes
    with the uninterrupted run's losses, and `onboard export` of its checkpoint is what the uninterrupted run
    exported, which plain transformers loads. The same holds for LoRA runs (exported merged)."""
    from safetensors.torch import load_file

    from runtime.train.checkpoint import checkpoints

    model_dir, bundle = qwen3_moe
    steps = 12
    plan = tmp_path / "plan.json"
    plan.write_text(Plan(dtype="fp32", seq_len=SEQ, lora=lora, **layout).to_json())
    # the uninterrupted run and the resumed one in this process (torchrun's ranks in processes of their own); the
    # run that is killed in a process of its own
    one_thread = {"OMP_NUM_THREADS": "1"}
    straight = run_cli(*_train_args(bundle, model_dir, plan, tmp_path / "ck0", tmp_path / "straight.jsonl", steps,
                                    "--export-hf", tmp_path / "hf0"), env=one_thread)
    assert straight.returncode == 0, straight.stderr[-4000:]

    ck, log = tmp_path / "ck", tmp_path / "killed.jsonl"
    args = _train_args(bundle, model_dir, plan, ck, log, steps)
    victim = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), *args], env={**os.environ, **one_thread},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while not checkpoints(ck) and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    for pid in _descendants(victim.pid) + [victim.pid]:  # the launcher and every rank: a lost node
        os.kill(pid, signal.SIGKILL)  # (torchrun starts each rank in a session of its own: killpg misses them)
    victim.wait(timeout=60)
    assert victim.returncode == -signal.SIGKILL and len(_run_losses(log)) < steps, "the run finished before the kill"
    resumed = run_cli(*args, env=one_thread)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    whole = _run_losses(tmp_path / "straight.jsonl")
    runs = read_runs([log])[0]
    after = {s["step"]: s["loss"] for s in runs[-1].steps}
    start = runs[-1].header["meta"].get("resumed_from")
    assert start >= 2 and sorted(after) == list(range(start, steps))
    assert all(abs(after[i] - whole[i]) <= 1e-6 * abs(whole[i]) for i in after), (after, whole)

    assert main(["export", str(ck), "--format", "hf", "--out", str(tmp_path / "hf"), "--bundle", str(bundle)]) == 0
    exported = {k: v for p in (tmp_path / "hf").glob("*.safetensors") for k, v in load_file(p).items()}
    expected = {k: v for p in (tmp_path / "hf0").glob("*.safetensors") for k, v in load_file(p).items()}
    released = {k: v for p in model_dir.glob("*.safetensors") for k, v in load_file(p).items()}
    assert exported.keys() == expected.keys()  # (the released files may hold experts one tensor each)
    assert all(torch.allclose(exported[k], expected[k], rtol=1e-5, atol=1e-6) for k in exported)
    trained = "model.layers.0.mlp.gate.weight" if lora is None else "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(exported[trained], released[trained])  # it trained (a full run: the router too)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert torch.equal(dict(reloaded.named_parameters())[trained], exported[trained])
    if layout or lora:
        return
    # the newest checkpoint truncated: export refuses, rather than train from an older state (or the released one)
    newest = checkpoints(ck)[-1][1]
    data = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    assert main(["export", str(ck), "--format", "hf", "--out", str(tmp_path / "hf2"), "--bundle", str(bundle)]) == 1
    assert not (tmp_path / "hf2").exists()
