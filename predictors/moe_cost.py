"""What a Mixture-of-Experts layer costs beyond its FLOPs: the physics `predictors.costmodel` adds for MoE layers.

The dense cost model prices every FLOP at one fraction of the chip's peak (`Hardware.matmul_efficiency`). An MoE
layer breaks that in four ways, each a function below with its formula and its source:

- `expert_efficiency`: its experts run small grouped GEMMs, far below a large GEMM's rate when each local expert
  gets few tokens or is narrow (`gemm_efficiency`: a roofline times the published grouped GEMM's tile fill);
- `permutation_bytes`: routing, permutation and un-permutation move every routed token copy through HBM and do
  almost no arithmetic: priced as bytes over memory bandwidth;
- `all_to_all_s`: dispatch and combine exchange each routed copy with the EP group, at scale-up bandwidth with the
  peers inside the NVLink / HCCS domain (72 GPUs on an NVL72 rack) and at the scale-out NIC's with the rest;
- `exchange_overlap`: how much of that exchange hides behind expert compute, as the system that runs the plan
  does it;
- `activation_bytes`: what routing and permutation keep on the device, for the fit check.

Shapes follow `runtime.plan.Plan`: a rank holds b s / (cp tp) tokens of a micro-batch (sequence parallel inside the
tensor-parallel group); the experts' tensor parallel degree is `Plan.expert_tp` (etp when folded, else tp), and the
EP group's members lie `expert_tp` devices apart (`costmodel` module docstring: tp is the innermost mesh dim).
"""

from __future__ import annotations

from predictors.hardware import Hardware
from runtime.dims import Dims
from runtime.plan import Plan

BF16, FP32, INT64 = 2, 4, 8
# The grouped GEMM's fill: an expert's rows are padded to whole tiles, every output tile pays a fixed prologue and
# epilogue beside its K-loop, and a narrow output leaves part of the chip's SMs without tiles, so a GEMM of M rows,
# reduction depth K and N columns reaches M / (M + M_FILL) x K / (K + K_FILL) x N / (N + N_FILL) of the rate large
# ones reach (per chip: `Hardware.gemm_fill_rows` / `gemm_fill_depth` / `gemm_fill_width`; these are a GPU's
# defaults, and the CPU's are measured by bench/moe.py --curve). The figures are DeepGEMM's published tables
# (deepseek-ai/DeepGEMM README @55ab91f, H800 SXM5, FP8):
# - rows: grouped GEMMs at N = 4096, K = 7168 reach 932, 1040, 1233 and 1346 TFLOPS at 256, 512, 1024 and
#   4096-8192 rows per expert, 0.69 / 0.77 / 0.92 / 1 of the last (M_FILL = 128: 0.67 / 0.80 / 0.89 / 0.97);
# - depth: its dense GEMMs at M = 4096 reach 0.53, 0.79, 0.82 of the K = 16384 rate at K = 512, 1536, 2048
#   (K_FILL = 384: 0.57, 0.80, 0.84);
# - width: at M = 4096, K = 7168, N = 2112 reaches 1009 TFLOPS and N = 4096 1265: 0.80, which N_FILL = 1500 gives.
M_FILL, K_FILL, N_FILL = Hardware.gemm_fill_rows, Hardware.gemm_fill_depth, Hardware.gemm_fill_width  # 128, 384, 1500
# Share of the scale-up link's line rate an All-to-All reaches: NCCL's all-to-all peaks at a bus bandwidth of about
# 370 GB/s on H100 NVLink (450 GB/s a direction; nccl-tests issue #212); over the scale-out NIC it reaches the line
# rate (48-49 of 50 GB/s on CX7 NDR, nccl-tests issues #130 / #267), so that side is taken as it is.
A2A_SCALE_UP_SHARE = 370 / 450
# Share of the exchange that hides behind expert compute when a plan overlaps them (`Plan.overlap`). The runtime
# (runtime.parallel.expert) splits the local experts in two and runs the first half while the remote tokens are in
# flight, so at most about half the exchange can hide; bench/overlap.py measures what it hides on this machine.
RUNTIME_OVERLAP = 0.5


