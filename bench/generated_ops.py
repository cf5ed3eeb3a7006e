"""The agent's generated modules against the HuggingFace modules they replace: forward + backward, same run.

For each generated module of each bundle (by default: `onboard agent`'s rules policy on DeepSeek-V4, HY-V4,
Inkling2 and PhiMoE, and the recorded llm sessions of tests/agent/sessions replayed on AXK2, LongCat-Flash and
ZAYA, all into a scratch folder), the model is built at the bundle twin's config made `--width` times wider (more heads of
the same size, wider MLPs), one forward records the module's real inputs at `--tokens` tokens, and the module and
its replacement (on a copy of the same parameters) are timed alternately, fp32, forward + backward with the same
output weights (`onboard.agent.sandbox.judge.Judge.speed`, what `onboard agent` measures before it swaps a module
in: the module in the reference's process, the replacement in a sandboxed candidate's process, one thread each,
each timed by the kernel's count of its CPU time, both on one core). Prints the fastest of `--repeats` samples of
each (a sample repeats the call for 50 ms of CPU time), the median of the samples' ratios (above 1: the
replacement is faster) and the largest error of the outputs relative to each tensor's largest value (judged as
the probe judges it).

    python bench/generated_ops.py [BUNDLE ...] [--width 16] [--tokens 2048] [--repeats 5]
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import common  # bench/common.py: the benches' shared command line

REPO = Path(__file__).resolve().parents[1]
RULES = ("deepseek_v4", "hy_v4", "inkling2_text", "phimoe")
SESSIONS = ("axk2", "longcat_flash", "zaya")  # the llm policy: the rules first, then the recorded replies


def default_bundles(scratch: Path) -> list[Path]:
    from onboard.agent.loop import run
    from onboard.review.families import default_config
    from onboard.source import resolve

    bundles = []
    for family in RULES + SESSIONS:
        default_config(family).save_pretrained(scratch / "models" / family)
        replay = REPO / "tests" / "agent" / "sessions" / f"{family}.jsonl" if family in SESSIONS else None
        run(resolve(str(scratch / "models" / family)), scratch / family, replay=replay)
        bundles.append(scratch / family)
    return bundles


def bench_bundle(bundle: Path, width: int, tokens: int, repeats: int) -> list[dict]:
    from onboard.agent.sandbox.judge import Judge
    from onboard.agent.sandbox.session import Limits, Sandbox
    from onboard.bundle.files import read_bundle, read_decision

    bundle, spec, origin = read_bundle(bundle)
    rows = []
    with Sandbox(origin.ref, limits=Limits(wall_seconds=1800, call_seconds=600, cpu_seconds=1800)) as sandbox:
        judge = Judge(sandbox)
        for entry in read_decision(bundle).generated:
            if not entry.takes:
                continue
            with sandbox.candidate() as worker:
                result = judge.speed(judge.round(worker), layers_path=spec["layers_path"], layer=min(entry.layers),
                                     path=entry.path, code=(bundle / "generated" / entry.file).read_text(),
                                     name=entry.file, width=width, tokens=tokens, repeats=repeats,
                                     seed_parts=("bench", bundle.name, entry.path))
            if "ratio" not in result:
                raise SystemExit(f"{bundle.name} {entry.path}: {result['note']}")
            rows.append({"bundle": bundle.name, "module": entry.path, "replaces": entry.replaces,
                         "policy": entry.policy, **result})
    return rows


def main():
    parser = common.parser(__doc__, width=(16, "widen the twin this many times"), tokens=2048, repeats=5)
    parser.add_argument("bundles", nargs="*", help="bundles written by onboard agent (default: see above)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-generated-") as scratch:
        common.scratch_kernel_store(Path(scratch) / "kernels")
        from onboard.bundle.files import read_bundle
        from onboard.errors import OnboardError

        try:  # a bundle named on the command line that is none: one line, before anything is built
            for bundle in args.bundles:
                read_bundle(Path(bundle))
        except OnboardError as exc:
            parser.error(str(exc))
        bundles = [Path(b) for b in args.bundles] or default_bundles(Path(scratch))
        rows = [row for bundle in bundles
                for row in bench_bundle(bundle, args.width, args.tokens, args.repeats)]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"generated modules vs HuggingFace, twin x{args.width} wide, {args.tokens} tokens, fp32, forward + backward, "
          f"one thread each on one core, {args.repeats} samples of 50 ms of CPU time each: the fastest, and the "
          f"median of the pairs' ratios")
    for r in rows:
        verdict = "faster" if r["ratio"] >= 1 else "SLOWER"
        print(f"{r['bundle']:<16} {r['module']:<30} {r['replaces']:<32} {r['policy']:<5} hf {r['hf_ms']:8.1f} ms, "
              f"generated {r['generated_ms']:8.1f} ms: {r['ratio']:.2f}x {verdict}; max rel error {r['max_rel_error']:.1e}")


if __name__ == "__main__":
    main()
