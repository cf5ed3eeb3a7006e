"""DSA attention layer, runtime vs transformers (its indexer + eager masked attention), forward + backward, fp32, CPU.

One DeepSeek-V3.2 attention layer (MLA projections, lightning indexer, top-k sparse softmax) at 8192 tokens with
top-2048 keys. Each variant runs in its own process so that its peak resident memory (ru_maxrss, less the memory
held just before the first step) is its own; times are medians over repeats; the outputs and input gradients of
the two are compared. Prints ratios against the HuggingFace reference measured in the same run; never passes or
fails on time.

    python bench/sparse_attention.py [--tokens 8192] [--top-k 2048] [--heads 4] [--index-heads 4] [--repeats 3]

Defaults fit this machine's ~20 GB shared memory: 4 heads (transformers' eager attention holds several
(heads, T, T) fp32 tensors at once). Figures as measured: the README's Benchmarks table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import common  # bench/common.py: the benches' shared command line


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def build(args):
    from transformers import DeepseekV32Config
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
        DeepseekV32Attention,
        DeepseekV32RotaryEmbedding,
    )

    config = DeepseekV32Config(
        hidden_size=args.hidden, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        q_lora_rank=args.q_lora, kv_lora_rank=args.kv_lora, qk_nope_head_dim=args.qk_nope,
        qk_rope_head_dim=args.qk_rope, v_head_dim=args.v_dim, index_n_heads=args.index_heads,
        index_head_dim=args.index_dim, index_topk=args.top_k, max_position_embeddings=args.tokens,
        attn_implementation="eager")
    torch.manual_seed(0)
    layer = DeepseekV32Attention(config, layer_idx=0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.05) if p.dim() > 1 else p.fill_(1.0)
    return config, layer, DeepseekV32RotaryEmbedding(config)


def child(args) -> None:
    """Run one variant; write its numbers (and its outputs, for the comparison) under args.out."""
    from transformers.masking_utils import create_causal_mask

    torch.set_num_threads(args.threads)
    ftz = common.apply_child_ftz()
    config, layer, rotary = build(args)
    if args.variant == "runtime":
        from runtime.attention.dsa import swap_sparse_attention

        swap = swap_sparse_attention(layer)
    x = (torch.randn(1, args.tokens, args.hidden, generator=torch.Generator().manual_seed(1)) * 0.5).requires_grad_()
    positions = torch.arange(args.tokens)[None]

    def step():
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        mask = create_causal_mask(config=config, inputs_embeds=x, attention_mask=None, cache=None,
                                  position_ids=positions, allow_is_causal_skip=False)
        out, _ = layer(x, position_embeddings=rotary(x, positions), attention_mask=mask, position_ids=positions)
        out.pow(2).mean().backward()
        return out.detach()

    before = rss_bytes()
    start = time.perf_counter()
    out = step()
    first = time.perf_counter() - start
    peak = peak_bytes() - before
    torch.save({"out": out, "dx": x.grad, "dq_b": layer.q_b_proj.weight.grad}, Path(args.out) / f"{args.variant}.pt")
    times = [first]
    for _ in range(args.repeats - 1):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    result = {"peak": peak, "seconds": statistics.median(times), "subnormals": common.subnormals(step) if not ftz else None}
    if args.variant == "runtime":
        result["calls"] = dict(swap.calls)
    (Path(args.out) / f"{args.variant}.json").write_text(json.dumps(result))


def main() -> None:
    parser = common.parser(__doc__, tokens=8192, top_k=2048, hidden=512, heads=4, q_lora=256, kv_lora=128,
                           qk_nope=64, qk_rope=32, v_dim=64, index_heads=4, index_dim=64, repeats=3,
                           threads=(torch.get_num_threads(), "torch threads"))
    parser.add_argument("--variant", choices=["hf", "runtime"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    common.add_ftz(parser)
    args = parser.parse_args()
    if args.variant:
        child(args)
        return

    runs = {}
    for ftz in common.ftz_modes(args.ftz):
        with tempfile.TemporaryDirectory() as tmp:
            results = {}
            for variant in ("hf", "runtime"):
                cmd = [sys.executable, __file__, *sys.argv[1:], "--variant", variant, "--out", tmp]
                done = subprocess.run(cmd, capture_output=True, text=True, check=False,
                                      env={**os.environ, **common.child_env(ftz)})
                if done.returncode:
                    sys.exit(f"{variant} run failed:\n{done.stderr[-2000:]}")
                results[variant] = json.loads((Path(tmp) / f"{variant}.json").read_text())
            hf, ours = (torch.load(Path(tmp) / f"{v}.pt") for v in ("hf", "runtime"))
        runs[ftz] = results

    def rel(name):
        return ((ours[name] - hf[name]).abs().max() / hf[name].abs().max()).item()

    print(f"DSA attention layer fwd+bwd, fp32, {args.tokens} tokens, index top-{args.top_k}, {args.heads} heads "
          f"(MLA: q rank {args.q_lora}, kv rank {args.kv_lora}, qk {args.qk_nope}+{args.qk_rope}, v {args.v_dim}), "
          f"indexer {args.index_heads}x{args.index_dim}, hidden {args.hidden}, {args.threads} threads")
    print(f"  max |diff| / max |HF|: output {rel('out'):.1e}, input grad {rel('dx'):.1e}, "
          f"q_b_proj grad {rel('dq_b'):.1e}; runtime calls {results['runtime']['calls']}")
    for ftz, results in runs.items():
        for name, r in results.items():
            made = f"; {r['subnormals'][0]} subnormal values made ({r['subnormals'][1]})" if r["subnormals"] else ""
            print(f"  {name:<8} {common.ftz_label(ftz)}: peak {r['peak'] / 2**20:8.0f} MiB "
                  f"({r['peak'] / results['hf']['peak']:6.1%} of HF)  {r['seconds']:7.2f} s  time ratio vs HF "
                  f"{r['seconds'] / results['hf']['seconds']:5.2f}x{made}")


if __name__ == "__main__":
    main()
