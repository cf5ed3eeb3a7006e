"""LM head + loss without full logits vs full logits + transformers' ForCausalLMLoss, fp32, forward + backward.

Each variant runs in its own process, so that one's freed memory cannot hide another's peak: the process
builds the inputs, resets its peak RSS (/proc/self/clear_refs), runs one forward + backward and reports the
peak RSS above what it held before the step, with the step's time. The full-logits run is the reference
(HF's loss on F.linear logits); ratios are against it, measured in the same run. It can need ~15 GiB at the
default size, so it runs under an address-space limit (default: MemAvailable less 2 GiB) and is reported
as not fitting rather than pushing the machine into the OOM killer. Never passes or fails on time. CPU seconds (all threads) are printed beside wall seconds: on a shared
machine they are the steadier measure of the work each variant does.

    python bench/loss.py [--tokens 8192] [--hidden 2048] [--vocab 151936] [--chunk-vocab 16384] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

import common  # bench/common.py: the benches' shared command line

VARIANTS = ("full logits + HF loss", "token chunks", "vocab chunks")


def _rss_peak_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def worker(args) -> None:
    from runtime.loss import lm_head_loss
    from transformers.loss.loss_utils import ForCausalLMLoss

    torch.set_num_threads(args.threads)
    ftz = common.apply_child_ftz()
    torch.manual_seed(0)
    hidden = torch.randn(1, args.tokens, args.hidden).requires_grad_()
    weight = torch.randn(args.vocab, args.hidden).mul_(args.hidden**-0.5).requires_grad_()
    labels = torch.randint(0, args.vocab, (1, args.tokens))
    labels[0, : args.tokens // 8] = -100  # a prompt that is not trained on

    def step():
        if args.worker == VARIANTS[0]:
            return ForCausalLMLoss(torch.nn.functional.linear(hidden, weight), labels, args.vocab)
        chunk_vocab = args.chunk_vocab if args.worker == VARIANTS[2] else None
        return lm_head_loss(hidden, weight, labels, chunk_tokens=args.chunk_tokens, chunk_vocab=chunk_vocab)

    before = _rss_kib()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS to the current RSS
    start, cpu_start = time.perf_counter(), time.process_time()
    loss = step()
    loss.backward()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    peak = _rss_peak_kib()
    made = (None, "")
    if not ftz:  # a second, counted pass (the timed one above is the first)
        hidden.grad = weight.grad = None
        made = common.subnormals(lambda: step().backward())
    print(json.dumps({"variant": args.worker, "subnormals": made, "seconds": seconds, "cpu_seconds": cpu_seconds, "peak_mib": (peak - before) / 1024,
                      "loss": loss.item(), "grad_hidden_norm": hidden.grad.norm().item(),
                      "grad_weight_norm": weight.grad.norm().item()}))


def mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def run_variant(variant: str, args, limit_bytes: int, ftz: bool) -> dict:
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    command = [sys.executable, __file__, "--worker", variant, *sys.argv[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), **common.child_env(ftz)}
    result = subprocess.run(command, check=False, capture_output=True, text=True, preexec_fn=cap, env=env)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        tail = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"variant": variant, "failed": f"exit {result.returncode}: {tail[:200]}"}
    return json.loads(lines[-1])


def main() -> None:
    parser = common.parser(__doc__, tokens=8192, hidden=2048, vocab=151936, chunk_vocab=16384, threads=2,
                           chunk_tokens=(None, "default: runtime.loss's automatic size"))
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of the variants")
    parser.add_argument("--limit-gib", type=float, default=None, help="address-space cap per variant process")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    common.add_ftz(parser)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    limit = int(args.limit_gib * 2**30) if args.limit_gib else mem_available_bytes() - 2 * 2**30
    full_gib = args.tokens * args.vocab * 4 / 2**30
    print(f"LM head + loss, fp32 fwd+bwd: {args.tokens} tokens, hidden {args.hidden}, vocab {args.vocab} "
          f"({full_gib:.2f} GiB of logits), {args.threads} threads, cap {limit / 2**30:.1f} GiB per process")
    for ftz in common.ftz_modes(args.ftz):
        print(f" {common.ftz_label(ftz)}:")
        report([run_variant(v, args, limit, ftz) for v in args.variants.split(",")])


def report(results: list[dict]) -> None:
    ref = next((r for r in results if r["variant"] == VARIANTS[0] and "failed" not in r), None)
    for r in results:
        if "failed" in r:
            print(f"  {r['variant']:<22} did not run: {r['failed']}")
            continue
        line = (f"  {r['variant']:<22} peak {r['peak_mib']:9.1f} MiB above inputs  {r['seconds']:8.2f} s "
                f"({r['cpu_seconds']:8.2f} CPU s)  loss {r['loss']:.6f}")
        if ref is not None and r is not ref:
            line += (f"  memory {r['peak_mib'] / ref['peak_mib']:.3f}x  time {r['seconds'] / ref['seconds']:.2f}x"
                     f" (CPU {r['cpu_seconds'] / ref['cpu_seconds']:.2f}x)"
                     f"  |dloss| {abs(r['loss'] - ref['loss']):.1e}"
                     f"  rel |grad h| {abs(r['grad_hidden_norm'] / ref['grad_hidden_norm'] - 1):.1e}"
                     f"  rel |grad W| {abs(r['grad_weight_norm'] / ref['grad_weight_norm'] - 1):.1e}")
        if r["subnormals"][0] is not None:
            line += f"  {r['subnormals'][0]} subnormal values made ({r['subnormals'][1]})"
        print(line)


if __name__ == "__main__":
    main()
