"""Selective scan (Mamba1, Jamba's d_state 16): the runtime against transformers' `mamba_selective_scan`, same run.

Forward + backward, fp32, called the way Jamba's mixer calls it (D skip, z gate, delta_bias, softplus), inputs
drawn the way Jamba initialises them (A = -[1..N] per channel, dt bias the inverse softplus of logU(1e-3, 0.1)).
Each implementation runs in its own process, so that one's freed memory cannot hide another's peak: the process
builds the inputs, resets its peak RSS (/proc/self/clear_refs), runs forward + backward and reports the peak RSS
above what it held before, the median wall and CPU seconds, and saves its output, last state and every input
gradient; the parent prints the ratios and the largest error of each relative to that tensor's largest value
in transformers' result. transformers' backward grows quadratically with the tokens (autograd turns every
token's slice of its (batch, D, T, N) tensors into a full-size gradient), about 10 minutes of one core at the
default size, so it runs `--reference-repeats` times (default 1). Never passes or fails on time.
Figures as measured: the README's Benchmarks table.

    python bench/selective_scan.py [--batch 2] [--tokens 2048] [--d-inner 1024] [--d-state 16] [--threads 2]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import torch

import common  # bench/common.py: the benches' shared command line

NAMES = ["x", "dt", "A", "B", "C", "D", "z", "delta_bias"]


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def inputs(batch: int, tokens: int, d_inner: int, d_state: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x, z = (torch.randn(batch, d_inner, tokens, generator=gen) for _ in range(2))
    dt = torch.randn(batch, d_inner, tokens, generator=gen) * 0.5
    A = -torch.arange(1, d_state + 1, dtype=torch.float32).repeat(d_inner, 1)
    B, C = (torch.randn(batch, d_state, tokens, generator=gen) for _ in range(2))
    D = torch.ones(d_inner)
    dt0 = torch.empty(d_inner).uniform_(-6.9, -2.3, generator=gen).exp()
    delta_bias = dt0 + torch.log(-torch.expm1(-dt0))
    return [x, dt, A, B, C, D, z, delta_bias]


def worker(args) -> None:
    from runtime.attention.selective_scan import selective_scan
    from transformers.models.jamba.modeling_jamba import mamba_selective_scan

    torch.set_num_threads(args.threads)
    ftz = common.apply_child_ftz()
    fn, repeats = ((mamba_selective_scan, args.reference_repeats) if args.worker == "transformers"
                   else (selective_scan, args.repeats))
    tensors = inputs(args.batch, args.tokens, args.d_inner, args.d_state)
    gen = torch.Generator().manual_seed(1)
    weights = torch.randn(args.batch, args.d_inner, args.tokens, generator=gen)
    state_weights = torch.randn(args.batch, args.d_inner, args.d_state, generator=gen)

    def step():
        leaves = [t.clone().requires_grad_() for t in tensors]
        y, last = fn(*leaves[:5], D=leaves[5], z=leaves[6], delta_bias=leaves[7], delta_softplus=True,
                     return_last_state=True)
        ((y * weights).sum() + (last * state_weights).sum()).backward()
        return [y.detach(), last.detach(), *(t.grad for t in leaves)]

    small = inputs(args.batch, 32, args.d_inner, args.d_state)  # warm-up at 32 tokens
    fn(*[t.requires_grad_() for t in small[:5]], D=small[5], z=small[6], delta_bias=small[7],
       delta_softplus=True).sum().backward()
    before = _status_kib("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS to the current RSS
    times, results = [], None
    for _ in range(max(1, repeats)):
        results = None  # free the last run's tensors before the next
        start, cpu = time.perf_counter(), time.process_time()
        results = step()
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    peak = _status_kib("VmHWM:") - before
    made = common.subnormals(step) if not ftz and args.worker == "runtime" else (None, "")
    torch.save(results, args.out)
    print(json.dumps({"subnormals": made, "seconds": statistics.median(t[0] for t in times),
                      "cpu_seconds": statistics.median(t[1] for t in times), "peak_mib": peak / 1024}))


def run(name: str, args, folder: str, ftz: bool = False) -> dict:
    out = os.path.join(folder, f"{name}.pt")
    result = common.run_child(__file__, ["--worker", name, "--out", out, *sys.argv[1:]], args.threads, name,
                              env=common.child_env(ftz))
    return {**result, "results": torch.load(out)}


def main() -> None:
    parser = common.parser(__doc__, children=("runtime", "transformers"), batch=2, tokens=2048, d_inner=1024,
                           d_state=16, threads=2, repeats=(3, "timed runs of the runtime (median)"),
                           reference_repeats=(1, "timed runs of transformers (median)"))
    common.add_ftz(parser)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    print(f"fp32, batch {args.batch}, {args.tokens} tokens, d_inner {args.d_inner}, d_state {args.d_state}, "
          f"{args.threads} threads, forward + backward (D, z, delta_bias, softplus, last state); load average "
          f"{os.getloadavg()[0]:.1f} (cpu: the process's CPU seconds, less sensitive to other load)")
    with tempfile.TemporaryDirectory() as folder:
        for ftz in common.ftz_modes(args.ftz):  # transformers' sequential loop is slow: timed with flush-to-zero off
            ours = run("runtime", args, folder, ftz)
            made = f"; {ours['subnormals'][0]} subnormal values made ({ours['subnormals'][1]})" if not ftz else ""
            print(f"runtime, {common.ftz_label(ftz)}: {ours['seconds']:.2f} s (cpu {ours['cpu_seconds']:.2f} s){made}")
            if not ftz:
                off = ours
        ours = off if args.ftz != "on" else ours
        theirs = run("transformers", args, folder)
    names = ["y", "last state", *(f"d{n}" for n in NAMES)]
    errors = ", ".join(f"{n} {float((a - b).abs().max() / b.abs().max()):.1e}"
                       for n, a, b in zip(names, ours["results"], theirs["results"]))
    print(f"runtime {ours['seconds']:.2f} s (cpu {ours['cpu_seconds']:.2f} s, median of {args.repeats}), "
          f"peak {ours['peak_mib']:.0f} MiB above inputs\n"
          f"transformers {theirs['seconds']:.2f} s (cpu {theirs['cpu_seconds']:.2f} s, median of "
          f"{args.reference_repeats}), peak {theirs['peak_mib']:.0f} MiB above inputs\n"
          f"time {theirs['seconds'] / ours['seconds']:.1f}x faster wall, "
          f"{theirs['cpu_seconds'] / ours['cpu_seconds']:.1f}x cpu; peak memory "
          f"{ours['peak_mib'] / theirs['peak_mib']:.3f}x of transformers'\nmax rel err: {errors}")


if __name__ == "__main__":
    main()
