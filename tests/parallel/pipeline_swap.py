"""One rank of the pipeline-swap check (tests/runtime/test_runtime_swaps.py): a two-layer Llama with the runtime's
loss, cut into this rank's stage and given the schedule's entry, trains two steps; then both swaps are undone and
the whole model runs again. Writes what `runtime.swap.applied` listed before and after, the micro-batches the
entry counted, how many losses the runtime's loss computed while it trained, whether the model's own forward (the loss swap's) is back, and the loss before and after.

Usage: python pipeline_swap.py <job.json>, with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set (world 2).
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

torch.set_num_threads(1)


def main() -> None:
    from runtime.loss.causal_lm import swap_causal_lm_loss
    from runtime.parallel import build_mesh
    from runtime.parallel.pipeline import Pipeline, check_stages, cut, stage_layers
    from runtime.plan import Plan
    from runtime.swap import applied

    job = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.manual_seed(0)  # the same weights on both ranks
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    loss_swap = swap_causal_lm_loss(model)
    own_forward = vars(model)["forward"]
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(input_ids=ids, labels=ids, use_cache=False).loss
    plan = Plan(pp=2, grad_accum=2, seq_len=8, dtype="fp32")
    mesh = build_mesh(plan)
    stages = stage_layers(plan, 2)
    stage = cut(model, stages, mesh.pp_rank, check_stages(model, stages))
    pipe = Pipeline(model, plan, mesh, torch.device("cpu"))
    listed = [(s.kind, s.path) for s in applied(model)]
    micro = [{"input_ids": m, "labels": m} for m in ids.split(1)]
    runtime_losses = loss_swap.calls["loss"]
    for _ in range(2):
        pipe.step(micro)
    runtime_losses = loss_swap.calls["loss"] - runtime_losses
    counted = pipe.swap.calls["micro_batch"]
    pipe.swap.undo()
    stage.swap.undo()
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        after = model(input_ids=ids, labels=ids, use_cache=False).loss
    torch.save({"listed": listed, "micro_batches": counted, "runtime_losses": runtime_losses,
                "listed_after": [(s.kind, s.path) for s in applied(model)],
                "own_forward_back": vars(model).get("forward") is own_forward, "loss_before": before.item(),
                "loss_after": after.item()}, job["out"].format(rank=dist.get_rank()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
