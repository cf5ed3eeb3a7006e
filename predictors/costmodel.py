"""Analytical cost of one training step: compute, memory per device, communication and overlap.

Inputs are a model's key dimensions (`runtime.dims.Dims`), a `runtime.plan.Plan` and a `Hardware`. The
figures are first-order (bytes over bandwidth, FLOPs over a fixed fraction of peak); the learned predictor
corrects them from measured runs, and its features are the parts computed here.

Device mesh order follows torchtitan: pp (outermost), dp_replicate, dp_shard, cp, tp (innermost), so a
group's members lie `stride` devices apart and it stays on scale-up links when size * stride fits in the
scale-up domain (`Hardware.domain`: 8 on an HGX board, 72 on an NVL72 rack), else on the scale-out network.
The EP group is carved out of dp_shard * cp; a folded plan (`Plan.etp`, Megatron-Core's MoE parallel folding)
builds the expert mesh etp x ep x edp from the tp x dp x cp ranks instead (`_folded`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from predictors import moe_cost, pipeline
from predictors.hardware import Hardware
from runtime.dims import Dims
from runtime.plan import Plan

# Hardware.matmul_efficiency (predictors.hardware): the fraction of peak a large matmul-bound step reaches
# Share of FSDP / data-parallel traffic that hides behind compute when prefetching works.
DP_OVERLAP = 0.8
OFFLOAD_OVERLAP = 0.7
# CUDA/NPU context, collective buffers and allocator fragmentation, per device.
RESERVED_BYTES = 3e9
# Memory kept free so the allocator does not thrash; a plan must fit in this share of capacity.
USABLE_FRACTION = 0.92
BF16 = 2
FP32 = 4
# fp32 master weights, fp32 gradients and two fp32 Adam moments per trained parameter.
TRAINED_BYTES = 16
# elementwise passes (norms, activations, residual adds, softmax) over the saved activations
ELEMENTWISE_PASSES = 4
FP8_CAST_BYTES = 5  # per element an FP8 GEMM's operand is cast: `fp8_cast_bytes_per_token`
LOSS_BYTES_PER_LOGIT = 38  # HBM bytes the loss moves per logit, forward and backward: `loss_bytes_per_token`
# Eager dispatch: aten operators one decoder layer issues per micro-step, (forward, backward), counted with
# `runtime.op_count.OpCounter` on the runtime-adapted layers (`python bench/dispatch.py`: Llama-3.1-8B's dense
# layer, Mixtral-8x7B's MoE layer). Each costs the host `Hardware.op_dispatch_us` (an MoE layer's,
# `moe_op_dispatch_us` where the spec measured it apart) whatever the tensors' size, which
# is the whole step for small layers: the single-node vTrain GPTs (hidden 1024-2048, one sequence per micro-batch)
# run 2-17x slower than their FLOPs and bytes say.
OPS_PER_LAYER = {"dense": (73, 138), "moe": (99, 169)}
# How host dispatch and device work combine on an accelerator (`dispatch_s`): the exponent of their p-norm. Derived
# from the one source whose sweep crosses from host-bound to device-bound in every configuration, vTrain's single-node
# A100 runs (predictors/sources/published_runs_vtrain_single_node.jsonl: micro-batch 1 to 8 at each model and layout).
# With max(host, device) the runs priced near the crossover (host 0.75-1.4x device, 343 of 1,440) ran 1.28-1.72x
# (median log +0.24 to +0.54) slower than priced, and those far from it within 10 %; the exponent at which that
# source's median log(measured / priced) is 0 lies between 2.4 and 2.5. Checked on the sources it was not derived
# from, cost model alone, median error: dgxc-benchmarking 11.2 -> 10.8 % (its MoE runs 9.4 -> 7.7 %), megatron-2021
# 8.3 -> 5.8 %, vtrain-multi-node 9.5 -> 9.3 %, Megatron-Bridge (all MoE) 21.3 -> 20.8 %; worse on NeMo's 13 runs,
# 12.7 -> 13.8 %, and on the accelerators' 196 MoE runs pooled, 15.7 -> 16.2 %, though each of their sources improves.
DISPATCH_NORM = 2.5


def _ring(size: int) -> float:
    return (size - 1) / size if size > 1 else 0.0


@dataclass
class Estimate:
    compute_s: float
    recompute_s: float
    bubble_s: float
    memory_s: float  # elementwise, loss and optimizer traffic through HBM
    overhead_s: float  # host dispatch time the device's work does not hide (`dispatch_s`)
    tp_s: float
    cp_s: float
    pp_s: float
    dp_s: float
    ep_s: float
    offload_s: float
    exposed_comm_s: float
    step_time_s: float
    tokens_per_step: int
    memory: dict = field(default_factory=dict)  # bytes per device by part, "total" included
    imbalance_s: float = 0.0  # routed-expert compute the busiest EP rank adds over a balanced one
    imbalance: float = 1.0  # the busiest EP rank's tokens over the mean that was priced
    expert_gemm_s: float = 0.0  # what the experts' small grouped GEMMs take beyond the large-GEMM rate
    permute_s: float = 0.0  # routing, permutation and un-permutation: memory-bound passes over HBM
    expert_efficiency: float = 1.0  # share of the dense rate the experts' GEMMs reach (`moe_cost.expert_efficiency`)
    loss_s: float = 0.0  # the loss's passes over the logits (`loss_bytes_per_token`), inside memory_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s

    @property
    def memory_per_device_bytes(self) -> float:
        return self.memory["total"]

    def summary(self) -> dict:
        return {"step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
                "memory_per_device_bytes": int(self.memory_per_device_bytes)}


@dataclass(frozen=True)
class _Folded:
    """Where a folded plan's experts live: Megatron-Core lays the expert mesh out as etp (innermost), ep, edp
    over the same ranks the dense layers see as tp (innermost), cp, dp."""
    edp: int  # ranks holding the same experts (tp * dp * cp / (etp * ep))
    shard: int  # ways each expert weight is split: etp * ep, times edp where FSDP / ZeRO shards (dp_shard > 1)
    ep_span: int  # consecutive ranks an EP group spans: etp * ep


def _folded(plan: Plan) -> _Folded:
    edp = max(1, plan.tp * plan.dp * plan.cp // (plan.expert_tp * plan.ep))
    return _Folded(edp=edp, shard=plan.expert_tp * plan.ep * (edp if plan.dp_shard > 1 else 1),
                   ep_span=plan.expert_tp * plan.ep)


def lora_params(d: Dims, plan: Plan) -> tuple[int, int]:
    """Trainable adapter parameters (total, used per token): rank x (in + out) per targeted matrix."""
    if plan.lora is None:
        return 0, 0
    r = plan.lora.rank
    dense = experts = 0
    if "attention" in plan.lora.targets:
        q = d.heads * d.head_dim
        kv = d.kv_heads * d.head_dim
        dense += d.layers * r * ((d.hidden + q) * 2 + (d.hidden + kv) * 2)
    if "mlp" in plan.lora.targets:
        dense += d.dense_layers * 3 * r * (d.hidden + d.ffn)
    if "experts" in plan.lora.targets and d.experts:
        experts = d.moe_layers * d.experts * 3 * r * (d.hidden + d.expert_ffn)
    return dense + experts, int(dense + experts * d.top_k / d.experts if d.experts else dense)


def fp8_cast_bytes_per_token(d: Dims) -> float:
    """HBM bytes per token per layer (averaged over layers) that FP8 training spends casting GEMM operands.

    Transformer Engine and torchao quantize every FP8 GEMM's activation operand as it runs: the inputs of each
    linear layer in the forward and the output gradients feeding each data gradient in the backward. Each element
    is read in bf16 and written in fp8, and read once more for its scale (current scaling's amax pass) or written
    once more transposed for the weight gradient (block / MX scaling): FP8_CAST_BYTES = 2 + 1 + 2 per element. The
    elements per token are the linear layers' widths in and out: attention (q, k, v in from h; o in from
    heads x head_dim), the dense MLP (h in, ffn; 2 ffn and h out), and an MoE layer's top_k routed and shared
    experts (h and F in; 2F and h out). Weights are cast once a step, not per token (not counted)."""
    h, q, kv = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim
    attention = (h + q) + (q + 2 * kv + h)
    dense = (h + d.ffn) + (2 * d.ffn + h)
    routed = (d.top_k + d.shared_experts) * ((h + d.expert_ffn) + (2 * d.expert_ffn + h))
    moe_share = d.moe_layers / d.layers if d.layers else 0.0
    return FP8_CAST_BYTES * (attention + moe_share * routed + (1 - moe_share) * dense)


def loss_bytes_per_token(d: Dims, plan: Plan) -> float:
    """HBM bytes per token the language-model loss moves over its logits, forward and backward, on a rank of the
    last stage: V / tp logits (the head is vocabulary-parallel under tp) times LOSS_BYTES_PER_LOGIT.

    The head's GEMM is priced with the FLOPs; what follows it does almost no arithmetic per byte. Counted per logit
    for cross-entropy computed in fp32 over bf16 logits, as PyTorch's `cross_entropy(logits.float())` and
    Megatron-Core's vocab-parallel cross-entropy both do:

        forward   head writes the logits (bf16)                          2
                  upcast: read bf16, write fp32                          2 + 4
                  log-softmax: read for max and sum-exp, write           4 + 4
        backward  the loss's gradient written densely (fp32)             4
                  log-softmax backward: read gradient and output, write  4 + 4 + 4
                  downcast: read fp32, write bf16                        4 + 2
                                                                        = 38

    A chunked or fused loss (`Plan.loss_chunk`) moves the same bytes a chunk at a time; it saves memory, not
    traffic. The term matters where the vocabulary is large beside the model: a GPT of hidden 1024 and 50,257
    tokens moves 1.9 MB a token here, 0.94 us on an A100-80G, beside about 14 us for its 24 layers' training FLOPs
    under full recompute at the cost model's rate."""
    return d.vocab / plan.tp * LOSS_BYTES_PER_LOGIT


