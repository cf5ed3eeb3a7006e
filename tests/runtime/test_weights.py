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
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from cli import main
from onboard.train import build_model
from runtime.plan import LoRA, Plan
from runtime.train import TrainConfig, train
from runtime.train import data as token_data
from runtime.train.weights import Checkpoint, HFLayout, Pretrained, load_weights
from tests.helpers import released_model

FAMILIES = ("mixtral", "qwen3_next", "deepseek_v3")
SEQ = 16


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    out = {}
    for family in FAMILIES:
        folder = tmp_path_factory.mktemp(family)
        out[family] = released_model(family, folder)
    return out


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
                   TrainConfig(steps=1, progress=False))
    assert result.steps[0].loss == pytest.approx(_hf_loss(model_dir, 1), rel=1e-6)


def test_released_experts_are_merged_into_the_runtime_stacks(released):
    """Mixtral's checkpoint holds each expert's w1 / w2 / w3; the adapted model holds the runtime's stacks (the
    same tensors as transformers' `gate_up_proj` / `down_proj`): every expert's rows land where transformers
    puts them."""
    model_dir, bundle = released["mixtral"]
    checkpoint = Checkpoint(model_dir)
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
        Checkpoint(gone)

    corrupt = _copy_model(model_dir, tmp_path / "corrupt")
    (corrupt / first_file).write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        Checkpoint(corrupt)

    other_dir, _ = released["deepseek_v3"]
    model = AutoModelForCausalLM.from_config(AutoModelForCausalLM.from_pretrained(model_dir).config)
    with pytest.raises(ValueError, match=r"does not fit the model: \d+ model tensor\(s\) missing .*; \d+ checkpoint"):
        Pretrained.prepare(model, other_dir, adapt=lambda m: None)

    emptied = _copy_model(model_dir, tmp_path / "emptied")
    (emptied / "model.safetensors.index.json").unlink()
    for f in emptied.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors weights"):
        Checkpoint(emptied)


def test_a_tensor_of_the_wrong_shape_is_named(released, tmp_path):
    model_dir, _ = released["mixtral"]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.config.vocab_size += 1
    bigger = AutoModelForCausalLM.from_config(model.config)
    layout = HFLayout.of(bigger)
    with pytest.raises(ValueError, match=r"2 shape\(s\) differ \(first: lm_head.weight \(\d+, \d+\) in the "
                                         r"checkpoint, \(\d+, \d+\) in the model; model.embed_tokens.weight"):
        load_weights(bigger, Checkpoint(model_dir), layout, layout.names(bigger))


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
def test_four_processes_with_fsdp_expert_parallelism_and_lora_start_from_the_released_loss(released, tmp_path):
    model_dir, bundle = released["mixtral"]
    plan = tmp_path / "plan.json"
    plan.write_text(Plan(dp_shard=4, ep=2, lora=LoRA(rank=4, alpha=8, targets=["attention", "experts"]),
                         dtype="fp32", seq_len=SEQ).to_json())
    log = tmp_path / "run.jsonl"
    assert main(["train", str(bundle), "--weights", str(model_dir), "--plan", str(plan), "--steps", "2",
                 "--runlog", str(log), "--checkpoint-dir", str(tmp_path / "ck")]) == 0
    steps = [json.loads(line) for line in log.read_text().splitlines() if json.loads(line).get("kind") == "step"]
    assert steps[0]["loss"] == pytest.approx(_hf_loss(model_dir, 4), rel=1e-6)
    assert steps[1]["loss"] != steps[0]["loss"]  # the adapters trained
