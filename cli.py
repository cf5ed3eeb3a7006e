"""The `onboard` command: argument parsing and printing only; every verb calls into `onboard/`."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _quiet_libraries() -> None:
    # transformers and torch warn about things the user did not ask about (missing fast kernels, etc.)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import warnings

    warnings.filterwarnings("ignore")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="HuggingFace id, local directory with config.json, or catalogue name")
    p.add_argument("--trust-remote-code", action="store_true", help="run the model's own modeling code")
    p.add_argument("--online", action="store_true", help="allow downloading config.json from the Hub")


def cmd_inspect(args) -> int:
    from onboard.accounting import costs
    from onboard.inspection import inspect_model
    from onboard.report import summary

    if args.online:
        os.environ["HF_HUB_OFFLINE"] = "0"
    spec, timings = inspect_model(args.model, trust_remote_code=args.trust_remote_code, online=args.online)
    if args.json:
        data = spec.to_dict()
        data["costs"] = vars(costs(spec, args.seq_len))
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        print(summary(spec, args.seq_len, timings))
    return 0


def _print_verification(spec, verification, out) -> int:
    status = "PASSED" if verification.passed else "FAILED"
    worst = max((r.logits_max_rel for r in verification.seeds), default=0.0)
    grads = max((r.grad_worst_rel for r in verification.seeds), default=0.0)
    print(f"{spec.name}: replaced {verification.replaced} MoE block(s) in the twin "
          f"({sum(1 for layer in spec.layers if layer.mlp.kind == 'moe')} MoE layers at full scale); "
          f"verification {status} over {len(verification.seeds)} seeds "
          f"(max rel logits diff {worst:.1e}, worst grad rel diff {grads:.1e})")
    if verification.note:
        print(f"note: {verification.note}")
    print(f"bundle: {out}")
    return 0 if verification.passed else 3


def cmd_adapt(args) -> int:
    from pathlib import Path

    from onboard.bundle import adapt
    from onboard.source import resolve

    source = resolve(args.model, trust_remote_code=args.trust_remote_code, online=args.online)
    out = Path(args.out) if args.out else Path("bundles") / source.name.replace("/", "--")
    spec, verification = adapt(source, out, force=args.force)
    return _print_verification(spec, verification, out)


def cmd_verify(args) -> int:
    from onboard.bundle import verify_bundle

    spec, verification = verify_bundle(args.bundle)
    return _print_verification(spec, verification, args.bundle)


def cmd_train(args) -> int:
    from onboard.train import run

    return run(args.bundle, args.plan, steps=args.steps, layers=args.layers, width=args.width,
               checkpoint_dir=args.checkpoint_dir, runlog=args.runlog, data=args.data, lr=args.lr, seed=args.seed,
               checkpoint_every=args.checkpoint_every)


def cmd_catalogue(args) -> int:
    from onboard.source import catalogue_index

    index = catalogue_index()
    if args.json:
        print(json.dumps(index, indent=2, sort_keys=True))
        return 0
    width = max(len(slug) for slug in index)
    for slug, meta in index.items():
        pub = meta.get("published", {})
        figures = ""
        if pub.get("params_total"):
            figures = f"{pub['params_total'] / 1e9:,.1f}B total" + (
                f", {pub['params_active'] / 1e9:.1f}B active" if pub.get("params_active") else "")
        print(f"{slug:<{width}}  {meta.get('hf_id') or 'bundled remote-code model':<42} {figures}")
    return 0


def cmd_families(args) -> int:
    from onboard.families import discover, markdown, support_row

    import tempfile

    rows = []
    scratch = tempfile.mkdtemp(prefix="onboard-families-") if args.adapt else None
    for family in discover():
        row = support_row(family, scratch)
        rows.append(row)
        if not args.markdown and not args.json:
            detail = row.get("why") or f"{', '.join(row['attention'])} | {', '.join(row['mlp'])} ({row['seconds']}s)"
            print(f"{family:<24} {row['status']:<12} {detail}", flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
    elif args.markdown:
        print(markdown(rows))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onboard", description="Onboard MoE models onto the training runtime.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="what a model is made of, at full scale")
    _add_model_args(p)
    p.add_argument("--json", action="store_true", help="print the ModelSpec as JSON")
    p.add_argument("--seq-len", type=int, default=4096, help="sequence length for FLOP counts (default 4096)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("adapt", help="generate, verify and write the adapter bundle")
    _add_model_args(p)
    p.add_argument("--out", help="bundle directory (default bundles/<model>)")
    p.add_argument("--force", action="store_true", help="replace an existing bundle")
    p.set_defaults(func=cmd_adapt)

    p = sub.add_parser("verify", help="re-run a bundle's numerical verification against HuggingFace")
    p.add_argument("bundle", help="bundle directory written by onboard adapt")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("families", help="inspect every MoE / hybrid family the installed transformers ships")
    p.add_argument("--markdown", action="store_true", help="print README's support table")
    p.add_argument("--adapt", action="store_true", help="also adapt and verify each family (bundles in a temp dir)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_families)

    p = sub.add_parser("train", help="train a bundle's adapted model (torchrun for plans over several processes)")
    p.add_argument("bundle", help="bundle directory written by onboard adapt")
    p.add_argument("--plan", help="plan JSON (default: the bundle's plan.json)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps in the whole run (default 10)")
    p.add_argument("--layers", type=int, help="decoder layers to train (default: the tiny twin's)")
    p.add_argument("--width", type=int, default=1, help="widen the twin's hidden size, heads and MLPs (default 1)")
    p.add_argument("--data", help="tokenized file (.npy, or .bin of uint16); default: synthetic tokens")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", help="default: BUNDLE/checkpoints (a rerun resumes from the newest)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (default: at the end)")
    p.add_argument("--runlog", help="run log JSON lines (default: BUNDLE/runs/train.jsonl)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("catalogue", help="list the bundled model configs")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_catalogue)
    return parser


def main(argv: list[str] | None = None) -> int:
    _quiet_libraries()
    args = build_parser().parse_args(argv)
    if getattr(args, "seq_len", 1) is not None and getattr(args, "seq_len", 1) <= 0:
        print("onboard: error: --seq-len must be a positive number of tokens", file=sys.stderr)
        return 2
    from onboard.errors import OnboardError

    try:
        return args.func(args)
    except OnboardError as exc:
        print(f"onboard: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("onboard: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