def activation_bytes_per_token(d: Dims, plan: Plan) -> dict:
    """Bytes saved for backward per token per layer (averaged over layers), by what the policy keeps."""
    h = d.hidden
    attn = BF16 * (h + h + 2 * d.kv_heads * d.head_dim + d.heads * d.head_dim) + FP32 * d.heads  # in, qkv, out, lse
    moe_share = d.moe_layers / d.layers
    # the input, the top_k permuted copies in and out of the experts, their gate / up / activation, the shared
    # experts', and routing's probabilities, indices and weights (`moe_cost.activation_bytes`)
    moe = (BF16 * (h + d.top_k * (2 * h + 3 * d.expert_ffn) + d.shared_experts * 3 * d.expert_ffn)
           + (moe_cost.activation_bytes(d)[0] if d.experts else 0.0))
    dense = BF16 * (h + 3 * d.ffn)
    mlp = moe_share * moe + (1 - moe_share) * dense
    residual = BF16 * 2 * h
    return {"attention": attn, "moe": moe_share * moe, "dense_mlp": (1 - moe_share) * dense,
            "residual": residual, "layer": attn + mlp + residual}


def _resident_activation(per: dict, plan: Plan) -> tuple[float, float]:
    """(bytes per token per layer kept on device, bytes per token per layer sent to host)."""
    kept = per["layer"]
    if plan.recompute == "selective":
        kept = per["residual"] + per["dense_mlp"]
    elif plan.recompute == "full":
        kept = per["residual"] / 2  # only the layer input
    host = 0.0
    if plan.offload == "moe" and plan.recompute != "full":
        moved = per["moe"] if plan.recompute == "none" else 0.0
        kept, host = kept - moved, moved
    elif plan.offload == "all" and plan.recompute != "full":
        host = kept - per["residual"] / 2
        kept = per["residual"] / 2
    return kept, host


