"""What training changes in a model (LoRA, recompute, pipeline stages) is a swap like an adapter's: listed by
`runtime.swap.applied`, counted, and undone exactly: the same modules, classes, forwards, parameters and outputs."""

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from onboard.train.launch import build_model
from runtime.lora import apply_lora
from runtime.memory import apply_recompute
from runtime.parallel.pipeline import check_stages, cut, stage_of
from runtime.plan import LoRA
from runtime.swap import LORA, PIPELINE, RECOMPUTE, applied

ROOT = Path(__file__).resolve().parents[2]


def _mixtral() -> nn.Module:
    """The Mixtral twin (two layers of runtime MoE blocks on grouped expert stacks) as its bundle adapts it. Built
    afresh rather than deep-copied: a copy keeps the original's (empty) lists of swaps (`runtime.swap.applied`)."""
    torch.manual_seed(0)
    return build_model(ROOT / "bundles" / "mixtral-8x7b", layers=2)[0]


def _ids(model: nn.Module) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))


def _loss_and_grads(model: nn.Module) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    ids = _ids(model)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _shape(model: nn.Module) -> dict:
    """What a swap could change and undo must give back: each module object and its class, the forwards of its
    own, each parameter object and whether it trains."""
    return {"modules": [(name, id(m), type(m)) for name, m in model.named_modules()],
            "forwards": {name: vars(m).get("forward") for name, m in model.named_modules()},
            "parameters": [(name, id(p), p.requires_grad) for name, p in model.named_parameters()],
            "attributes": {name: sorted(vars(m)) for name, m in model.named_modules()}}


def test_lora_is_one_swap_and_undo_gives_back_the_base_model():
    model = _mixtral()
    adapter_swaps = applied(model)
    shape, (loss, grads) = _shape(model), _loss_and_grads(model)
    swap = apply_lora(model, LoRA(rank=2, alpha=4.0))
    assert applied(model) == [*adapter_swaps, swap] and swap.kind == LORA
    assert set(swap.parts.values()) == {"linear", "experts"}
    with torch.no_grad():  # adapters that change the outputs, so that giving them back shows
        for name, p in model.named_parameters():
            if name.endswith("_b"):
                p.normal_(generator=torch.Generator().manual_seed(2))
    adapted, _ = _loss_and_grads(model)
    assert not torch.equal(adapted, loss)
    experts = sum(1 for v in swap.parts.values() if v == "experts")
    assert swap.calls["experts"] == experts and swap.calls["linear"] == len(swap.parts) - experts
    swap.undo()
    assert applied(model) == adapter_swaps and _shape(model) == shape
    again, again_grads = _loss_and_grads(model)
    assert torch.equal(again, loss) and again_grads.keys() == grads.keys()
    assert all(torch.equal(again_grads[n], grads[n]) for n in grads)


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_recompute_is_one_swap_and_undo_gives_back_each_forward(policy):
    model = _mixtral()
    shape, (loss, grads) = _shape(model), _loss_and_grads(model)
    swap = apply_recompute(model, policy)
    assert applied(model)[-1] is swap and swap.kind == RECOMPUTE and len(swap.parts) == 2
    wrapped, wrapped_grads = _loss_and_grads(model)
    assert swap.calls[RECOMPUTE] == 2  # each wrapped module once a forward (backward runs it again, uncounted)
    assert torch.equal(wrapped, loss) and all(torch.equal(wrapped_grads[n], grads[n]) for n in grads)
    assert not apply_recompute(model, policy).parts  # a wrapped module is not wrapped twice
    swap.undo()
    assert swap not in applied(model) and _shape(model) == shape
    assert torch.equal(_loss_and_grads(model)[0], loss)


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("index", [0, 1])
def test_a_pipeline_cut_is_one_swap_and_undo_gives_back_the_whole_model(index):
    model = _llama()
    shape = _shape(model)
    ids = _ids(model)
    loss = model(input_ids=ids, labels=ids).loss
    stages = [range(0, 1), range(1, 2)]
    parts = check_stages(model, stages)  # runs each stage with the others' forwards skipped, then undoes that
    assert applied(model) == [] and _shape(model) == shape
    stage = cut(model, stages, index, parts)
    assert applied(model) == [stage.swap] and stage.swap.kind == PIPELINE and stage_of(model) is stage
    kept = {name for name, _ in model.named_parameters()}
    assert kept < {name for name, _, _ in shape["parameters"]}  # the other stage's are gone
    stage.swap.undo()
    assert applied(model) == [] and stage_of(model) is None and _shape(model) == shape
    assert torch.equal(model(input_ids=ids, labels=ids).loss, loss)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_pipeline_schedule_entry_is_a_swap_that_counts_micro_batches(tmp_path):
    """Two gloo processes, one stage each: the forward `Pipeline` gives the model is listed and counts each
    micro-batch, and the last stage computes each micro-batch's loss with the runtime's loss; undone with the cut, each rank's model computes the whole model's loss again, and the forward of
    its own the model had before (the runtime's loss) is back."""
    from tests.runtime.test_parallel import launch

    launch(2, {"out": str(tmp_path / "rank{rank}.pt")}, tmp_path, ROOT / "tests" / "parallel" / "pipeline_swap.py",
           timeout=300)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["listed"] == [("loss", ""), (PIPELINE, f"stage {rank}"), (PIPELINE, "forward")]
        assert got["micro_batches"] == 2 * 2  # two steps of two micro-batches
        # the last stage's loss is the runtime's (swapped) loss, not the class's full-logits one underneath it
        assert got["runtime_losses"] == (2 * 2 if rank == 1 else 0)
        assert got["listed_after"] == [("loss", "")] and got["own_forward_back"]
        assert got["loss_after"] == got["loss_before"]
