"""Which plans `runtime.parallel` can lay out, and why not (`not_runnable`): the one answer the planner, the training
loop and `build_mesh` all use. Plain Python over a `runtime.plan.Plan` (no torch), so that a planner pricing
thousands of layouts imports nothing it does not need."""

from __future__ import annotations

from runtime.plan import Plan


def ep_split(plan: Plan) -> tuple[int, int]:
    """(er, es): how the EP group splits over the replicate and the shard dimensions. Context parallelism's ranks
    count as shard ranks (FSDP2 shards over dp_shard x cp, and the EP group may take cp ranks: their tokens are
    tokens like any other), so the shard dimension is dp_shard * cp; in a folded plan (MoE parallel folding,
    etp 1) the tp ranks too, each of which routes its own part of the sequence: dp_shard * cp * tp."""
    fold = plan.tp if plan.folded else 1
    ep, shard, dp = plan.ep, plan.dp_shard * plan.cp * fold, plan.dp * plan.cp * fold
    named = "dp_shard*cp*tp" if plan.folded else "dp_shard*cp"
    if shard % ep == 0:
        return 1, ep
    if ep % shard == 0 and dp % ep == 0:
        return ep // shard, shard
    raise ValueError(f"ep={ep} must divide {named}={shard}, or be a multiple of it dividing "
                     f"dp_replicate*{named}={dp}")


NOT_BUILT: dict[str, str] = {}  # degrees runtime.parallel does not lay out yet

# attention kinds context parallelism computes across its ranks (runtime.parallel.context_split): softmax attention
# (causal, sliding windows, chunks, sinks, packed documents; MLA is softmax attention), the gated delta rule (Gated
# DeltaNet, KDA) with its short convolutions, lightning attention and DSA. Mamba2's SSD runs too, but a spec's
# "ssm:mamba" does not say Mamba2 from Mamba1, whose selective scan does not (it refuses on a rank's segments)
CP_ATTENTION = ("softmax", "sliding", "chunked", "mla", "linear:gated_deltanet", "linear:kda", "linear:lightning",
                "sparse:dsa")


# attention kinds tensor parallelism splits by head (runtime.parallel.tensor): MLA (and DSA's MLA) with its low-rank
# latents and DSA's indexer whole on every tp rank; KDA and Gated DeltaNet with their fused short convolutions and
# per-head decay read at each rank's heads (KDA's gate latents whole)
TP_ATTENTION = ("softmax", "sliding", "chunked", "mla", "sparse:dsa", "linear:kda", "linear:gated_deltanet")


def not_runnable(plan: Plan, model=None) -> list[str]:
    """Why runtime.parallel cannot lay out `plan` (empty when it can): the one answer the planner, the training
    loop and `build_mesh` all use. `model` (a `runtime.dims.Dims`, optional) adds what depends on the model:
    tensor parallelism needs attention it splits and head counts tp divides."""
    out = list(plan.problems())
    if plan.tp > 1 and model is not None:
        whole = sorted({m.kind for m in model.mixers if m.kind not in TP_ATTENTION})
        if whole:
            out.append(f"tensor parallelism over {', '.join(whole)} attention is not built (it splits "
                       f"{', '.join(TP_ATTENTION)} attention by head)")
        if model.heads % plan.tp or model.kv_heads % plan.tp:
            out.append(f"tp={plan.tp} does not divide {model.heads} query and {model.kv_heads} key/value heads")
    if plan.tp > 1 and plan.seq_len % plan.tp:
        out.append(f"sequence parallelism splits each sequence over the tp ranks: tp={plan.tp} must divide "
                   f"seq_len={plan.seq_len}")
    if plan.cp > 1:
        if model is not None:
            other = sorted({m.kind for m in model.mixers if m.kind not in CP_ATTENTION})
            if other:
                out.append(f"context parallelism over {', '.join(other)} attention is not built (it runs "
                           f"{', '.join(CP_ATTENTION)})")
        if plan.seq_len % (2 * plan.cp):
            out.append(f"context parallelism cuts each sequence into 2*cp={2 * plan.cp} segments: it must divide "
                       f"seq_len={plan.seq_len}")
        if plan.pp > 1 and plan.recompute != "none":
            out.append("context parallelism with pipeline parallelism and recompute is not built (a recomputed "
                       "layer would run outside its micro-batch's split)")
    if plan.pp > 1 and plan.pp_schedule == "1f1b" and plan.grad_accum < plan.pp:
        out.append(f"the 1F1B schedule needs at least pp={plan.pp} micro-batches per step, the plan has "
                   f"grad_accum={plan.grad_accum} (more accumulation, or pp_schedule gpipe)")
    out += [f"{kind} parallelism ({name} > 1) is not built in runtime.parallel yet"
            for name, kind in NOT_BUILT.items() if getattr(plan, name) != 1]
    if plan.folded and plan.etp != 1:
        out.append(f"expert tensor parallelism (MoE parallel folding with etp={plan.etp} > 1: each expert's weights "
                   f"split) is not built in runtime.parallel yet")
    if plan.folded and plan.pp > 1:
        out.append("MoE parallel folding with pipeline parallelism is not built in runtime.parallel yet")
    if plan.ep > 1 and not out:
        try:
            ep_split(plan)
        except ValueError as exc:
            out.append(str(exc))
    return out