def host_dispatch_s(d: Dims, plan: Plan, hw: Hardware, layers_stage: int) -> float:
    """Host time to issue one step's operators on the slowest stage: every layer, every micro-step, forward,
    backward, and the forward again under full recompute (selective recompute reruns a few attention operators;
    not counted)."""
    moe_share = d.moe_layers / d.layers if d.layers else 0.0
    us = {"moe": hw.op_dispatch_us if hw.moe_op_dispatch_us is None else hw.moe_op_dispatch_us,
          "dense": hw.op_dispatch_us}
    per_layer_us = 0.0
    for kind, share in (("moe", moe_share), ("dense", 1 - moe_share)):
        forward, backward = OPS_PER_LAYER[kind]
        per_layer_us += share * (forward * (2 if plan.recompute == "full" else 1) + backward) * us[kind]
    return layers_stage * plan.grad_accum * per_layer_us / 1e6


def dispatch_s(device_s: float, host_s: float, hw: Hardware) -> float:
    """What host dispatch adds to `device_s`, the device's compute and memory traffic. An accelerator runs its
    stream asynchronously: the host queues operators ahead while long kernels run, so the step takes about the
    slower of the two, but not quite: where host and device take about as long, each waits on the other in turn
    (a short operator the host has not issued yet, a long kernel the host's queue runs dry behind). The step takes
    the p-norm of the two,

        step = (host^p + device^p)^(1/p),   p = DISPATCH_NORM,

    max(host, device) when one is far the slower, 2^(1/p) = 1.32x it when they are equal. A CPU computes on the
    threads that dispatch, so there the two add (p = 1)."""
    if not hw.dispatch_overlaps:
        return host_s
    if device_s <= 0.0 or host_s <= 0.0:
        return host_s
    return (host_s ** DISPATCH_NORM + device_s ** DISPATCH_NORM) ** (1 / DISPATCH_NORM) - device_s


