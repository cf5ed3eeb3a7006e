"""Chunked gated delta rule: the runtime against transformers' own PyTorch implementations, same run.

Gated DeltaNet (one decay per head) against qwen3_next's `torch_chunk_gated_delta_rule`, KDA (one decay per
key channel) against kimi_linear's `chunk_kimi_delta_attention`; forward + backward, fp32, q/k L2-normalised
in the kernel, gates drawn the way each model initialises them. Prints the median time of each, the ratio,
and the largest error of the output and of every input gradient relative to that tensor's largest value.

    python bench/linear_attention.py [--batch 2] [--tokens 2048] [--heads 8] [--dim 64] [--repeats 3]
"""

from __future__ import annotations

import functools
import os
import statistics
import time

import torch
import torch.nn.functional as F
from runtime.attention import chunk_gated_delta_rule
from transformers.models.kimi_linear import modeling_kimi_linear
from transformers.models.qwen3_next import modeling_qwen3_next

import common  # bench/common.py: the benches' shared command line


def inputs(kind: str, batch: int, tokens: int, heads: int, dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, tokens, heads, dim, generator=gen) for _ in range(3))
    beta = torch.sigmoid(torch.randn(batch, tokens, heads, generator=gen))
    if kind == "gdn":  # qwen3_next: A ~ U(0.01, 16) per head, dt_bias = 1
        a = torch.empty(heads).uniform_(0.01, 16, generator=gen)
        g = -a * F.softplus(torch.randn(batch, tokens, heads, generator=gen) * 0.5 + 1.0)
    else:  # kimi_linear: A ~ U(1, 16) per head, dt ~ logU(1e-3, 0.1) per channel
        a = torch.empty(heads, 1).uniform_(1, 16, generator=gen)
        dt = torch.empty(heads, dim).uniform_(-6.9, -2.3, generator=gen).exp()
        dt_bias = dt + torch.log(-torch.expm1(-dt))
        g = -a * F.softplus(torch.randn(batch, tokens, heads, dim, generator=gen) * 0.5 + dt_bias)
    return q, k, v, g, beta


def fwd_bwd(fn, tensors, weights, chunk):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    start, cpu = time.perf_counter(), time.process_time()
    out, _ = fn(*leaves[:3], g=leaves[3], beta=leaves[4], use_qk_l2norm_in_kernel=True, chunk_size=chunk)
    (out * weights).sum().backward()
    return (time.perf_counter() - start, time.process_time() - cpu), [out.detach(), *(t.grad for t in leaves)]


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def compare(kind: str, reference, args) -> None:
    tensors = inputs(kind, args.batch, args.tokens, args.heads, args.dim)
    weights = torch.randn(args.batch, args.tokens, args.heads, args.dim, generator=torch.Generator().manual_seed(1))
    chunks = {"runtime": args.chunk, "transformers": 64}  # 64: what transformers' modules ask for
    sides = (("runtime", chunk_gated_delta_rule), ("transformers", reference))
    modes = common.ftz_modes(args.ftz)
    runs = {name: functools.partial(fwd_bwd, fn, tensors, weights, chunks[name]) for name, fn in sides}
    rounds, last = common.alternate_modes(runs, modes, args.repeats)
    results = {name: out for name, (_, out) in last.items()}
    for ftz in modes:
        (ours, ours_cpu), (theirs, theirs_cpu) = (
            [statistics.median(seconds[i] for seconds, _ in rounds[ftz, n]) for i in (0, 1)]
            for n in ("runtime", "transformers"))
        print(f"{kind.upper()}, {common.ftz_label(ftz)}: runtime {ours * 1e3:.1f} ms (cpu {ours_cpu * 1e3:.1f} ms), "
              f"transformers {theirs * 1e3:.1f} ms (cpu {theirs_cpu * 1e3:.1f} ms): {theirs / ours:.1f}x wall, "
              f"{theirs_cpu / ours_cpu:.1f}x cpu")
    names = ["out", "dq", "dk", "dv", "dg", "dbeta"]
    errors = ", ".join(f"{n} {rel(a, b):.1e}" for n, a, b in zip(names, results["runtime"], results["transformers"]))
    print(f"     max rel err: {errors}")
    counts = {name: common.subnormals(run) for name, run in runs.items()}
    print("     subnormal values made (forward + backward): "
          + ", ".join(f"{name} {n} ({where})" for name, (n, where) in counts.items()))


def main() -> None:
    parser = common.parser(__doc__, batch=2, tokens=2048, heads=8, dim=64, repeats=3, threads=2,
                           chunk=(64, "the runtime's chunk length"))
    parser.add_argument("--only", choices=["gdn", "kda"], help="run one of the two cores")
    common.add_ftz(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"fp32, batch {args.batch}, {args.tokens} tokens, {args.heads} heads, head dim {args.dim}, "
          f"{args.threads} threads, forward + backward, median of {args.repeats}; runtime chunk {args.chunk}; "
          f"load average {os.getloadavg()[0]:.1f} (cpu: this process's CPU seconds, less sensitive to other load)")
    cases = {"gdn": modeling_qwen3_next.torch_chunk_gated_delta_rule,
             "kda": modeling_kimi_linear.chunk_kimi_delta_attention}
    for kind, reference in cases.items():
        if args.only in (None, kind):
            compare(kind, reference, args)


if __name__ == "__main__":
    main()
