"""MiniMax lightning attention: the runtime's scalar-decay scan against transformers' block loop, same run.

One `MiniMaxLightningAttention` layer (projections, scan, norm, output gate) built from a config, and a deep
copy of it swapped with `runtime.attention.swap_lightning_attention` (same parameters); forward + backward, fp32.
transformers writes the scan inline as a loop over blocks of `block_size` tokens with dense block x block
products; the runtime runs `chunk_constant_decay` (the decay is one constant per head). Prints median times, their ratio, and the largest error of the
output and of every parameter gradient relative to that tensor's largest value.

    python bench/lightning.py [--batch 2] [--tokens 2048] [--heads 8] [--dim 64] [--block 256] [--repeats 3]
                              [--hidden 8]   # small hidden: cheap projections, the scan is what is timed
"""

from __future__ import annotations

import copy
import functools
import statistics
import time

import torch
from runtime.attention import swap_lightning_attention
from transformers import AutoConfig
from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

import common  # bench/common.py: the benches' shared command line


def fwd_bwd(module, x, weights):
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    start = time.perf_counter()
    out = module(x, None, None)[0]
    (out * weights).sum().backward()
    grads = [x.grad] + [p.grad for p in module.parameters()]
    return time.perf_counter() - start, [out.detach(), *grads]


def main():
    parser = common.parser(__doc__, batch=2, tokens=2048, heads=8, dim=64, repeats=3,
                           block=(256, "transformers' block_size (MiniMax-Text-01: 256)"),
                           threads=(None, "torch threads (default: torch's own)"),
                           hidden=(None, "the layer's hidden size (default heads x dim; small: time the scan)"))
    common.add_ftz(parser)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # --hidden much smaller than heads x dim makes the projections (the same GEMMs on both sides) cheap, so
    # what is timed is the scan: transformers writes it inline in the layer's forward, so it cannot be called alone
    hidden = args.hidden or args.heads * args.dim
    config = AutoConfig.for_model("minimax", hidden_size=hidden, num_attention_heads=args.heads, head_dim=args.dim,
                                  num_hidden_layers=4, block_size=args.block)
    torch.manual_seed(0)
    reference = MiniMaxLightningAttention(config, layer_idx=1)
    runtime = copy.deepcopy(reference)
    swap_lightning_attention(runtime)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.tokens, hidden, generator=gen)
    weights = torch.randn(args.batch, args.tokens, hidden, generator=gen)
    sides = (("runtime", runtime), ("transformers", reference))
    print(f"lightning attention layer, hidden {hidden}, batch {args.batch}, {args.tokens} tokens, {args.heads} heads x {args.dim}, "
          f"block {args.block}, fp32, forward + backward, {torch.get_num_threads()} threads")
    modes = common.ftz_modes(args.ftz)
    runs = {name: functools.partial(fwd_bwd, module, x, weights) for name, module in sides}
    rounds, last = common.alternate_modes(runs, modes, args.repeats)
    results = {name: out for name, (_, out) in last.items()}
    for ftz in modes:
        rt, hf = (statistics.median(seconds for seconds, _ in rounds[ftz, n]) for n in ("runtime", "transformers"))
        print(f"{common.ftz_label(ftz)}: runtime {rt * 1e3:.0f} ms, transformers {hf * 1e3:.0f} ms: {hf / rt:.2f}x faster")
    errors = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(results["runtime"], results["transformers"])]
    print(f"max relative error output {errors[0]:.1e}, gradients {max(errors[1:]):.1e}")
    counts = {name: common.subnormals(run) for name, run in runs.items()}
    print("subnormal values made (forward + backward): "
          + ", ".join(f"{name} {n} ({where})" for name, (n, where) in counts.items()))


if __name__ == "__main__":
    main()