def estimate(d: Dims, plan: Plan, hw: Hardware, precision: str = "bf16", imbalance: float = 1.0,
             gradient_overlap: bool = True) -> Estimate:
    """The step of `plan` priced piece by piece. `imbalance`: the busiest expert-parallel rank's routed tokens over
    the mean (`predictors.imbalance`: measured, or assumed); every MoE layer waits for that rank, so its routed
    expert compute and its All-to-All volume are charged that many times the balanced share. 1 prices perfect
    balance; without expert parallelism (ep = 1) every rank computes its own tokens and none is charged.
    `gradient_overlap`: whether data-parallel traffic hides behind compute (DP_OVERLAP of it at most: FSDP prefetch,
    bucketed gradient all-reduce, what every framework the planner targets does); False for a run that all-reduces
    its gradients after the whole backward (a run log's `meta.gradient_overlap`, `predictors.published`).

    MoE layers are priced by `predictors.moe_cost`: their grouped GEMMs at the efficiency their shape reaches
    (`expert_gemm_s`), routing and permutation as HBM traffic (`permute_s`), the exchanges by where the EP group's
    peers are (`ep_s`), hidden as far as the plan overlaps them; pipeline stages are balanced and priced with those
    costs (`pipeline.share`'s `moe_extra`)."""
    skew, moe, shape = _priced_layout(d, plan, hw, precision, imbalance)
    compute_s, recompute_s, imbalance_s = _compute(d, plan, hw, precision, skew, shape)
    stage_moe_layers = d.moe_layers * shape.stage_share / plan.pp
    rank_tokens = plan.micro_batch * plan.seq_len / (plan.cp * plan.tp) * plan.grad_accum  # through its stage
    expert_gemm_s = moe.gemm_s_per_token * rank_tokens * stage_moe_layers
    busy = compute_s + recompute_s + imbalance_s + expert_gemm_s
    memory, local, per, host = _memory(d, plan, shape)
    tp_s, cp_s, pp_s, dp_s = _communication(d, plan, hw, shape)
    ep_s = moe.exchange_s_per_token * rank_tokens * stage_moe_layers
    permute_s = moe.permute_s_per_token * rank_tokens * stage_moe_layers
    tokens_mb = plan.micro_batch * plan.seq_len / (plan.cp * plan.tp)
    offload_s = 2 * tokens_mb * host * shape.layers_stage * plan.grad_accum / (hw.host_gbs * 1e9)

    # elementwise passes over what a rank's stage saves, its tokens through its layers
    traffic = rank_tokens * per["layer"] * shape.layers_stage * ELEMENTWISE_PASSES
    if precision == "fp8":
        traffic += rank_tokens * fp8_cast_bytes_per_token(d) * shape.layers_stage
    # the last stage's loss over the logits; a rank holds the whole sequence there (the head gathers it under tp)
    loss_s = rank_tokens * plan.tp * loss_bytes_per_token(d, plan) / (hw.memory_bw_gbs * 1e9)
    trained_local = shape.n_lora / (plan.tp * shape.fsdp * plan.pp) if shape.lora else local
    traffic += trained_local * TRAINED_BYTES * 2  # the optimizer reads and writes its state once a step
    memory_s = traffic / (hw.memory_bw_gbs * 1e9) + permute_s + loss_s
    overhead_s = dispatch_s(busy + memory_s, host_dispatch_s(d, plan, hw, shape.layers_stage), hw)

    # -- overlap ------------------------------------------------------------------------------
    # Communication hides behind the passes as long as they take, dispatch included: when the host is the slower
    # side, a busier device only narrows the idle gaps, and the window stays the same.
    window = busy + overhead_s
    exposed = (tp_s + pp_s + cp_s * 0.5 + max(0.0, dp_s - (DP_OVERLAP if gradient_overlap else 0.0) * window)
               + ep_s * (1 - moe_cost.exchange_overlap(plan)))
    offload_exposed = max(0.0, offload_s - OFFLOAD_OVERLAP * window)
    # a stage stalls for its whole work, dispatch included, while the pipeline fills and drains
    bubble_s = window * (plan.pp - 1) / plan.grad_accum if plan.pp > 1 else 0.0
    step = busy + bubble_s + exposed + offload_exposed + memory_s + overhead_s
    return Estimate(compute_s=compute_s, recompute_s=recompute_s, bubble_s=bubble_s, memory_s=memory_s,
                    overhead_s=overhead_s,
                    tp_s=tp_s, cp_s=cp_s, pp_s=pp_s, dp_s=dp_s, ep_s=ep_s, offload_s=offload_s,
                    exposed_comm_s=exposed + offload_exposed, step_time_s=step, tokens_per_step=plan.tokens_per_step,
                    memory=memory, imbalance_s=imbalance_s, imbalance=skew, expert_gemm_s=expert_gemm_s,
                    permute_s=permute_s, expert_efficiency=moe.efficiency, loss_s=loss_s)


