"""Mamba2 SSD chunk scan: the runtime's `ssd_chunk_scan` against transformers' `mamba2_chunk_scan`, same run.

Forward + backward, fp32, inputs drawn the way Mamba2 initialises them (A = -exp(A_log), A ~ U(1, 16); dt
through softplus with dt_bias from dt ~ logU(1e-3, 0.1)). transformers' side is nemotron_h's copy of the
fallback (identical in mamba2, bamba, falcon_h1, granitemoehybrid, zamba2), at the caller's chunk (256, the
default of every Mamba2 config but nemotron_h's 128). Each side runs in its own process, so that one's freed
memory cannot hide the other's peak: the process builds the inputs, resets its peak RSS
(/proc/self/clear_refs), runs one forward + backward and takes the peak RSS above what it held before as the
step's memory; then it times `--repeats` more steps (median). The parent compares outputs, final states and
every input gradient (largest error relative to the reference tensor's largest value). Never passes or fails
on time; CPU seconds are printed beside wall seconds (steadier on a shared machine).

Figures as measured: the README's Benchmarks table. The runtime core's chunk of 64 beat 32 and 128 (1.15 / 1.21 s).

    python bench/ssm.py [--batch 2] [--tokens 2048] [--heads 32] [--head-dim 64] [--state 128] [--groups 1]
                        [--chunk 256] [--core-chunk 64] [--threads 2] [--repeats 3]
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

SIDES = ("runtime", "transformers")
NAMES = ("hidden_states", "dt", "A", "B", "C", "D", "dt_bias", "initial_states")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def inputs(args, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    b, t, h, p, g, n = args.batch, args.tokens, args.heads, args.head_dim, args.groups, args.state
    dt0 = torch.empty(h).uniform_(-6.9, -2.3, generator=gen).exp()
    return {"hidden_states": torch.randn(b, t, h, p, generator=gen),
            "dt": torch.randn(b, t, h, generator=gen) * 0.5,
            "A": -torch.empty(h).uniform_(1, 16, generator=gen),
            "B": torch.randn(b, t, g, n, generator=gen) * n**-0.5,
            "C": torch.randn(b, t, g, n, generator=gen) * n**-0.5,
            "D": torch.ones(h),
            "dt_bias": dt0 + torch.log(-torch.expm1(-dt0)),
            "initial_states": torch.randn(b, h, p, n, generator=gen) * 0.1}


def worker(args) -> None:
    import runtime.attention.ssd as ssd
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan

    torch.set_num_threads(args.threads)
    ftz = common.apply_child_ftz()
    ssd.CORE_CHUNK = args.core_chunk
    fn = ssd.ssd_chunk_scan if args.worker == "runtime" else mamba2_chunk_scan
    tensors = inputs(args)
    gen = torch.Generator().manual_seed(1)
    w_y = torch.randn(args.batch, args.tokens, args.heads, args.head_dim, generator=gen)
    w_s = torch.randn(args.batch, args.heads, args.head_dim, args.state, generator=gen)

    def step():
        leaves = {n: t.clone().requires_grad_() for n, t in tensors.items()}
        y, final = fn(*(leaves[n] for n in NAMES[:5]), args.chunk, D=leaves["D"], dt_bias=leaves["dt_bias"],
                      initial_states=leaves["initial_states"], dt_softplus=True, return_final_states=True)
        ((y * w_y).sum() + (final * w_s).sum()).backward()
        return [y.detach(), final.detach(), *(leaves[n].grad for n in NAMES)]

    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # peak RSS := current RSS
    results = step()
    peak_mib = (_status_kib("VmHWM") - before) / 1024
    made = common.subnormals(step) if not ftz else (None, "")
    times = []
    for _ in range(args.repeats):
        start, cpu = time.perf_counter(), time.process_time()
        step()
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    torch.save(results, args.out)
    torch.set_flush_denormal(ftz)
    print(json.dumps({"side": args.worker, "peak_mib": peak_mib, "subnormals": made,
                      "seconds": statistics.median(t[0] for t in times),
                      "cpu_seconds": statistics.median(t[1] for t in times)}))


def run_side(side: str, args, out: str, ftz: bool) -> dict:
    return common.run_child(__file__, ["--worker", side, "--out", out, *sys.argv[1:]], args.threads, side,
                            env=common.child_env(ftz))


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def main() -> None:
    parser = common.parser(__doc__, children=SIDES, batch=2, tokens=2048, heads=32, head_dim=64, state=128,
                           groups=1, threads=2, repeats=3, chunk=(256, "the caller's chunk (transformers uses it)"),
                           core_chunk=(64, "the runtime core's own chunk length"))
    common.add_ftz(parser)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    print(f"SSD chunk scan, fp32 forward + backward: batch {args.batch}, {args.tokens} tokens, {args.heads} heads "
          f"x {args.head_dim}, state {args.state}, {args.groups} group(s), chunk {args.chunk} (runtime core "
          f"{args.core_chunk}), {args.threads} threads, median of {args.repeats}; load average "
          f"{os.getloadavg()[0]:.1f}")
    for ftz in common.ftz_modes(args.ftz):
        with tempfile.TemporaryDirectory() as tmp:
            runs, outs = {}, {}
            for side in SIDES:
                runs[side] = run_side(side, args, os.path.join(tmp, side), ftz)
                outs[side] = torch.load(os.path.join(tmp, side))
        print(f" {common.ftz_label(ftz)}:")
        for side in SIDES:
            r = runs[side]
            made = f"; {r['subnormals'][0]} subnormal values made ({r['subnormals'][1]})" if not ftz else ""
            print(f"  {side:<12} {r['seconds'] * 1e3:8.1f} ms (cpu {r['cpu_seconds'] * 1e3:8.1f} ms)  "
                  f"peak {r['peak_mib']:8.1f} MiB above inputs{made}")
        ours, theirs = runs["runtime"], runs["transformers"]
        print(f"  runtime / transformers: time {ours['seconds'] / theirs['seconds']:.3f}x "
              f"(cpu {ours['cpu_seconds'] / theirs['cpu_seconds']:.3f}x), "
              f"peak memory {ours['peak_mib'] / theirs['peak_mib']:.3f}x")
    names = ("y", "final", *(f"d{n}" for n in NAMES))
    errors = ", ".join(f"{n} {rel(a, b):.1e}" for n, a, b in zip(names, outs["runtime"], outs["transformers"]))
    print(f"  max rel err: {errors}")


if __name__ == "__main__":
    main()
