"""`parallelize`: LoRA, tensor parallelism, expert parallelism and FSDP2 applied to a (runtime-adapted)
HuggingFace model."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from runtime.model_tree import decoder_layers, moe_blocks
from runtime.moe.block import GroupedExperts, ModuleExperts
from runtime.parallel.expert import ExpertParallel, shard_experts
from runtime.parallel.mesh import ParallelMesh
from runtime.plan import Plan


def _experts_outside_blocks(model: nn.Module) -> list[str]:
    """Runtime expert stacks that no MoEBlock owns (experts-only swaps inside a HuggingFace block)."""
    owned = {id(b.experts) for _, b in moe_blocks(model)}
    return [name for name, m in model.named_modules() if isinstance(m, (GroupedExperts, ModuleExperts))
            and id(m) not in owned]


def _folded_moe_blocks(model: nn.Module, mesh: ParallelMesh) -> tuple[nn.Module, ...]:
    """MoE parallel folding (etp 1) under tensor parallelism: each MoE block runs on its tp rank's part of the
    sequence (what sequence parallelism holds between blocks), its experts exchanged over an EP group that spans
    the tp ranks; its router and shared experts stay whole, their gradients (each rank its tokens') summed over
    the tp ranks. HuggingFace's load-balancing loss would see one rank's tokens: refused."""
    from runtime.parallel.tensor import sum_gradients_over_ranks

    if getattr(model.config, "output_router_logits", False):
        raise ValueError("MoE parallel folding with HuggingFace's router load-balancing loss (output_router_logits) "
                         "is not built: each tp rank's router sees its own tokens")
    blocks = tuple(block for _, block in moe_blocks(model))
    for block in blocks:
        subs = [m for name, m in block.named_modules() if not (name == "experts" or name.startswith("experts."))]
        sum_gradients_over_ranks(block, subs, mesh.tp.get_group())
    return blocks


def mixed_precision(plan: Plan, device_type: str) -> MixedPrecisionPolicy | None:
    """FSDP2's policy for the plan's dtype: with "bf16" on an accelerator, parameters gathered and computed in
    bf16 while the sharded master weights, their gradients' reduction and the optimizer stay fp32; None (all
    fp32) otherwise: on CPU bf16 matmuls run ~100x slower than fp32, so CPU runs (and tests) train in fp32."""
    if plan.dtype != "bf16" or device_type == "cpu":
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def parallelize(model: nn.Module, plan: Plan, mesh: ParallelMesh, *, trace: list | None = None,
                precision: MixedPrecisionPolicy | None = None, expert_spare: int = 0) -> nn.Module:
    """Apply LoRA (plan.lora), tensor parallelism (plan.tp), pipeline stages (plan.pp: this rank keeps its own),
    expert parallelism (plan.ep) and FSDP2 to `model` in place; returns it. What needs the whole model (LoRA's
    initialisation, the tensor-parallel probe, the pipeline check) happens before the cut.

    `trace`, when given, collects the expert-parallel issue / wait events of every MoE block. `precision`: FSDP2's
    mixed-precision policy (`mixed_precision`), None for fp32 throughout. `expert_spare`: replica rows per rank in
    every MoE layer's expert stacks (what `runtime.parallel.rebalance` copies hot experts into)."""
    shard = {"mp_policy": precision} if precision is not None else {}
    if plan.lora is not None:  # on the whole model, so every stage's adapters start as one process's would
        from runtime.lora import apply_lora, has_lora

        if not has_lora(model):  # adapters already in place (loaded, or initialised by the caller) are kept
            apply_lora(model, plan.lora)
    splits = None
    if plan.tp > 1:  # how each declared module splits, read from one forward pass of the whole model
        from runtime.parallel.tensor import find_splits, problems

        splits = find_splits(model, tp=plan.tp, shared_experts=not plan.folded)
        if why := problems(splits, plan.tp):
            raise ValueError("; ".join(why))
    if plan.ep > 1 and not moe_blocks(model):
        raise ValueError("ep > 1 but the model has no runtime MoE blocks (adapt it first)")
    if plan.pp > 1:  # checked whole (one process, one forward), then cut to this rank's stage
        from runtime.parallel.pipeline import check_stages, cut, stage_layers

        stages = stage_layers(plan, len(decoder_layers(model)))
        cut(model, stages, mesh.pp_rank, check_stages(model, stages))
        if splits is not None:  # the splits of modules other stages run are theirs
            kept = {name for name, _ in model.named_modules()}
            splits = [s for s in splits if s.path in kept]
    if splits is not None:  # with sequence parallelism between each layer's blocks
        from runtime.parallel.sequence import apply_sequence_parallel
        from runtime.parallel.tensor import apply_tensor_parallel, declared

        here = dict(model.named_modules())
        blocks = {path: here[path] for path in declared(model)["blocks"] if path in here}
        local = ()
        if plan.folded:  # each tp rank's MoE blocks route its own tokens
            local = _folded_moe_blocks(model, mesh)
            routed = {id(m) for m in local}
            blocks = {path: b for path, b in blocks.items() if id(b) not in routed}
        apply_tensor_parallel(model, mesh.tp, splits, sequence=set(blocks))
        apply_sequence_parallel(decoder_layers(model), blocks, {s.path for s in splits} & set(blocks), mesh.tp,
                                {s.path for s in splits if s.partial}, local)
    if plan.cp > 1:  # softmax attention through the context-parallel attention function
        from runtime.parallel.context_split import prepare

        prepare(model, plan.seq_len)
    blocks = moe_blocks(model)  # this rank's (a pipeline stage may hold none)
    if plan.ep > 1:
        unsplit = _experts_outside_blocks(model)
        if unsplit:
            raise ValueError(f"ep > 1: expert parallelism covers runtime MoEBlocks only; {len(unsplit)} "
                             f"experts-only swap(s) (e.g. {unsplit[0]}) would keep every expert on every rank")
        for _, block in blocks:
            experts = block.num_experts
            shard_experts(block.experts, experts, mesh.ep_rank, plan.ep, expert_spare)
            block.expert_parallel = ExpertParallel(experts, mesh.ep_group, overlap=plan.overlap, trace=trace,
                                                   spare=expert_spare)
    if mesh.dense is None:
        return model
    if plan.ep > 1:
        for _, block in blocks:
            fully_shard(block.experts, mesh=mesh.experts, **shard)
            # each rank's expert gradients already sum the tokens of its whole EP group: divide by every
            # data-parallel rank, not only by those FSDP reduces over
            block.experts.set_gradient_divide_factor(float(plan.dp * plan.cp))
            if dist.get_backend() == "gloo" and mesh.experts.size(1) > 1:
                # a custom factor makes FSDP2 reduce-scatter with PREMUL_SUM, which gloo lacks: plain SUM
                # plus a separate division gives the same gradients. Not with one rank per shard group:
                # there FSDP2 (2.13) skips the reduce-scatter and divides by the factor itself, and a forced
                # sum would divide a second time.
                block.experts.set_force_sum_reduction_for_comms(True)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh.data_parallel, **shard)
    fully_shard(model, mesh=mesh.data_parallel, **shard)
    return model