def memory_per_device(d: Dims, plan: Plan, hw: Hardware, precision: str = "bf16", imbalance: float = 1.0) -> float:
    """The bytes a device of `plan` holds at its peak: `estimate(...).memory_per_device_bytes`, without pricing the
    step's time (a planner asks it of every memory policy of every layout, and prices the step of those it keeps)."""
    _, _, shape = _priced_layout(d, plan, hw, precision, imbalance)
    return _memory(d, plan, shape)[0]["total"]


def _priced_layout(d: Dims, plan: Plan, hw: Hardware, precision: str, imbalance: float):
    """(the expert load skew priced, the MoE layer's costs, what the step reads of the layout)."""
    if imbalance < 1:
        raise ValueError(f"expert load imbalance is the busiest rank over the mean: at least 1, got {imbalance}")
    skew = imbalance if plan.ep > 1 and d.moe_layers else 1.0
    moe = _MoE.of(d, plan, hw, precision, skew)
    return skew, moe, _Layout.of(d, plan, moe.extra_flops)


def moe_extra_flops(d: Dims, plan: Plan, hw: Hardware, precision: str = "bf16", imbalance: float = 1.0) -> float:
    """What an MoE layer of `plan` takes beyond its FLOPs, as forward FLOPs per token at the dense rate: the weight
    pipeline stages are balanced with (`pipeline.layers_per_stage`)."""
    return _MoE.of(d, plan, hw, precision, imbalance if plan.ep > 1 else 1.0).extra_flops


