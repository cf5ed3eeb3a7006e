"""Runtime MoE layer vs transformers' own experts implementations, forward + backward, fp32, CPU.

Prints times as ratios against the HuggingFace reference measured in the same run, and the fraction of
this machine's fp32 matmul peak (also measured in this run). Never passes or fails on time.

    python bench/moe.py [--tokens 4096] [--hidden 1024] [--experts 32] [--top-k 4] [--ffn 256] [--repeats 5]
    python bench/moe.py --curve

--curve measures instead how far below a large GEMM's rate small ones run on this machine (fp32): the rate at M rows
(K = N = 1024), at reduction depth K (M = N = 1024) and at width N (M = K = 1024) over the 1024^3 rate, and fits
the cost model's fill factors M / (M + rows), K / (K + depth) and N / (N + width) to them (`predictors.moe_cost.gemm_efficiency`; predictors/hardware/cpu.yaml's
gemm_fill_rows, gemm_fill_depth and gemm_fill_width).
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
from runtime.moe import MoEBlock, RouterSpec
from runtime.moe.block import GroupedExperts
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

import common  # bench/common.py: the benches' shared command line


def timed(fn):
    """A function that runs fn and returns how long it took."""
    def run() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    return run


def matmul_peak(repeats: int) -> float:
    """Best fp32 GEMM rate this machine reaches (the fastest of a few sizes and tries)."""
    best = 0.0
    for n in (1024, 2048, 3072):
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            best = max(best, 2 * n**3 / (time.perf_counter() - start))
    return best


def gemm_rate(m: int, k: int, n: int, repeats: int) -> float:
    """Best FLOP/s of an (m x k) @ (k x n) fp32 GEMM over `repeats` timed batches of about 2 GFLOP each."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    batch = max(3, int(2e9 / (2 * m * k * n)))
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(batch):
            a @ b
        best = max(best, 2 * m * k * n * batch / (time.perf_counter() - start))
    return best


def fill(points: dict[int, float]) -> float:
    """The c of x / (x + c) closest (least squares, on a grid of 0.5 steps) to the measured rate ratios."""
    grid = [c / 2 for c in range(1, 2049)]
    return min(grid, key=lambda c: sum((x / (x + c) - r) ** 2 for x, r in points.items()))


def curve(repeats: int) -> None:
    big = gemm_rate(1024, 1024, 1024, repeats)
    rows = {m: gemm_rate(m, 1024, 1024, repeats) / big for m in (4, 8, 16, 32, 64, 128, 256, 512, 2048)}
    depth = {k: gemm_rate(1024, k, 1024, repeats) / big for k in (16, 32, 64, 128, 256, 512, 2048)}
    width = {n: gemm_rate(1024, 1024, n, repeats) / big for n in (16, 32, 64, 128, 256, 512, 2048)}
    print(f"fp32 GEMM rate over the 1024^3 rate ({big / 1e9:.1f} GFLOP/s), {torch.get_num_threads()} threads")
    print("  rows M (K = N = 1024): " + "  ".join(f"{m}: {r:.2f}" for m, r in rows.items()))
    print("  depth K (M = N = 1024): " + "  ".join(f"{k}: {r:.2f}" for k, r in depth.items()))
    print("  width N (M = K = 1024): " + "  ".join(f"{n}: {r:.2f}" for n, r in width.items()))
    print(f"  fitted gemm_fill_rows: {fill(rows):g}   gemm_fill_depth: {fill(depth):g}   "
          f"gemm_fill_width: {fill(width):g}")


def hf_block(args, implementation: str) -> torch.nn.Module:
    config = Qwen3MoeConfig(hidden_size=args.hidden, num_experts=args.experts, num_experts_per_tok=args.top_k,
                            moe_intermediate_size=args.ffn, norm_topk_prob=True)
    config._experts_implementation = implementation
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    return block


def runtime_block(hf: torch.nn.Module, args) -> MoEBlock:
    spec = RouterSpec(num_experts=args.experts, top_k=args.top_k, score="softmax", renormalize=True)
    experts = GroupedExperts(hf.experts.gate_up_proj, hf.experts.down_proj, activation=hf.experts.act_fn)
    return MoEBlock(hf.gate.weight, spec, experts)


def step(block, x):
    def run():
        out = block(x)
        out = out[0] if isinstance(out, tuple) else out
        out.float().pow(2).mean().backward()
        for p in block.parameters():
            p.grad = None
    return run


def main() -> None:
    parser = common.parser(__doc__, tokens=4096, hidden=1024, experts=32, top_k=4, ffn=256, repeats=5,
                           threads=(torch.get_num_threads(), "torch threads"))
    common.add_ftz(parser)
    parser.add_argument("--curve", action="store_true",
                        help="measure small GEMMs' share of the large-GEMM rate and fit the cost model's fill factors")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.curve:
        curve(args.repeats)
        return

    x = torch.randn(1, args.tokens, args.hidden) * 0.5
    eager = hf_block(args, "eager")
    grouped = hf_block(args, "grouped_mm")
    ours = runtime_block(copy.deepcopy(grouped), args)
    with torch.no_grad():  # same numbers from all three
        ref = eager(x)
        ref = ref[0] if isinstance(ref, tuple) else ref
        err = (ours(x) - ref).abs().max().item()

    variants = {"hf eager": step(eager, x), "hf grouped_mm": step(grouped, x), "runtime": step(ours, x)}
    modes = common.ftz_modes(args.ftz)
    rounds, _ = common.alternate_modes({name: timed(fn) for name, fn in variants.items()}, modes, args.repeats)
    made = {name: common.subnormals(fn) for name, fn in variants.items()}
    peak = matmul_peak(args.repeats)
    flops = 3 * args.tokens * args.top_k * (2 * args.hidden * 2 * args.ffn + 2 * args.ffn * args.hidden)
    flops += 3 * 2 * args.tokens * args.hidden * args.experts  # router
    print(f"MoE layer fwd+bwd, fp32, {args.tokens} tokens, hidden {args.hidden}, {args.experts} experts, "
          f"top-{args.top_k}, expert FFN {args.ffn}, {args.threads} threads (max |diff| vs HF {err:.1e})")
    for ftz in modes:
        results = {name: statistics.median(rounds[ftz, name]) for name in variants}
        best_hf = min(results["hf eager"], results["hf grouped_mm"])
        print(f" {common.ftz_label(ftz)}:")
        for name, seconds in results.items():
            extra = f"  {made[name][0]} subnormal values made" if not ftz else ""
            print(f"  {name:<14} {seconds * 1e3:8.1f} ms  {flops / seconds / 1e9:7.1f} GFLOP/s  "
                  f"{flops / seconds / peak:6.1%} of matmul peak  speed-up vs best HF {best_hf / seconds:5.2f}x{extra}")
    print(f"  fp32 matmul peak (best of 1024^3..3072^3) {peak / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
