"""Hot experts under expert parallelism: the busiest rank's load and the step time, static layout vs a placement
with replicas chosen from measured load (gloo, CPU processes, one run).

Each of `--world` processes holds its experts of one MoE layer (runtime.moe.MoEBlock around transformers'
Qwen3-MoE weights) and runs forward + backward on its own tokens. The router prefers some experts: its logits
get a bias log(1 / rank^s) (a Zipf-like popularity with exponent s = --skew-percent / 100) on top of token-dependent logits of
spread 1, so a few experts get most tokens. Popularity follows expert order, so the static layout puts the hottest experts together on rank 0
(the case rebalancing is for); with --shuffle it follows a seeded shuffle instead. Measured in turns, all ranks in step:
  static      experts e in [r E/world, (r+1) E/world) on rank r (runtime.parallel today without rebalancing)
  placed      runtime.moe.placement.place from the token counts of a first forward (all ranks' counts), with
              --replicas replica rows per rank, laid out by runtime.parallel.rebalance.apply_placement; the step
              includes summing the replicas' gradients
Prints the busiest rank's tokens over the mean for both, the excess over 1 that placement removed, the slowest
rank's median step time of both, and the largest output difference between them. Never passes or fails on time.

    python bench/expert_balance.py [--world 4] [--skew-percent 100] [--replicas 2] [--experts 16] [--shuffle]
"""

from __future__ import annotations

import copy
import math
import os
import random
import statistics
import time

import torch
import torch.distributed as dist
from runtime.moe import MoEBlock, RouterSpec
from runtime.moe.block import GroupedExperts
from runtime.moe.placement import imbalance, place
from runtime.parallel import ExpertParallel, shard_experts
from runtime.parallel.rebalance import apply_placement, sum_replica_grads
import common  # bench/common.py: the benches' shared command line
import overlap  # bench/overlap.py: the expert-parallel MoE layer it times


def popularity_bias(experts: int, skew: float, shuffle: bool) -> torch.Tensor:
    """Router logit bias log(1 / rank^skew), the ranks in expert order or shuffled (seeded) over the experts."""
    ranks = list(range(1, experts + 1))
    if shuffle:
        random.Random(0).shuffle(ranks)
    return torch.tensor([-skew * math.log(r) for r in ranks])


def hf_block(args) -> torch.nn.Module:
    block = overlap.hf_block(args)  # transformers' Qwen3-MoE block, the same weights on every rank
    with torch.no_grad():
        # router logits of spread 1 per token, so the popularity bias skews which experts tokens pick without
        # deciding it alone
        block.gate.weight.normal_(0, args.hidden ** -0.5)
    return block


def ep_block(hf: torch.nn.Module, args, spare: int) -> MoEBlock:
    hf = copy.deepcopy(hf)
    spec = RouterSpec(num_experts=args.experts, top_k=args.top_k, score="softmax", renormalize=True)
    experts = GroupedExperts(hf.experts.gate_up_proj, hf.experts.down_proj, activation=hf.experts.act_fn)
    block = MoEBlock(hf.gate.weight, spec, experts,
                     router_linear_bias=popularity_bias(args.experts, args.skew_percent / 100, args.shuffle))
    shard_experts(block.experts, args.experts, dist.get_rank(), dist.get_world_size(), spare)
    block.expert_parallel = ExpertParallel(args.experts, dist.group.WORLD, spare=spare)
    return block


class _Model(torch.nn.Module):  # what sum_replica_grads walks: a model holding MoE blocks
    def __init__(self, block):
        super().__init__()
        self.block = block


def step(block, x, replicas: bool):
    model = _Model(block)

    def run():
        block(x).pow(2).mean().backward()
        if replicas:
            sum_replica_grads(model)
        for p in block.parameters():
            p.grad = None
    return run


def rank_main(rank: int, args, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    hf = hf_block(args)
    x = torch.randn(1, args.tokens, args.hidden, generator=torch.Generator().manual_seed(rank + 1))
    static = ep_block(hf, args, 0)
    placed = ep_block(hf, args, args.replicas)
    with torch.no_grad():
        reference = static(x)
    counts = static.tokens_per_expert.double()
    dist.all_reduce(counts)  # every rank's tokens: every rank computes the same placement
    counts = counts.tolist()
    chosen = place(counts, args.world, args.replicas)
    apply_placement(placed, chosen)
    with torch.no_grad():
        difference = torch.tensor([(placed(x) - reference).abs().max().item()])
    dist.all_reduce(difference, op=dist.ReduceOp.MAX)
    # the rows each rank's experts computed, as counted by the exchange (not the placement's arithmetic)
    rows = torch.zeros(2, args.world)
    rows[0, rank], rows[1, rank] = static.expert_parallel.rows, placed.expert_parallel.rows
    dist.all_reduce(rows)
    variants = {"static": step(static, x, False), "placed": step(placed, x, True)}
    for fn in variants.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, fn in variants.items():  # in turns, all ranks in step, so drift hits both alike
            dist.barrier()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    medians = torch.tensor([statistics.median(times[name]) for name in variants])
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    if rank == 0:
        before, after = (float(r.max() / r.mean()) for r in rows)
        planned = imbalance(counts, chosen)
        share = max(counts) / sum(counts) * args.experts
        print(f"MoE layer fwd+bwd under expert parallelism, fp32, gloo, {args.world} processes x {args.threads} "
              f"thread(s), {args.tokens} tokens/rank, hidden {args.hidden}, {args.experts} experts, top-{args.top_k}, "
              f"expert FFN {args.ffn}; router popularity Zipf s={args.skew_percent / 100:.2f} (hottest expert "
              f"{share:.2f}x the mean expert's tokens), {args.replicas} replica row(s) per rank")
        print(f"  busiest rank / mean tokens computed: static {before:.3f}, placed {after:.3f} (the placement's "
              f"even split: {planned:.3f}); excess over 1 removed: "
              f"{(1 - (after - 1) / (before - 1)) * 100 if before > 1 else 0.0:.0f}%")
        ms = dict(zip(variants, medians.tolist()))
        for name, seconds in ms.items():
            print(f"  {name:<7} step {seconds * 1e3:8.1f} ms (slowest rank, median of {args.repeats})")
        print(f"  static / placed step time: {ms['static'] / ms['placed']:.2f}x; max |output difference| "
              f"{difference.item():.1e}")
        print(f"  counts {[round(c) for c in counts]}")
        print(f"  placement: owners {[list(o) for o in chosen.owners]}, replicas {[list(r) for r in chosen.replicas]}")
    dist.destroy_process_group()


def main() -> None:
    parser = common.parser(__doc__, world=4, tokens=2048, hidden=256, experts=16, top_k=2, ffn=512, repeats=5,
                           replicas=(2, "replica rows per rank"),
                           skew_percent=(100, "Zipf exponent of the router's popularity bias, in hundredths"),
                           threads=(1, "torch threads per process"))
    parser.add_argument("--shuffle", action="store_true", help="popularity in a seeded shuffle of the experts "
                                                               "(default: in expert order, hottest on rank 0)")
    args = parser.parse_args()
    common.spawn_ranks(rank_main, args, args.world)


if __name__ == "__main__":
    main()
