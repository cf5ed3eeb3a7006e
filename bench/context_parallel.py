"""Context parallelism against one process: peak memory per rank and step time (gloo, CPU).

Cores: one long sequence goes through an attention core forward and backward: softmax (causal, over all-gathered
keys and values) or the gated delta rule (Gated DeltaNet, states carried), fp32. At cp 1 one process runs the whole
sequence (`runtime.attention`'s own cores); at cp 2 two processes (gloo, one thread each) run zig-zag halves through
`runtime.parallel.context`.

Models (`--model`, a committed bundle's adapted twin, `--width` times wider): one sequence through the whole model's
training loss, forward and backward; at cp 2 each rank runs its zig-zag half through `runtime.parallel.
context_split` (the weights whole on each rank: what is measured is what a step allocates, the activations).

Each variant runs in fresh processes; a rank's peak memory is its resident set's high-water mark over the steps
after a warm-up (reset through /proc/self/clear_refs), minus what it held before them: what a step allocates on top
of the inputs, weights and gradients. Prints the ratios cp 2 / cp 1. Never passes or fails on time.

    python bench/context_parallel.py [--tokens 16384] [--heads 4] [--dim 64] [--repeats 3]
    python bench/context_parallel.py --model qwen3-next-80b-a3b [--width 2] [--tokens 16384]
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import common  # bench/common.py: the benches' shared command line

CORES = ("softmax", "gated_delta")
ROOT = Path(__file__).resolve().parents[1]
MODELS = {"qwen3-30b-a3b", "qwen3-next-80b-a3b", "kimi-linear-48b-a3b", "deepseek-v3.2", "onboard-flagship-2.8t"}
REMOTE_CODE = {"onboard-flagship-2.8t"}  # the catalogue's own modeling code
STEP: dict = {}  # what the last model step measured: the bytes autograd saved for its backward


def _status(field: str) -> int:
    """A /proc/self/status memory figure in bytes (VmRSS: resident now; VmHWM: its high-water mark)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise SystemExit(f"no {field} in /proc/self/status: this bench reads Linux's memory accounting")