@dataclass(frozen=True)
class _MoE:
    """An MoE layer's costs beyond its FLOPs at the dense rate, per token a rank holds (`predictors.moe_cost`)."""

    gemm_s_per_token: float  # the routed experts' GEMMs: time beyond the dense rate, the busiest rank's load
    permute_s_per_token: float  # routing, permutation, un-permutation: HBM bytes over bandwidth
    exchange_s_per_token: float  # dispatch + combine All-to-All, before overlap
    extra_flops: float  # all three, exposed, as forward FLOPs per token at the dense rate (pipeline balancing)
    efficiency: float = 1.0  # the experts' GEMMs' share of the dense rate

    @classmethod
    def of(cls, d: Dims, plan: Plan, hw: Hardware, precision: str, skew: float) -> _MoE:
        if not d.moe_layers:
            return cls(0.0, 0.0, 0.0, 0.0)
        rate = hw.matmul_rate(precision)
        train = 2 if plan.lora is not None else 3
        passes = 2 + (1 if plan.recompute == "full" else 0)  # forward, backward, recomputed forward
        routed = d.routed_flops_per_token() / d.moe_layers  # forward, one layer
        efficiency = moe_cost.expert_efficiency(d, plan, hw, precision)
        flops = routed * (train + (1 if plan.recompute == "full" else 0))
        gemm = flops * skew / rate * (1 / efficiency - 1)
        permute = moe_cost.permutation_bytes(d, passes) / (hw.memory_bw_gbs * 1e9)
        # each exchange carries top_k bf16 copies of the rank's tokens: dispatch and combine, forward and backward,
        # and again in a recomputed forward
        sent = d.top_k * d.hidden * moe_cost.BF16 * skew
        exchanges = 4 + (2 if plan.recompute == "full" else 0)
        stride = plan.expert_tp if plan.folded else plan.tp
        exchange = exchanges * moe_cost.all_to_all_s(sent, plan.ep, stride, hw)
        exposed = gemm + permute + exchange * (1 - moe_cost.exchange_overlap(plan))
        return cls(gemm, permute, exchange, exposed * rate / train, efficiency)


@dataclass(frozen=True)
class _Layout:
    """What every part of a step's price reads of the plan's layout."""

    layers_stage: int  # the stage with the most layers holds the most activations; the slowest one sets the pace
    stage_share: float
    lora: bool
    n_lora: int
    n_lora_active: int
    fsdp: int  # FSDP2 shards over dp_shard x cp (torchtitan); with dp_shard = 1 context parallel shards nothing
    folded: _Folded | None
    dense_params: int

    @classmethod
    def of(cls, d: Dims, plan: Plan, moe_extra: float = 0.0) -> _Layout:
        n_lora, n_lora_active = lora_params(d, plan)
        return cls(layers_stage=max(plan.pp_layers) if plan.pp_layers else math.ceil(d.layers / plan.pp),
                   stage_share=pipeline.share(d, plan, moe_extra), lora=plan.lora is not None, n_lora=n_lora,
                   n_lora_active=n_lora_active, fsdp=plan.dp_shard * plan.cp if plan.dp_shard > 1 else 1,
                   folded=_folded(plan) if plan.folded else None, dense_params=d.params_total - d.expert_params)


