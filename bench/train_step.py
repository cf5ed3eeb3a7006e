"""One training step of a whole hybrid MoE model (about 100M parameters), adapted vs HuggingFace, fp32, CPU.

`--arch qwen3-next` (default): Qwen3-Next's architecture (3 Gated DeltaNet layers to 1 softmax layer, 16 experts
top-4 plus a gated shared expert). `--arch kimi-linear`: Kimi-Linear's (3 KDA layers to 1 MLA layer, 16 experts
top-4 plus a shared expert, first layer dense). Both at hidden 512, 8 layers, vocabulary 32,000. The adapter is
the one `onboard adapt` writes for the catalogue's full-size model (Qwen3-Next-80B-A3B, Kimi-Linear-48B-A3B):
the same code runs at any size, reading top-k and the rest from the model's config. A step is forward + backward + AdamW. Each variant runs in its own process, so its peak
resident memory (ru_maxrss less the memory held before the first step) is its own; times are medians over
repeats after one warm-up step. Loss and gradient norm of the first step are compared. Prints ratios against
the HuggingFace model measured in the same run; never passes or fails on time.

    python bench/train_step.py [--arch qwen3-next|kimi-linear] [--tokens 2048] [--batch 1] [--repeats 2] [--threads 2]
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

VOCAB = 32000
ARCHS = {  # model_type, catalogue entry whose adapter is used, and the ~100M size
    "qwen3-next": ("qwen3_next", "qwen3-next-80b-a3b", dict(
        hidden_size=512, num_hidden_layers=8, vocab_size=VOCAB, num_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=256, shared_expert_intermediate_size=256, intermediate_size=1024,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64, full_attention_interval=4)),
    "kimi-linear": ("kimi_linear", "kimi-linear-48b-a3b", dict(
        hidden_size=512, num_hidden_layers=8, vocab_size=VOCAB, num_experts=16, num_experts_per_token=4,
        moe_intermediate_size=256, num_shared_experts=1, intermediate_size=1024, num_attention_heads=8,
        num_key_value_heads=8, kv_lora_rank=128, q_lora_rank=None, qk_rope_head_dim=32, qk_nope_head_dim=64,
        v_head_dim=64, head_dim=64, linear_num_heads=8, linear_head_dim=64, routed_scaling_factor=2.446,
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        mlp_layer_types=["dense"] + ["sparse"] * 7, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def build_model(arch: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, _, size = ARCHS[arch]
    config = AutoConfig.for_model(model_type, **size, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():  # weights that keep activations in range for a fair comparison
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    return model


def run_variant(arch: str, variant: str, bundle: str | None, tokens: int, batch: int, repeats: int) -> dict:
    ftz = common.apply_child_ftz()
    model = build_model(arch)
    params = sum(p.numel() for p in model.parameters())
    if variant == "adapted":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from onboard.bundle.files import load_adapter

        load_adapter(Path(bundle)).adapt(model)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (batch, tokens), generator=gen)
    base = rss_bytes()
    times, first = [], None
    for step in range(repeats + 1):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 0:
            first = (float(loss), float(norm))
        else:
            times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base

    def forward_backward():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizer.zero_grad(set_to_none=True)
    made = common.subnormals(forward_backward) if not ftz else (None, "")
    return {"variant": variant, "params": params, "step_s": statistics.median(times), "peak_bytes": peak,
            "subnormals": made,
            "loss": first[0], "grad_norm": first[1]}


def main():
    parser = common.parser(__doc__, tokens=2048, batch=1, repeats=2, threads=2)
    common.add_ftz(parser)
    parser.add_argument("--arch", choices=sorted(ARCHS), default="qwen3-next", help="model architecture")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--bundle", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.variant:
        print(json.dumps(run_variant(args.arch, args.variant, args.bundle, args.tokens, args.batch, args.repeats)))
        return

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from onboard.bundle.make import adapt
    from onboard.source import resolve

    _, catalogue_name, _ = ARCHS[args.arch]
    with tempfile.TemporaryDirectory() as tmp:
        bundle = Path(tmp) / catalogue_name
        common.scratch_kernel_store(Path(tmp) / "kernels")
        _, verification = adapt(resolve(catalogue_name), bundle)
        print(f"adapter for {catalogue_name}: verification {'PASSED' if verification.passed else 'FAILED'}")
        results = {}
        for ftz in common.ftz_modes(args.ftz):
            for variant in ("hf", "adapted"):
                out = subprocess.run([sys.executable, __file__, "--arch", args.arch, "--variant", variant,
                                      "--bundle", str(bundle), "--tokens", str(args.tokens), "--batch", str(args.batch),
                                      "--repeats", str(args.repeats), "--threads", str(args.threads)],
                                     capture_output=True, text=True, check=True,
                                     env={**os.environ, **common.child_env(ftz)})
                results[ftz, variant] = json.loads(out.stdout.strip().splitlines()[-1])
    first = results[next(iter(results))]
    print(f"model: {args.arch} architecture, {first['params'] / 1e6:.1f}M parameters, {args.batch}x{args.tokens} tokens, "
          f"fp32, {args.threads} threads; step = forward + backward + AdamW; load average {os.getloadavg()[0]:.1f}")
    print(f"{'variant':<10} {'flush-to-zero':>13} {'step s':>9} {'peak MiB':>10} {'loss':>10} {'grad norm':>10}  subnormals")
    for (ftz, _), r in results.items():
        made = f"{r['subnormals'][0]} ({r['subnormals'][1]})" if not ftz else ""
        print(f"{r['variant']:<10} {'on' if ftz else 'off':>13} {r['step_s']:>9.2f} {r['peak_bytes'] / 2**20:>10.0f} "
              f"{r['loss']:>10.5f} {r['grad_norm']:>10.5f}  {made}")
    for ftz in common.ftz_modes(args.ftz):
        hf, ad = results[ftz, "hf"], results[ftz, "adapted"]
        print(f"adapted vs HF, {common.ftz_label(ftz)}: {hf['step_s'] / ad['step_s']:.2f}x faster, peak memory "
              f"{ad['peak_bytes'] / hf['peak_bytes']:.2f}x, loss differs by {abs(hf['loss'] - ad['loss']):.1e}")


if __name__ == "__main__":
    main()