def local_gemm(d: Dims, plan: Plan) -> tuple[float, int, int]:
    """(M, K, N) of one local expert's GEMM in one micro-batch: M tokens routed to it, K = hidden, N its width.

    The EP group gathers the tokens of its ep x expert_tp ranks, each b s / (cp tp) of them, and each token picks
    top_k of E experts, so an expert receives on average

        M = b s / (cp tp) * expert_tp * ep * top_k / E

    rows (with expert parallelism off, ep = 1: every rank routes its own tokens to every expert). The expert's
    width is split expert_tp ways: N = expert_ffn / expert_tp."""
    tokens = plan.micro_batch * plan.seq_len / (plan.cp * plan.tp) * plan.expert_tp * plan.ep
    m = tokens * d.top_k / d.experts
    return m, d.hidden, max(1, d.expert_ffn // plan.expert_tp)


def gemm_efficiency(m: float, k: float, n: float, hw: Hardware, precision: str = "bf16") -> float:
    """Share of a large GEMM's rate an (M x K) @ (K x N) GEMM reaches: a roofline times the tile fill.

        intensity I = 2 M K N / (bytes per element * (M K + K N + M N))      FLOPs per byte moved
        ridge     R = rate / HBM bandwidth,  rate = peak * matmul_efficiency  (the dense model's rate)
        efficiency  = min(1, I / R) * M / (M + M_FILL) * K / (K + K_FILL) * N / (N + N_FILL)
                                                                             (the chip's own fills)

    Below the ridge a GEMM waits on memory (Williams, Waterman & Patterson 2009, "Roofline"): a narrow expert that
    gets few tokens reads its whole weight matrix for a few rows. The fill factors are the chip's grouped GEMM
    curve (M_FILL, K_FILL, N_FILL above)."""
    if m <= 0 or k <= 0:
        return 1.0
    size = {"fp8": 1, "fp32": FP32}.get(precision, BF16)
    intensity = 2 * m * k * n / (size * (m * k + k * n + m * n))
    ridge = hw.matmul_rate(precision) / (hw.memory_bw_gbs * 1e9)
    return (min(1.0, intensity / ridge) * m / (m + hw.gemm_fill_rows) * k / (k + hw.gemm_fill_depth)
            * n / (n + hw.gemm_fill_width))


def expert_efficiency(d: Dims, plan: Plan, hw: Hardware, precision: str = "bf16") -> float:
    """Share of the large-GEMM rate a training step's expert GEMMs reach together: the FLOP-weighted harmonic mean
    over each GEMM a gated expert runs, with M rows (`local_gemm`), hidden h and width F:

        forward        x W_gate|up: (M, h) @ (h, 2F)       y W_down: (M, F) @ (F, h)
        data grads     dY W_down^T: (M, h) @ (h, F)        dZ W_gate|up^T: (M, 2F) @ (2F, h)
        weight grads   x^T dZ: (h, M) @ (M, 2F)            y^T dY: (F, M) @ (M, h)

    A weight gradient reduces over the expert's M tokens, so few tokens per expert make it short and slow; frozen
    experts (LoRA) skip it.

    The result is relative to the model's own dense GEMMs, which the cost model's rate already prices: the
    attention projections of the same micro-batch, (b s / (cp tp), h) @ (h, h), by the same formula; so a small
    model whose every GEMM is small (the CPU twins) is not charged twice for it."""
    m, h, f = local_gemm(d, plan)
    tokens = plan.micro_batch * plan.seq_len / (plan.cp * plan.tp)
    # kept on the chip's instance by the shapes it depends on: a planner asks for a few hundred shapes thousands
    # of times (the Dims cache's pattern; frozen fields, the cache is no field)
    cache = hw.__dict__.setdefault("_expert_efficiency", {})
    key = (m, h, f, tokens, plan.lora is None, precision)
    if key not in cache:
        gemms = [(m, h, 2 * f), (m, f, h), (m, h, f), (m, 2 * f, h)]
        if plan.lora is None:
            gemms += [(h, m, 2 * f), (f, m, h)]
        flops = [a * b * c for a, b, c in gemms]
        time = sum(w / gemm_efficiency(a, b, c, hw, precision) for w, (a, b, c) in zip(flops, gemms))
        reference = gemm_efficiency(tokens, h, h, hw, precision)
        cache[key] = min(1.0, sum(flops) / time / reference)
    return cache[key]


def permutation_bytes(d: Dims, passes: int) -> float:
    """HBM bytes per token per MoE layer that routing, permutation and un-permutation move, over `passes` passes
    (forward, backward, and the recomputed forward under full recompute).

    A pass reads the token (h bf16) and writes its top_k copies in expert order, then reads the k expert outputs
    back and writes their weighted sum: 2 (k + 1) h bf16. The router writes E fp32 logits, the softmax (or sigmoid)
    reads and writes them and top-k reads them: 4 E fp32. Megatron-Core's fused permute and TransformerEngine's
    moe_permute are single passes of exactly these reads and writes (no arithmetic to hide them behind)."""
    per_pass = 2 * (d.top_k + 1) * d.hidden * BF16 + 4 * d.experts * FP32
    return passes * per_pass


def all_to_all_s(bytes_per_rank: float, ep: int, stride: int, hw: Hardware) -> float:
    """Seconds for one All-to-All in which each of `ep` ranks, `stride` devices apart, sends `bytes_per_rank` spread
    evenly over the group (its own share stays local).

    A domain of D devices that reach each other at scale-up bandwidth (NVLink, HCCS; `Hardware.domain`) holds
    n = min(ep, max(1, D // stride)) members of the group, so a rank sends (n - 1) / ep of its bytes over scale-up
    links and (ep - n) / ep over its scale-out NIC, both at once:

        t = max(bytes (n - 1) / ep / (B_up A2A_SCALE_UP_SHARE), bytes (ep - n) / ep / B_out)

    Inside one HGX board (D = 8) an EP of 8 is all NVLink; EP 64 on H100 sends 7/8 of its bytes over the NIC, and
    on an NVL72 rack (D = 72) none."""
    if ep <= 1:
        return 0.0
    inside = min(ep, max(1, hw.domain // max(1, stride)))
    up = bytes_per_rank * (inside - 1) / ep / (hw.scale_up_gbs * A2A_SCALE_UP_SHARE * 1e9)
    out = bytes_per_rank * (ep - inside) / ep / (hw.scale_out_gbs * 1e9)
    return max(up, out)


def exchange_overlap(plan: Plan) -> float:
    """Share of the dispatch / combine exchange hidden behind expert compute: RUNTIME_OVERLAP when the plan overlaps
    them (`Plan.overlap`, as runtime.parallel.expert does), none when it does not (Megatron-Core's default
    all-to-all dispatcher waits on each exchange unless `--overlap-moe-expert-parallel-comm` is given; converted
    published runs say which, `predictors.published`)."""
    return RUNTIME_OVERLAP if plan.overlap else 0.0


def activation_bytes(d: Dims) -> tuple[float, float]:
    """(bytes per token per MoE layer saved for backward by routing, bytes per token of the exchange buffers of
    the one layer in flight).

    Saved: the router's E fp32 probabilities (the softmax's backward reads them) and the top_k int64 expert
    indices with their fp32 weights. In flight: the dispatch buffer receives top_k copies of the token and the
    combine buffer sends them back, 2 k h bf16, held while that layer runs (the permuted copies the experts save
    are counted with the expert activations, `costmodel.activation_bytes_per_token`)."""
    saved = d.experts * FP32 + d.top_k * (INT64 + FP32)
    return saved, 2 * d.top_k * d.hidden * BF16