def _compute(d: Dims, plan: Plan, hw: Hardware, precision: str, skew: float, shape: _Layout):
    """(compute, recompute, the busiest EP rank's extra routed-expert compute) in seconds."""
    s, world, tokens_step = plan.seq_len, plan.world_size, plan.tokens_per_step
    fwd = d.forward_flops_per_token(s)
    # under context parallelism a linear-attention core runs each segment with K more value columns (its transition
    # from the identity rides along: `runtime.parallel.context.carry`), about one more core with K = V; the
    # incoming state's product adds 2 K V per head and token, small beside it
    if plan.cp > 1:
        fwd += sum(m.flops(s) for m in d.mixers if m.linear)
    # frozen base weights need no weight gradients: backward costs one forward instead of two
    train = (2 if shape.lora else 3) * fwd + 6 * shape.n_lora_active
    extra = {"full": fwd, "selective": d.mixing_flops(s)}.get(plan.recompute, 0.0)
    peak = hw.matmul_rate(precision)
    mixing = d.mixing_flops(s)
    if precision == "fp8":
        # FP8 training (Transformer Engine, torchao float8) runs the linear layers' GEMMs in FP8; the attention
        # core (scores, softmax, weighted sum: `mixing_flops`) stays BF16 (FlashAttention), at the BF16 peak of
        # predictors/hardware/*.yaml. Before, every FLOP was priced at the FP8 peak.
        slow = peak / hw.matmul_rate("bf16")  # how much longer a bf16 FLOP takes
        mix_share = mixing / fwd
        train_eff = train * (1 + mix_share * (slow - 1))
        extra_eff = fwd * (1 + mix_share * (slow - 1)) if plan.recompute == "full" else extra * slow
    else:
        train_eff, extra_eff = train, extra
    compute_s = tokens_step * train_eff / world / peak * shape.stage_share
    recompute_s = tokens_step * extra_eff / world / peak * shape.stage_share
    # routed experts' share of that compute, of which the busiest EP rank does `skew` times the balanced part
    routed_flops = d.routed_flops_per_token()
    routed_train = (2 if shape.lora else 3) * routed_flops + (routed_flops if plan.recompute == "full" else 0.0)
    imbalance_s = tokens_step * routed_train / world / peak * shape.stage_share * (skew - 1)
    return compute_s, recompute_s, imbalance_s


def _memory(d: Dims, plan: Plan, shape: _Layout) -> tuple[dict, float, dict, float]:
    """(memory per device by part, the parameters each device keeps, activation bytes per token by kind, activation
    bytes per token and layer kept on the host)."""
    fsdp, folded, dense_params = shape.fsdp, shape.folded, shape.dense_params
    b, s = plan.micro_batch, plan.seq_len
    expert_shard = folded.shard if folded else plan.tp * max(plan.ep, fsdp)
    local = (dense_params / (plan.tp * fsdp) + d.expert_params / expert_shard) * shape.stage_share / plan.pp
    if shape.lora:
        weights = local * BF16
        states = shape.n_lora * TRAINED_BYTES / (plan.tp * fsdp * plan.pp)
        grads = 0.0
    else:
        weights = local * (FP32 if plan.dp_shard > 1 else BF16)
        grads = local * FP32
        states = local * (TRAINED_BYTES - FP32 - (FP32 if plan.dp_shard > 1 else 0))
    # FSDP gathers one layer unsharded and prefetches the next
    layer_full = ((dense_params / d.layers) / plan.tp
                  + (d.expert_params / d.layers) / (plan.expert_tp * plan.ep)) * BF16
    gathered = 2 * layer_full if fsdp > 1 else 0.0
    per = activation_bytes_per_token(d, plan)
    kept, host = _resident_activation(per, plan)
    tokens_mb = b * s / (plan.cp * plan.tp)
    in_flight = min(plan.pp, plan.grad_accum)
    # + one layer being worked on, and an MoE layer's dispatch and combine buffers while it runs
    in_layer = per["layer"] + (moe_cost.activation_bytes(d)[1] if d.moe_layers else 0.0)
    activations = tokens_mb * (kept * shape.layers_stage * in_flight + in_layer)
    logit_tokens = min(plan.loss_chunk, b * s / plan.cp) if plan.loss_chunk else b * s / plan.cp
    logits = logit_tokens * d.vocab / plan.tp * (BF16 + FP32 + FP32)  # logits, fp32 softmax, fp32 grad
    memory = {"weights": weights, "gradients": grads, "optimizer": states, "gathered": gathered,
              "activations": activations, "logits": logits, "reserved": RESERVED_BYTES}
    memory["total"] = sum(memory.values())
    return memory, local, per, host


