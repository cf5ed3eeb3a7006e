"""The agent's generated modules against the HuggingFace modules they replace: forward + backward, same run.

For each generated module of each bundle (by default: `onboard agent`'s rules policy on DeepSeek-V4, HY-V4, ZAYA
and Inkling2, and the recorded llm sessions of tests/agent/sessions replayed on AXK2 and LongCat-Flash, all
into a scratch folder), the model is built at the bundle twin's config made `--width` times wider (more heads of
the same size, wider MLPs), one forward records the module's real inputs at `--tokens` tokens, and the module and
its replacement (on a copy of the same parameters) are timed alternately, fp32, forward + backward with the same
output weights. Prints median times, the ratio (above 1: the replacement is faster) and the largest error of
the outputs and input gradients relative to each tensor's largest value.

    python bench/generated_ops.py [BUNDLE ...] [--width 16] [--tokens 2048] [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import common  # bench/common.py: the benches' shared command line

REPO = Path(__file__).resolve().parents[1]
RULES = ("deepseek_v4", "hy_v4", "zaya", "inkling2_text")
SESSIONS = ("axk2", "longcat_flash")


def default_bundles(scratch: Path) -> list[Path]:
    from onboard.agent.loop import run
    from onboard.families import default_config
    from onboard.source import resolve

    bundles = []
    for family in RULES + SESSIONS:
        default_config(family).save_pretrained(scratch / "models" / family)
        replay = REPO / "tests" / "agent" / "sessions" / f"{family}.jsonl" if family in SESSIONS else None
        run(resolve(str(scratch / "models" / family)), scratch / family, replay=replay)
        bundles.append(scratch / family)
    return bundles


def _floats(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, tuple | list):
        return [t for v in value for t in _floats(v)]
    return []


def fwd_bwd(module, args, kwargs, weights):
    module.zero_grad(set_to_none=True)
    leaves = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
              for a in args]
    start = time.perf_counter()
    outs = _floats(module(*leaves, **kwargs))
    sum((o * w).sum() for o, w in zip(outs, weights)).backward()
    seconds = time.perf_counter() - start
    return seconds, [o.detach() for o in outs] + [a.grad for a in leaves if isinstance(a, torch.Tensor) and
                                                  a.grad is not None]


def bench_bundle(bundle: Path, width: int, tokens: int, repeats: int) -> list[dict]:
    from onboard.bundle_files import bundle_source, read_bundle, read_decision
    from onboard.train import train_config
    from runtime.generated import load_generated

    bundle, spec, origin = read_bundle(bundle)
    source = bundle_source(origin, False)
    rows = []
    for entry in read_decision(bundle).generated:
        if not entry.takes:
            continue
        layer = min(entry.layers)
        cfg = train_config(bundle, layers=layer + 1, width=width)
        model = source.build(type(source.config).from_dict(cfg)).eval()
        module = model.get_submodule(f"{spec['layers_path']}.{layer}.{entry.path}")
        seen = {}
        hook = module.register_forward_pre_hook(lambda _, a, k: seen.setdefault("in", (a, k)), with_kwargs=True)
        ids = torch.randint(3, min(cfg.get("vocab_size", 1000), 1000), (1, tokens),
                            generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
        hook.remove()
        args, kwargs = seen["in"]
        replacement = load_generated(bundle / "generated" / entry.file)(copy.deepcopy(module))
        outs = _floats(module(*args, **kwargs))
        gen = torch.Generator().manual_seed(1)
        weights = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]
        times = {"hf": [], "generated": []}
        results = {}
        for mod in (module, replacement):  # once each untimed: first-touch allocations fall on neither
            fwd_bwd(mod, args, kwargs, weights)
        for _ in range(repeats):  # alternating, so drift in the machine's speed falls on both alike
            for name, mod in (("hf", module), ("generated", replacement)):
                seconds, results[name] = fwd_bwd(mod, args, kwargs, weights)
                times[name].append(seconds)
        hf, ours = (statistics.median(times[n]) for n in ("hf", "generated"))
        error = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
                    for a, b in zip(results["generated"], results["hf"]))
        rows.append({"bundle": bundle.name, "module": entry.path, "replaces": entry.replaces, "policy": entry.policy,
                     "hf_ms": hf * 1e3, "generated_ms": ours * 1e3, "ratio": hf / ours, "max_rel_error": error,
                     "shape": [list(a.shape) for a in args if isinstance(a, torch.Tensor)]})
    return rows


def main():
    parser = common.parser(__doc__, width=(16, "widen the twin this many times"), tokens=2048, repeats=5,
                           threads=(2, "torch threads"))
    parser.add_argument("bundles", nargs="*", help="bundles written by onboard agent (default: see above)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-generated-") as scratch:
        common.scratch_kernel_store(Path(scratch) / "kernels")
        bundles = [Path(b) for b in args.bundles] or default_bundles(Path(scratch))
        rows = [row for bundle in bundles for row in bench_bundle(bundle, args.width, args.tokens, args.repeats)]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"generated modules vs HuggingFace, twin x{args.width} wide, {args.tokens} tokens, fp32, forward + backward, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    for r in rows:
        verdict = "faster" if r["ratio"] >= 1 else "SLOWER"
        print(f"{r['bundle']:<16} {r['module']:<30} {r['replaces']:<32} {r['policy']:<5} hf {r['hf_ms']:8.1f} ms, "
              f"generated {r['generated_ms']:8.1f} ms: {r['ratio']:.2f}x {verdict}; max rel error {r['max_rel_error']:.1e}")


if __name__ == "__main__":
    main()
