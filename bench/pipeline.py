"""Pipeline bubble: measured 1F1B / GPipe steps against the planner's prediction (gloo, CPU processes).

A transformers Qwen3 causal LM (`--layers` layers) is cut into `--world` stages by runtime.parallel (pp = world,
one process per stage) and trained with runtime.parallel.pipeline.Pipeline for each micro-batch count. Per count:

  step        the slowest rank's median step time (forward and backward of every micro-batch, P2P included)
  stage       the slowest stage's compute per micro-batch: its forward and backward of each micro-batch, timed
              inside the schedule (between its waits for the neighbouring stages), over the count
  bubble      measured: 1 - micro-batches x stage / step, the share of the step the slowest stage was not
              computing (idle, or waiting on a send); predicted: (pp - 1) / (m + pp - 1), what predictors.pipeline
              and the cost model charge for the same layout and count

Never passes or fails on time.

    python bench/pipeline.py [--world 2] [--layers 8] [--hidden 256] [--tokens 256] [--micro 2,4,8,16]
                             [--schedule 1f1b] [--repeats 5]
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
from predictors.pipeline import bubble_fraction
from runtime.parallel import build_mesh, parallelize
from runtime.parallel.pipeline import Pipeline
from runtime.plan import Plan
from transformers import AutoConfig, AutoModelForCausalLM

import common  # bench/common.py: the benches' shared command line


def model(args) -> torch.nn.Module:
    config = AutoConfig.for_model("qwen3", hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                                  num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=args.hidden // 4, vocab_size=2048, tie_word_embeddings=False)
    torch.manual_seed(0)  # the same weights on every rank
    return AutoModelForCausalLM.from_config(config).float().train()


def timed(pipe: Pipeline) -> list[float]:
    """Wrap the stage's forward and backward of each micro-batch (what the schedule calls between waits for its
    neighbours) so that the seconds they compute add up in the returned one-element list."""
    busy = [0.0]
    (stage,) = pipe.pipe_stages.values()  # made by the warm-up step
    for name in ("forward_one_chunk", "backward_one_chunk"):
        inner = getattr(stage, name)

        def wrapped(*a, inner=inner, **k):
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                busy[0] += time.perf_counter() - start
        setattr(stage, name, wrapped)
    return busy


def rank_main(rank: int, args, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    gen = torch.Generator().manual_seed(1)
    rows = []
    for micro in args.micro:
        plan = Plan(pp=args.world, grad_accum=micro, micro_batch=1, seq_len=args.tokens, dtype="fp32",
                    pp_schedule=args.schedule)
        m = parallelize(model(args), plan, build_mesh(plan))
        pipe = Pipeline(m, plan, build_mesh(plan), torch.device("cpu"))
        batches = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 2048, (micro, 1, args.tokens),
                                                                              generator=gen)]
        pipe.step(batches)  # warm-up (it also makes the schedule)
        m.zero_grad(set_to_none=True)
        busy = timed(pipe)
        steps, computing = [], []
        for _ in range(args.repeats):
            dist.barrier()
            busy[0] = 0.0
            start = time.perf_counter()
            pipe.step(batches)
            steps.append(time.perf_counter() - start)
            computing.append(busy[0])
            m.zero_grad(set_to_none=True)
        figures = torch.tensor([statistics.median(steps), statistics.median(computing)])
        dist.all_reduce(figures, op=dist.ReduceOp.MAX)  # the slowest rank sets the step, the slowest stage the pace
        step_s, stage_s = figures.tolist()
        rows.append((micro, step_s, stage_s / micro, 1 - stage_s / step_s, bubble_fraction(args.world, micro)))
    if rank == 0:
        print(f"pipeline {args.schedule}, pp={args.world} (gloo, {args.threads} thread(s) per stage), qwen3 "
              f"{args.layers} layers x hidden {args.hidden}, {args.tokens} tokens per micro-batch, fp32")
        print(f"  {'micro':>5} {'step ms':>9} {'stage ms':>9} {'bubble measured':>16} {'predicted':>10}")
        for micro, step_s, stage_s, measured, predicted in rows:
            print(f"  {micro:>5} {step_s * 1e3:9.1f} {stage_s * 1e3:9.1f} {measured:16.1%} {predicted:10.1%}")
    dist.destroy_process_group()


def main() -> None:
    parser = common.parser(__doc__, world=2, layers=8, hidden=256, tokens=256, repeats=5,
                           threads=(1, "torch threads per process"))
    parser.add_argument("--micro", default="2,4,8,16", help="micro-batch counts per step, comma-separated")
    parser.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"), help="the pipeline schedule")
    args = parser.parse_args()
    try:
        args.micro = [common.count(m) for m in args.micro.split(",")]
    except Exception:  # noqa: BLE001 - argparse's own message for a bad count
        parser.error(f"--micro takes whole numbers separated by commas, got {args.micro!r}")
    common.spawn_ranks(rank_main, args, args.world)


if __name__ == "__main__":
    main()
