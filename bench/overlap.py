"""Expert-parallel MoE layer step time with and without compute / All-to-All overlap (gloo, CPU processes).

Each of `--world` processes holds E/world experts of one MoE layer (transformers' Qwen3-MoE block swapped
for runtime.moe.MoEBlock) and runs forward + backward on its own tokens. Variants, measured in turns:
  hf one process    transformers' block with every expert, this rank's tokens, no communication
  ep no overlap     the dispatch All-to-All is waited on before the local experts run
  ep overlap        the local experts run while the remote tokens are in flight
Prints the slowest rank's median per variant, the ratios, and the time a step spent blocked waiting on
exchanges (what overlap did not hide). Never passes or fails on time.

    python bench/overlap.py [--world 2] [--tokens 2048] [--hidden 512] [--experts 8] [--top-k 2] [--ffn 512]
"""

from __future__ import annotations

import copy
import os
import statistics
import time

import torch
import torch.distributed as dist
from runtime.moe import MoEBlock, RouterSpec
from runtime.moe.block import GroupedExperts
from runtime.parallel import ExpertParallel, shard_experts
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

import common  # bench/common.py: the benches' shared command line


def hf_block(args) -> torch.nn.Module:
    config = Qwen3MoeConfig(hidden_size=args.hidden, num_experts=args.experts, num_experts_per_tok=args.top_k,
                            moe_intermediate_size=args.ffn, norm_topk_prob=True)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)  # the same weights on every rank
    block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    return block


def ep_block(hf: torch.nn.Module, args, overlap: bool) -> MoEBlock:
    hf = copy.deepcopy(hf)
    spec = RouterSpec(num_experts=args.experts, top_k=args.top_k, score="softmax", renormalize=True)
    experts = GroupedExperts(hf.experts.gate_up_proj, hf.experts.down_proj, activation=hf.experts.act_fn)
    block = MoEBlock(hf.gate.weight, spec, experts)
    shard_experts(block.experts, args.experts, dist.get_rank(), dist.get_world_size())
    block.expert_parallel = ExpertParallel(args.experts, dist.group.WORLD, overlap=overlap)
    return block


def step(block, x):
    def run():
        out = block(x)
        out = out[0] if isinstance(out, tuple) else out
        out.pow(2).mean().backward()
        for p in block.parameters():
            p.grad = None
    return run


def rank_main(rank: int, args, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    hf = hf_block(args)
    x = torch.randn(1, args.tokens, args.hidden, generator=torch.Generator().manual_seed(rank + 1))
    blocks = {"ep no overlap": ep_block(hf, args, False), "ep overlap": ep_block(hf, args, True)}
    variants = {"hf one process": step(hf, x), **{name: step(b, x) for name, b in blocks.items()}}
    with torch.no_grad():
        ref = hf(x)
        errors = {name: (ep_block(hf, args, name == "ep overlap")(x) - ref).abs().max().item()
                  for name in ("ep no overlap", "ep overlap")}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        fn()  # warm-up
    for b in blocks.values():
        b.expert_parallel.comm.reset()
    for _ in range(args.repeats):
        for name, fn in variants.items():  # in turns, all ranks in step, so drift hits every variant alike
            dist.barrier()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    medians = torch.tensor([statistics.median(times[name]) for name in variants])
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    blocked = torch.tensor([b.expert_parallel.comm.reset() / args.repeats for b in blocks.values()])
    dist.all_reduce(blocked, op=dist.ReduceOp.MAX)
    if rank == 0:
        ms = dict(zip(variants, medians.tolist()))
        print(f"MoE layer fwd+bwd under expert parallelism, fp32, gloo, {args.world} processes x {args.threads} "
              f"thread(s), {args.tokens} tokens/rank, hidden {args.hidden}, {args.experts} experts, "
              f"top-{args.top_k}, expert FFN {args.ffn}; max |diff| vs HF: "
              + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))
        waits = dict(zip(blocks, blocked.tolist()))
        for name, seconds in ms.items():
            wait = f"   blocked on exchanges {waits[name] * 1e3:7.1f} ms" if name in waits else ""
            print(f"  {name:<15} {seconds * 1e3:8.1f} ms   vs hf one process {ms['hf one process'] / seconds:5.2f}x{wait}")
        print(f"  overlap speed-up over no overlap: {ms['ep no overlap'] / ms['ep overlap']:.3f}x")
    dist.destroy_process_group()


def main() -> None:
    parser = common.parser(__doc__, world=2, tokens=2048, hidden=512, experts=8, top_k=2, ffn=512, repeats=5,
                           threads=(1, "torch threads per process"))
    args = parser.parse_args()
    common.spawn_ranks(rank_main, args, args.world)


if __name__ == "__main__":
    main()