def _communication(d: Dims, plan: Plan, hw: Hardware, shape: _Layout) -> tuple[float, ...]:
    """Seconds of tensor-, context-, pipeline- and data-parallel traffic a step (the expert-parallel exchange is
    `_MoE`'s)."""
    b, s, m, world = plan.micro_batch, plan.seq_len, plan.grad_accum, plan.world_size
    fsdp, folded, lora, n_lora = shape.fsdp, shape.folded, shape.lora, shape.n_lora
    act_mb = b * s / plan.cp * d.hidden * BF16  # one micro-batch's hidden states on a TP group
    # all-reduces per layer and micro-step (Megatron-LM, no sequence parallelism): two forward (after attention and
    # after the MLP), two backward, and with full recompute two more, the recomputed forward's (Korthikanti et al.
    # 2022, "Reducing Activation Recomputation in Large Transformer Models", Sec. 5); selective recompute reruns the
    # attention core only, inside the tp group, with no all-reduce. Before, the recompute's two were not charged.
    n_ar = 4 + (2 if plan.recompute == "full" else 0)
    tp_s = shape.layers_stage * m * n_ar * 2 * _ring(plan.tp) * act_mb / (hw.link_gbs(plan.tp) * 1e9)
    # softmax and sparse layers all-gather their keys and values (the backward all-reduces their gradients);
    # linear layers exchange a state per segment, (K x (V + K)) per head, which this leaves out
    softmax_layers = d.layers - d.linear_layers
    kv_local = b * s / plan.cp * 2 * d.kv_heads * d.head_dim * BF16 / plan.tp
    cp_s = (softmax_layers * shape.stage_share / plan.pp * m * 3 * (plan.cp - 1) * kv_local
            / (hw.link_gbs(plan.cp * plan.tp) * 1e9))
    pp_s = 2 * m * act_mb / plan.tp / (hw.link_gbs(world) * 1e9) if plan.pp > 1 else 0.0

    span_shard = fsdp * plan.tp
    dense_local_bf16 = shape.dense_params / plan.tp * shape.stage_share / plan.pp * BF16
    expert_local_bf16 = d.expert_params / (plan.expert_tp * plan.ep) * shape.stage_share / plan.pp * BF16
    expert_fsdp = folded.edp if folded else max(1, fsdp // plan.ep)
    grad_bytes = FP32 if not lora else 0
    if fsdp > 1:
        # per micro-step: all-gather forward, all-gather backward, reduce-scatter gradients
        per_micro = (_ring(fsdp) * dense_local_bf16 * (2 + grad_bytes / BF16)
                     + _ring(expert_fsdp) * expert_local_bf16 * (2 + grad_bytes / BF16))
        dp_s = m * per_micro / (hw.link_gbs(span_shard) * 1e9)
        if lora:
            dp_s += 2 * _ring(fsdp) * n_lora * FP32 / (plan.tp * plan.pp) / (hw.link_gbs(span_shard) * 1e9)
    else:
        dp_s = 0.0
    if folded and not lora and plan.dp_replicate > 1:
        # dense gradients all-reduce over the replicas; expert gradients over the edp ranks holding the same
        # experts (within the FSDP reduce-scatter above when sharded)
        link = hw.link_gbs(world // plan.pp) * 1e9
        dp_s += 2 * _ring(plan.dp_replicate) * dense_local_bf16 / BF16 / fsdp * FP32 / link
        if fsdp == 1:
            dp_s += 2 * _ring(folded.edp) * expert_local_bf16 / BF16 * FP32 / link
    elif plan.dp_replicate > 1:
        trained = (n_lora / (plan.tp * plan.pp) if lora
                   else (dense_local_bf16 + expert_local_bf16) / BF16 / fsdp)
        dp_s += 2 * _ring(plan.dp_replicate) * trained * FP32 / (hw.link_gbs(world // plan.pp) * 1e9)

    return tp_s, cp_s, pp_s, dp_s


def fits(memory_bytes: float, hw: Hardware) -> bool:
    """Whether a device holds `memory_bytes` (`memory_per_device`, or an estimate's), less what stays unusable."""
    return memory_bytes <= hw.memory_bytes * USABLE_FRACTION
