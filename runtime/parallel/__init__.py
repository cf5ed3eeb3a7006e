"""Parallel layout: device mesh, FSDP2, expert, tensor and pipeline parallelism.

Usage (every rank, after `torch.distributed.init_process_group`; a single process needs no group):

    mesh = build_mesh(plan)                  # ParallelMesh: (pp, dp_replicate, dp_shard, tp) mesh, expert mesh, EP group
    model = parallelize(model, plan, mesh)   # LoRA -> tp -> pipeline stage -> EP -> FSDP2, in place; returns model

`parallelize` steps, in this order (each one relies on the previous):
1. LoRA when `plan.lora`: adapters on attention projections (nn.Linear) and grouped adapters on expert
   stacks; everything else frozen (`runtime.lora`).
1a. Tensor parallelism when `plan.tp > 1` (`runtime.parallel.tensor`): which projections split is read from one
   forward pass of the whole model; pipeline parallelism when `plan.pp > 1` (`runtime.parallel.pipeline`): the
   stages are checked against the whole model's loss, then this rank keeps its stage; then the tp split is
   applied to what the stage kept. The training step of a pipeline is `Pipeline.step` (a torch schedule).
2. Expert parallelism when `plan.ep > 1`: every `runtime.moe.MoEBlock` keeps E/ep experts (its rank's
   slice of each stack, LoRA stacks included, as plain local Parameters) and gets an `ExpertParallel`
   hook that exchanges tokens with `all_to_all_single` (variable splits, async, local experts computed
   while remote tokens are in flight when `plan.overlap`).
3. FSDP2 over the data-parallel ranks: experts `fully_shard`ed first over the ranks holding the same
   experts (gradients divided by the whole data-parallel size, so they match single-process training on
   the concatenated batch), then each decoder layer, then the root, on the (dp_replicate, dp_shard) mesh
   (tp-split parameters become 2-D DTensors).

Parameters keep their dtype (no FSDP2 mixed-precision policy): bf16 compute is the caller's autocast.
Each rank feeds its own micro-batch; the gradients equal those of one process on all ranks' batches with
the mean of the per-rank losses. Expert parameters under EP hold only the local experts: `gather_experts`
(or `runtime.lora.lora_state_dict`) returns full tensors to save, `load_full_state` (or
`runtime.lora.load_lora_state_dict`) puts them back. `grad_norm` / `clip_grad_norm_` work across the dense
and expert meshes; each block's `expert_parallel.comm` times what the exchanges did not hide.
"""

import importlib

# Where each public name lives. They are imported on first use, not with the package: the planner needs only
# `not_runnable` (runtime.parallel.mesh), and the rest pulls in the MoE runtime and transformers, which would
# cost `onboard plan` seconds before it could even report a mistyped model name.
_HOMES = {"moe_blocks": "runtime.model_tree", "parallelize": "runtime.parallel.api",
          "ExpertParallel": "runtime.parallel.expert", "shard_experts": "runtime.parallel.expert",
          "clip_grad_norm_": "runtime.parallel.grads", "grad_norm": "runtime.parallel.grads",
          "ParallelMesh": "runtime.parallel.mesh", "build_mesh": "runtime.parallel.mesh",
          "not_runnable": "runtime.parallel.mesh", "gather_experts": "runtime.parallel.state",
          "load_full_state": "runtime.parallel.state"}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value