def _reset_high_water() -> None:
    """Start VmHWM again from the resident set now (Linux: writing 5 to clear_refs), so the mark is the step's."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(core: str, tokens: int, heads: int, dim: int):
    gen = torch.Generator().manual_seed(0)
    if core == "softmax":
        shape = (1, heads, tokens, dim)
        return [torch.randn(shape, generator=gen) for _ in range(3)]
    q, k = (torch.randn(1, tokens, heads, dim, generator=gen) for _ in range(2))
    v = torch.randn(1, tokens, heads, dim, generator=gen)
    g = -torch.rand(1, tokens, heads, generator=gen) * 0.1
    beta = torch.rand(1, tokens, heads, generator=gen)
    return [q, k, v, g, beta]


def _core_step(core: str, parts, cp: int, rank: int):
    from runtime.attention.gated_delta import chunk_gated_delta_rule
    from runtime.parallel.context import context_parallel_attention, context_parallel_gated_delta, zigzag

    seq = 2 if core == "softmax" else 1
    tokens = parts[0].shape[seq]
    if cp == 1:
        mine = [x.clone().requires_grad_(True) for x in parts]
        if core == "softmax":
            out = torch.nn.functional.scaled_dot_product_attention(*mine, is_causal=True)
        else:
            out, _ = chunk_gated_delta_rule(*mine, use_qk_l2norm_in_kernel=True)
    else:
        import torch.distributed as dist

        segments = sorted(zigzag(cp)[rank])
        per = tokens // (2 * cp)
        positions = torch.cat([torch.arange(s * per, (s + 1) * per) for s in segments])
        mine = [x.index_select(seq, positions).clone().requires_grad_(True) for x in parts]
        if core == "softmax":
            out = context_parallel_attention(*mine, group=dist.group.WORLD, positions=positions)
        else:
            out = context_parallel_gated_delta(*mine, group=dist.group.WORLD, segments=segments,
                                               n_segments=2 * cp, use_qk_l2norm_in_kernel=True)
    out.float().pow(2).mean().backward()


def _model_step(args, cp: int):
    """The step of a bundle's adapted twin: its training loss over one sequence (this rank's half at cp 2)."""
    from onboard.train.model import build_model
    from runtime.parallel.context_split import prepare, split_inputs
    from runtime.sequence_split import running

    torch.manual_seed(0)
    bundle = ROOT / "bundles" / args.model
    model, _ = build_model(bundle, width=args.width, trust_remote_code=args.model in REMOTE_CODE)
    ids = torch.randint(3, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    group = None
    if cp > 1:
        import torch.distributed as dist

        prepare(model)
        group = dist.group.WORLD

    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def step():
        split, inputs = split_inputs({"input_ids": ids, "labels": ids}, group)
        saved = {}

        def pack(t):  # every storage autograd keeps for the backward, once; the weights are not activations
            where = t.untyped_storage().data_ptr()
            if where not in weights:
                saved[where] = t.untyped_storage().nbytes()
            return t

        with running(split):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = model(**inputs, use_cache=False).loss
            STEP["saved"] = sum(saved.values())
            loss.backward()

    return step


def worker(args) -> None:
    """One rank: the step `repeats` times after a warm-up; prints a JSON line of its peak bytes and step times."""
    torch.set_num_threads(1)
    cp = args.cp
    if cp > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    rank = int(os.environ.get("RANK", 0))
    if args.model:
        step = _model_step(args, cp)
    else:
        parts = _inputs(args.core, args.tokens, args.heads, args.dim)

        def step():
            _core_step(args.core, parts, cp, rank)

    step()  # warm-up: the allocator's pools, the kernels' first calls, the gradients
    before = _status("VmRSS")
    _reset_high_water()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    print(json.dumps({"peak": _status("VmHWM") - before, "seconds": statistics.median(times), **STEP}))


def run(core: str | None, cp: int, args) -> dict:
    """The variant's ranks in fresh processes (a core's, or with `core` None the model's); the busiest rank's peak
    and the slowest rank's time."""
    port = _free_port()
    what = ["--core", core] if core else ["--model", args.model, "--width", str(args.width)]
    procs = []
    for rank in range(cp):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": str(cp),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", *what, "--cp", str(cp),
                                       "--tokens", str(args.tokens), "--heads", str(args.heads), "--dim",
                                       str(args.dim), "--repeats", str(args.repeats)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if p.returncode or not lines:
            raise SystemExit(f"{core or args.model} at cp {cp} failed (exit {p.returncode}): {err.strip()[-2000:]}")
        results.append(json.loads(lines[-1]))
    return {key: max(r[key] for r in results) for key in results[0]}


def main() -> None:
    parser = common.parser(__doc__, tokens=16384, heads=4, dim=64, repeats=3, cp=(1, "context-parallel degree"))
    parser.add_argument("--worker", action="store_true", help=argparse_hidden())
    parser.add_argument("--core", choices=CORES, default=None, help="one core only (default: both)")
    parser.add_argument("--model", choices=sorted(MODELS), default=None,
                        help="a committed bundle's adapted twin through its training loss instead of the cores")
    parser.add_argument("--width", type=int, default=1, help="with --model: the twin this many times wider")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.model:
        print(f"{args.model}'s twin x{args.width} wide, one sequence of {args.tokens} tokens, fp32, training loss "
              f"forward + backward; cp 2: two gloo processes of one thread, zig-zag halves")
        variants = [None]
    else:
        print(f"one sequence of {args.tokens} tokens, {args.heads} heads of {args.dim}, fp32, forward + backward; "
              f"cp 2: two gloo processes of one thread, zig-zag halves")
        variants = [args.core] if args.core else list(CORES)
    for core in variants:
        one, two = run(core, 1, args), run(core, 2, args)
        print(f"  {core or 'model':<12} cp 1: {one['peak'] / 2**20:8.1f} MiB {one['seconds']:7.3f} s   cp 2 (per "
              f"rank): {two['peak'] / 2**20:8.1f} MiB {two['seconds']:7.3f} s   memory x{two['peak'] / one['peak']:.2f}"
              f", time x{two['seconds'] / one['seconds']:.2f}")
        if "saved" in one:  # deterministic: what autograd keeps, counted, not the allocator's high-water mark
            print(f"  {'':<12} activations saved for the backward: cp 1 {one['saved'] / 2**20:.1f} MiB, cp 2 "
                  f"{two['saved'] / 2**20:.1f} MiB per rank (busiest): x{two['saved'] / one['saved']:.2f}")


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
