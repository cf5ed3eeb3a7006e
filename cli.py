"""The `onboard` command: argument parsing and printing only; every verb calls into `onboard/`."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from onboard.train.request import TrainRequest
from runtime.train.job import TrainJob, whole_number


def _quiet_libraries() -> None:
    # transformers and torch warn about things the user did not ask about (missing fast kernels, etc.)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import warnings

    warnings.filterwarnings("ignore")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the mistake and where help is, not the whole usage."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


POSITIVE, NON_NEGATIVE = whole_number(1), whole_number(0)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="HuggingFace id, local directory with config.json, or catalogue name")
    p.add_argument("--trust-remote-code", action="store_true", help="run the model's own modeling code")
    p.add_argument("--online", action="store_true", help="allow downloading config.json from the Hub")


def cmd_inspect(args) -> int:
    from onboard.source import resolve

    if args.online:
        os.environ["HF_HUB_OFFLINE"] = "0"
    source = resolve(args.model, trust_remote_code=args.trust_remote_code, online=args.online)
    from onboard.inspect.accounting import costs  # after the model is found: these import torch and transformers
    from onboard.inspect.inspection import inspect_source
    from onboard.inspect.summary import summary

    spec, timings = inspect_source(source)
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
    if args.agent == "llm":
        from onboard.errors import OnboardError

        raise OnboardError("the llm policy needs an endpoint: onboard agent MODEL --policy llm --base-url URL "
                           "--llm-model NAME")
    return _write_bundle(args, {"policy": args.agent} if args.agent else None)


def cmd_agent(args) -> int:
    from pathlib import Path

    return _write_bundle(args, {
        "policy": args.policy, "replay": Path(args.replay) if args.replay else None, "rounds": args.rounds,
        "keep_slower": args.keep_slower, "base_url": args.base_url, "llm_model": args.llm_model,
        "key_env": args.key_env, "calls": args.calls, "max_tokens": args.max_tokens, "timeout": args.timeout,
        "tool_choice": args.tool_choice, "streaming": args.stream or None})


def _write_bundle(args, agent_options: dict | None) -> int:
    """`adapt` (agent_options None) or `onboard.agent.loop.run` with them; prints what happened."""
    from pathlib import Path

    from onboard.source import resolve

    source = resolve(args.model, trust_remote_code=args.trust_remote_code, online=args.online)
    out = Path(args.out) if args.out else Path("bundles") / source.name.replace("/", "--")
    notes: list[str] = []
    if agent_options is None:
        from onboard.bundle.make import adapt

        spec, verification = adapt(source, out, force=args.force, notes=notes)
        agent = None
    else:
        from onboard.agent.loop import run

        spec, verification, agent = run(source, out, force=args.force, notes=notes, **agent_options)
    for note in notes:
        print(note if note.startswith("kept ") else f"tidied: {note}")
    if agent is not None and not agent.tasks:
        print("agent: nothing left over: the bundle is what `onboard adapt` writes")
    for entry in agent.decision_entries if agent is not None else []:
        state = f"replaced by generated/{entry.file}" if entry.takes else f"stays HuggingFace code: {entry.refused}"
        print(f"agent: {entry.path} ({entry.replaces}): {state}")
    return _print_verification(spec, verification, out)


RUNS_ADAPTER = "runs the bundle's adapter.py (generated Python: review it, as any code from a pull request)"


def cmd_verify(args) -> int:
    from onboard.review.reverify import verify_bundle

    print(f"running {os.path.join(args.bundle, 'adapter.py')}: the bundle's generated code", flush=True)
    spec, verification = verify_bundle(args.bundle, trust_remote_code=args.trust_remote_code)
    return _print_verification(spec, verification, args.bundle)


def cmd_review(args) -> int:
    from pathlib import Path

    from onboard.errors import OnboardError
    from onboard.outputs import output_file
    from onboard.review.changes import review

    if len(args.bundles) > 2:
        raise OnboardError("review takes OLD NEW, or NEW alone")
    old, new = (None, args.bundles[0]) if len(args.bundles) == 1 else args.bundles
    out = output_file(args.out, force=args.force, what="review") if args.out else None
    text = review(Path(old) if old else None, Path(new), args.format)
    if out is None:
        print(text, end="")
    else:
        from onboard.outputs import write_atomically

        write_atomically(out, text)
        print(f"review: {out}")
    return 0


def cmd_check(args) -> int:
    from pathlib import Path

    from onboard.errors import OnboardError
    from onboard.review.check import check_bundle, committed_bundles

    bundles = [Path(b) for b in args.bundles] or committed_bundles()
    if not bundles:
        raise OnboardError("no bundles to check: name them, or run in a folder whose bundles/ holds some")
    codes = set()
    for bundle in bundles:
        result = check_bundle(bundle, fix=args.fix, trust_remote_code=args.trust_remote_code)
        for line in result.lines():
            print(line, flush=True)
        if result.fixed:
            codes.add(0 if result.fresh_passed else 3)
        elif result.failed:
            codes.add(3)
        elif result.stale:
            codes.add(5)
    return 3 if 3 in codes else 5 if 5 in codes else 0


def cmd_train(args) -> int:
    from onboard.train.launch import run

    print(f"running {os.path.join(args.bundle, 'adapter.py')}: the bundle's generated code", flush=True)
    return run(TrainRequest.from_args(args), TrainJob.from_args(args))


def cmd_export(args) -> int:
    from onboard.train.export import export

    code = export(args.checkpoint, args.format, args.out, bundle=args.bundle, weights=args.weights,
                  trust_remote_code=args.trust_remote_code, trust_checkpoint=args.trust_checkpoint)
    if code == 0:
        print(f"exported: {args.out}")
    return code


def cmd_catalogue(args) -> int:
    from onboard.source import catalogue_index

    if args.write_specs:
        from onboard.inspect.cache import write_catalogue_specs

        for path in write_catalogue_specs():
            print(f"wrote {path}")
        return 0
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
    from onboard.review.families import discover, markdown, support_row

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


def _plan_row(c) -> str:
    p = c.plan
    memory = f"{p.recompute}/{p.offload}" + (f"/chunk{p.loss_chunk}" if p.loss_chunk else "")
    return (f"{p.tp:>3} {p.pp:>3} {p.cp:>3} {p.dp_shard:>5} {p.dp_replicate:>5} {p.ep:>4} {p.micro_batch:>3} "
            f"{p.grad_accum:>5}  {memory:<24} {c.memory_bytes / 1e9:>8.1f} {c.step_time_s:>9.3f} "
            f"{f'{c.low_s:.2f}-{c.high_s:.2f}':>13} {c.tokens_per_s:>12,.0f}"
            f" {'no' if c.not_runnable else 'yes':>4}" + (" *" if c.extrapolates_on else ""))


def cmd_plan(args) -> int:
    import time

    from onboard.outputs import output_file
    from onboard.plan import hardware, load_spec, plan_model, plot_frontier, write_plan

    # the quick checks first: no model is inspected for a plan that could not be written or priced
    output_file(args.out, force=args.force, what="plan")
    if args.plot:
        output_file(args.plot, force=args.force, what="plot")
    hardware(args.hardware)
    began = time.perf_counter()
    spec = load_spec(args.model, trust_remote_code=args.trust_remote_code, online=args.online, cache=not args.fresh)
    start = time.perf_counter()
    report = plan_model(spec, devices=args.devices, hardware_name=args.hardware, mode=args.mode,
                        seq_len=args.seq_len, global_batch=args.global_batch, predictor=args.predictor,
                        runlog=args.runlog, imbalance=args.imbalance)
    seconds = time.perf_counter() - start
    if args.verbose:  # on stderr, so --json stays one document
        print(f"time: since start {time.process_time():.2f}s of CPU (imports included); model spec "
              f"{start - began:.2f}s; search {seconds:.2f}s", file=sys.stderr)
    top = report.result.ranked[:args.top]
    if report.best:
        write_plan(report.best.plan, args.out)
    if args.plot:
        plot_frontier(report, args.plot)
    if args.json:
        print(json.dumps({"model": spec.name, "hardware": report.hardware.name, "devices": args.devices,
                          "global_batch": report.global_batch, "predictor": report.predictor_label,
                          "layouts": report.result.layouts, "fitting": len(report.result.ranked),
                          "search_s": round(seconds, 3),
                          "plans": [{**c.plan.to_dict(), "not_runnable": c.not_runnable} for c in top],
                          "best_runnable": report.best.plan.to_dict() if report.best else None,
                          "expert_imbalance": report.imbalance_note(),
                          "suggestions": report.suggestions}, indent=2, sort_keys=True))
        return 0 if report.best else 4
    print(f"{spec.name} on {args.devices} x {report.hardware.name}, {args.mode}, seq {args.seq_len}, "
          f"global batch {report.global_batch}: {len(report.result.ranked)} of {report.result.layouts} layouts fit "
          f"({seconds:.2f}s, predictor {report.predictor_label})")
    if not report.fastest:
        print("no plan fits in memory:")
        for line in report.suggestions:
            print(f"  - {line}")
        return 4
    print(f"{'tp':>3} {'pp':>3} {'cp':>3} {'fsdp':>5} {'repl':>5} {'ep':>4} {'mb':>3} {'accum':>5}  "
          f"{'recompute/offload/loss':<24} {'GB/dev':>8} {'step s':>9} {'90% interval':>13} {'tokens/s':>12} {'runs':>4}")
    for c in top:
        print(_plan_row(c))
    if report.best is not None and report.best not in top:
        print("best runnable:")
        print(_plan_row(report.best))
    if any(c.extrapolates_on for c in top):
        print("* outside the predictor's training runs (see `onboard predict`): the learned correction is a guess")
    print("ranked by the slow end of each 90% interval (the interval widens as a plan leaves the training runs)")
    for reason in dict.fromkeys(r for c in top for r in c.not_runnable):
        print(f"runs no: {reason}")
    if note := report.imbalance_note():
        print(note)
    if report.best is None:
        print("no plan that fits is one onboard train runs yet: nothing written")
        return 4
    print(f"plan: {args.out} (the fastest runnable plan)" + (f"; plot: {args.plot}" if args.plot else ""))
    return 0


def cmd_predict(args) -> int:
    from onboard.plan import hardware, load_spec, predict_plan
    from runtime.plan import Plan

    Plan.load(args.plan), hardware(args.hardware)  # the quick checks first
    spec = load_spec(args.model, trust_remote_code=args.trust_remote_code, online=args.online)
    out = predict_plan(spec, args.plan, hardware_name=args.hardware, predictor=args.predictor)
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    low, high = out["step_time_interval_s"]
    print(f"{out['model']} on {out['devices']} x {out['hardware']} ({out['predictor']}): "
          f"step {out['step_time_s']:.3f} s ({out['interval_coverage']:.0%} interval {low:.3f}-{high:.3f} s; "
          f"cost model {out['cost_model_step_time_s']:.3f} s), "
          f"{out['tokens_per_s']:,.0f} tokens/s, {out['memory_per_device_bytes'] / 1e9:.1f} GB per device "
          f"of {out['memory_capacity_bytes'] / 1e9:.0f}")
    if out["extrapolates_on"]:
        print(f"note: outside the training runs on {', '.join(out['extrapolates_on'])}; the correction is a guess there")
    return 0


def _trained(model) -> None:
    t = model.meta["training"]
    print(f"{model.label}: {t['runs']} runs of {t['models']} models, {t['skipped']} skipped -> {model.path}")
    for reason, count in t["skipped_reasons"].items():
        print(f"  skipped {count}: {reason}")


def _retrain(args) -> int:
    from onboard.plan import retrain_predictor

    result = retrain_predictor(args.logs, args.out, make_default=args.make_default, jobs=args.jobs)
    _trained(result.predictor)

    def pct(x):
        return "-" if x is None else f"{x:.1%}"

    print(f"median error of step time, {result.previous or 'no previous default'} -> {result.predictor.label}:")
    for title, rows in (("the given runs, by hardware", result.new_runs), ("the shipped runs, by source", result.shipped)):
        print(f"  {title}:")
        for r in rows:
            print(f"    {r.name:<24} {r.runs:>5} runs  {pct(r.before):>7} -> {pct(r.after)}")
    if result.default:
        print(f"{result.predictor.label} is the default now")
    else:
        print(f"{result.predictor.label} is written but not the default: it prices the shipped runs of "
              f"{', '.join(result.regressed)} worse (--make-default makes it the default anyway)")
    return 0


def _list_predictors(directory) -> int:
    from onboard.plan import predictor_versions

    rows, default = predictor_versions(directory)
    print(f"{'version':<24} {'created':<26} {'runs':>6} {'models':>6}  {'interval near/far (MoE)':<25} training data")
    for label, meta in rows:
        t = meta.get("training") or {}
        band = meta.get("interval")
        if band:
            scale = band.get("scale", 1.0)
            moe = band.get("moe_cost_model")
            band = (f"x/{math.exp(scale * band['learned']):.2f} x/{math.exp(scale * band['cost_model']):.2f}"
                    + (f" (x/{math.exp(scale * moe):.2f})" if moe is not None else ""))
        else:
            band = "-"
        mark = " (default)" if label == default else " (held back)" if meta.get("default") is False else ""
        files = ", ".join(f["path"] for f in t.get("files", []))
        print(f"{label + mark:<24} {str(meta.get('created', '?')):<26} {t.get('runs', '?'):>6} {t.get('models', '?'):>6}  "
              f"{band:<25} {files}")
    return 0


def _print_scores(scores, by: str) -> None:
    """The evaluation table: sources, then the MoE runs by model and together, then all runs."""
    cover = by == "source"
    head = (f"{'':<24} {'runs':>5} {'cost median':>12} {'cost mean':>10} {'learned median':>15} {'learned mean':>13}"
            + (f" {'90% covers':>11}" if cover else ""))
    titles = {"source": "by source", "model": "MoE runs by model", "moe": "", "all": ""}
    shown = None
    for s in scores:
        if s.kind != shown and titles[s.kind]:
            print(f"{titles[s.kind]}:")
            print(head)
        shown = s.kind
        name = {"moe": "MoE runs", "all": "all runs"}.get(s.kind, s.source)
        print(f"{name[:24]:<24} {s.runs:>5} {s.cost_median:>12.1%} {s.cost_mean:>10.1%} {s.learned_median:>15.1%} "
              f"{s.learned_mean:>13.1%}" + (f" {s.coverage:>11.0%}" if cover and s.coverage is not None else ""))


def cmd_predictor(args) -> int:
    from collections import Counter

    from onboard.errors import OnboardError
    from onboard.plan import evaluate_predictor, train_predictor

    if args.action == "list":
        return _list_predictors(args.out)
    if args.action == "train":
        if (args.only or args.make_default) and not args.logs:
            raise OnboardError(f"{'--only' if args.only else '--make-default'} goes with --logs (the run logs to "
                               "train on)")
        if args.logs and not args.only:
            return _retrain(args)
        model = train_predictor(args.logs, args.out, jobs=args.jobs)
        _trained(model)
        return 0
    for by in ("model", "source") if args.hold_out == "both" else (args.hold_out,):
        try:
            scores, data = evaluate_predictor(args.logs, by=by, measured_only=args.measured_only, jobs=args.jobs)
        except OnboardError as exc:
            if args.hold_out != "both" or by == "model":
                raise
            print(f"no leave-one-source-out: {exc}")  # runs of one source: nothing to hold out against
            continue
        held = len(set(data.groups if by == "model" else data.sources))
        print(f"leave-one-{by}-out over {len(data)} runs ({held} {by}s held out in turn; {len(data.skipped)} "
              f"lines/runs skipped); absolute % error of step time")
        if by == "model" or args.hold_out != "both":
            for reason, count in Counter(s.reason for s in data.skipped).most_common(5):
                print(f"  skipped {count}: {reason}")
        _print_scores(scores, by)
    return 0


def _positive_number(text: str) -> float:
    """An argparse type: a finite number above 0 (seconds, factors)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number above 0, got {text}")
    return value


def cmd_report(args) -> int:
    from onboard.report.page import report

    return report(args.runlogs, args.out, follow=args.follow, interval=args.interval, idle_exit=args.idle_exit,
                  hot=args.hot, cold=args.cold)


PREDICTOR_HELP = ("trained predictor file or directory (default: the bundled newest); .joblib files are Python "
                  "pickles, and loading one runs code: name only files you trust")


def _inspect_options(p: argparse.ArgumentParser) -> None:
    _add_model_args(p)
    p.add_argument("--json", action="store_true", help="print the ModelSpec as JSON")
    p.add_argument("--seq-len", type=POSITIVE, default=4096, help="sequence length for FLOP counts (default 4096)")


def _bundle_target_options(p: argparse.ArgumentParser) -> None:
    """MODEL and where its bundle goes: what `adapt` and `agent` share."""
    _add_model_args(p)
    p.add_argument("--out", help="bundle directory (default bundles/<model>)")
    p.add_argument("--force", action="store_true", help="replace an existing bundle")


def _adapt_options(p: argparse.ArgumentParser) -> None:
    _bundle_target_options(p)
    p.add_argument("--agent", metavar="POLICY",
                   help="let the onboarding agent take on what no pattern matches (rules; as `onboard agent`)")


def _agent_options(p: argparse.ArgumentParser) -> None:
    _bundle_target_options(p)
    p.add_argument("--policy", default="rules",
                   help="what proposes the code: rules (default; offline, deterministic) or llm (a model endpoint)")
    p.add_argument("--rounds", type=POSITIVE, default=3, help="candidates tried per leftover module (default 3)")
    p.add_argument("--replay", help="agent.jsonl of an earlier session: propose what it proposed, no endpoint")
    p.add_argument("--keep-slower", action="store_true",
                   help="swap in a generated module that passed the probe even when it runs slower than the "
                        "HuggingFace module (by default it is timed and left out)")
    p.add_argument("--base-url", help="llm policy: an OpenAI-compatible endpoint (OpenAI, DeepSeek, vLLM, llama.cpp)")
    p.add_argument("--llm-model", help="llm policy: the model name the endpoint serves")
    p.add_argument("--key-env", default="OPENAI_API_KEY",
                   help="llm policy: the environment variable holding the endpoint's key (default OPENAI_API_KEY)")
    p.add_argument("--calls", type=POSITIVE, help="llm policy: model calls per leftover module (default 12)")
    p.add_argument("--max-tokens", type=POSITIVE,
                   help="llm policy: the longest reply asked for, in tokens (default 2048; a server's own default "
                        "may be its whole context)")
    p.add_argument("--timeout", type=float, help="llm policy: seconds each request may take (default 300)")
    p.add_argument("--tool-choice", choices=("auto", "required", "none"),
                   help="llm policy: the tool_choice sent with every request (default auto; some local servers call "
                        "tools only when it is sent, or only with required)")
    p.add_argument("--stream", action="store_true",
                   help="llm policy: ask for streamed replies (server-sent events) rather than whole ones")


def _verify_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", help="bundle directory written by onboard adapt")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the model's own modeling code (a bundle never switches it on by itself)")


def _review_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundles", nargs="+", metavar="BUNDLE", help="OLD NEW, or NEW alone")
    p.add_argument("--out", help="write the review to this file (default: print it)")
    p.add_argument("--force", action="store_true", help="replace an existing --out file")
    p.add_argument("--format", default="markdown", choices=("markdown", "github"),
                   help="markdown (default) or github (diffs folded in <details>, for a pull-request comment)")


def _check_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundles", nargs="*", metavar="BUNDLE", help="bundle directories (default: every one in bundles/)")
    p.add_argument("--fix", action="store_true", help="replace stale or failing bundles with the ones made now")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the models' own modeling code (a bundle never switches it on by itself)")


def _families_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--markdown", action="store_true", help="print README's support table")
    p.add_argument("--adapt", action="store_true", help="also adapt and verify each family, the agent's rules policy taking on what no "
                        "pattern matches (bundles in a temp dir)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def _train_options(p: argparse.ArgumentParser) -> None:
    TrainRequest.add_arguments(p)  # the bundle, the model, text data: onboard's own
    TrainJob.add_arguments(p, skip=("keep_checkpoints", "offload_dir", "progress"))  # the run's: runtime.train's


def _export_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="the run's checkpoint folder (default of onboard train: BUNDLE/checkpoints)")
    p.add_argument("--format", required=True, choices=("peft", "hf"),
                   help="peft: the LoRA adapters as a PEFT adapter; hf: the model, LoRA merged, as a HF checkpoint")
    p.add_argument("--out", required=True, help="a new folder for the export (never replaced)")
    p.add_argument("--bundle", help="the bundle the run trained, whose adapter.py (generated code) export runs "
                                    "(default: the folder above BUNDLE/checkpoints); it must be the one the "
                                    "checkpoints were written by")
    p.add_argument("--weights", help="the released model the run started from (default: the path the run recorded; "
                                     "required with --trust-remote-code)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the model's own modeling code (never read from the checkpoint's launch.json)")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="read a checkpoint whose pickled index names more than DCP's own classes with torch's "
                        "readers, which run what it names (only for checkpoints you wrote; never read from job.json)")


def _catalogue_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--write-specs", action="store_true",
                   help="inspect every catalogue model and write the spec it ships (catalogue/<slug>/spec.json, "
                        "what `onboard plan` reads without inspecting; a development step, like `onboard check --fix`)")


def _plan_options(p: argparse.ArgumentParser) -> None:
    _add_model_args(p)
    p.add_argument("--devices", type=POSITIVE, required=True, help="number of accelerators")
    p.add_argument("--hardware", required=True, help="hardware name (e.g. H100, Ascend-910C) or a YAML spec")
    p.add_argument("--mode", choices=("full", "lora"), default="full", help="full training or LoRA (default full)")
    p.add_argument("--seq-len", type=POSITIVE, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument("--global-batch", type=POSITIVE, help="sequences per optimizer step (default: about 4M tokens)")
    p.add_argument("--top", type=POSITIVE, default=10, help="plans to print (default 10)")
    p.add_argument("--out", default="plan.json", help="where the best plan is written (default plan.json)")
    p.add_argument("--force", action="store_true", help="replace an existing --out / --plot file")
    p.add_argument("--plot", help="PNG of the throughput / memory frontier (needs matplotlib)")
    p.add_argument("--predictor", help=PREDICTOR_HELP)
    p.add_argument("--runlog", nargs="+", metavar="RUNLOG",
                   help="run logs (files or folders) of this model: price the expert load imbalance they measured "
                        "(the busiest EP rank's tokens over the mean, at each EP degree) instead of perfect balance")
    p.add_argument("--imbalance", type=float, metavar="X",
                   help="assume the busiest EP rank gets X times the mean tokens (default: perfect balance)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--fresh", action="store_true",
                   help="inspect the model again rather than read its spec from the cache (~/.cache/onboard, or "
                        "ONBOARD_CACHE_DIR; its entries are named by everything a spec is made from)")
    p.add_argument("--verbose", action="store_true", help="print the time each phase took (on stderr)")


def _predict_options(p: argparse.ArgumentParser) -> None:
    _add_model_args(p)
    p.add_argument("--plan", required=True, help="plan.json")
    p.add_argument("--hardware", required=True, help="hardware name (e.g. H100, Ascend-910C) or a YAML spec")
    p.add_argument("--predictor", help=PREDICTOR_HELP)
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def _predictor_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("train", "eval", "list"),
                   help="train a new version, evaluate one on runs of what it was not trained on, or list the versions")
    p.add_argument("--hold-out", default="both", choices=("model", "source", "both"),
                   help="eval: hold out one model at a time, one source (benchmark suite) at a time, or both "
                        "(default)")
    p.add_argument("--logs", nargs="+", help="run-log files or directories: train: added to what ships in "
                                             "predictors/data (e.g. bundles/*/runs); eval: the runs to evaluate on")
    p.add_argument("--measured-only", action="store_true",
                   help="eval: leave out the runs with a value taken from elsewhere than their source (a vocabulary "
                        "from the catalogue, a proxy's shape; meta.assumed)")
    p.add_argument("--only", action="store_true", help="train: on --logs alone, not on what ships as well")
    p.add_argument("--make-default", action="store_true",
                   help="train: make the new version the default even where it prices the shipped runs worse")
    p.add_argument("--out", help="train: new model file (.joblib) or directory; never overwrites; list: the directory")
    p.add_argument("--jobs", type=POSITIVE, metavar="N",
                   help="train, eval: worker processes for the held-out fits (default: every core this process may "
                        "use); the results do not depend on it")


def _report_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("runlogs", nargs="+", metavar="RUNLOG",
                   help="run-log files (JSON lines) or folders of *.jsonl; several runs are compared")
    p.add_argument("--out", default="onboard-report", metavar="DIR",
                   help="folder for the PNGs and index.html (default ./onboard-report); a folder holding other "
                        "files is refused, and only a report's own files are replaced")
    p.add_argument("--follow", action="store_true",
                   help="keep re-reading logs still being written and re-render when they grow, until Ctrl-C")
    p.add_argument("--interval", type=_positive_number, default=2.0,
                   help="--follow: seconds between looks at the logs (default 2)")
    p.add_argument("--idle-exit", type=_positive_number, metavar="SECONDS",
                   help="--follow: stop once the logs have not grown for this long (default: follow until Ctrl-C)")
    p.add_argument("--hot", type=_positive_number, default=1.5,
                   help="an expert stayed hot when it got more than this many times its uniform share of the "
                        "layer's tokens in most steps (default 1.5)")
    p.add_argument("--cold", type=_positive_number, default=0.5,
                   help="an expert stayed cold when it got less than this many times its uniform share in most "
                        "steps (default 0.5)")


# each verb: (name, help line, the function adding its options, the function it runs)
def _verbs() -> list[tuple]:
    return [
        ("inspect", "what a model is made of, at full scale",
         _inspect_options, cmd_inspect),
        ("adapt", "generate, verify and write the adapter bundle",
         _adapt_options, cmd_adapt),
        ("agent", "adapt, then take on what no pattern matches: generated code, probed and verified, "
            "or left as HuggingFace code with what was tried. Generated code runs only in a sandboxed "
            "process of its own (no environment, network, files or processes; 60 s a round), never "
            "in this one",
         _agent_options, cmd_agent),
        ("verify", f"re-run a bundle's numerical verification against HuggingFace; {RUNS_ADAPTER}",
         _verify_options, cmd_verify),
        ("review", "what changed between two bundles of a model (OLD NEW), or a fresh bundle in full "
            "(NEW), for the person approving the pull request; needs-human-eyes list first",
         _review_options, cmd_review),
        ("check", "make each committed bundle again from its recorded source, verify it and compare: exit 5 "
            "when one is stale (what changed, one line each), 3 when what onboard makes no longer "
            "verifies. A committed bundle's own code is never run; an agent's bundle is made again by "
            "replaying its agent.jsonl, whose candidates run only in the agent's sandbox",
         _check_options, cmd_check),
        ("families", "inspect every MoE / hybrid family the installed transformers ships",
         _families_options, cmd_families),
        ("train", "train a bundle's adapted model (torchrun for plans over several processes); "
            + RUNS_ADAPTER,
         _train_options, cmd_train),
        ("export", "export the newest checkpoint of a run on released weights (onboard train --weights) "
            "as a PEFT adapter or a HuggingFace checkpoint, with the run's own plan",
         _export_options, cmd_export),
        ("catalogue", "list the bundled model configs",
         _catalogue_options, cmd_catalogue),
        ("plan", "rank parallel plans by predicted throughput; writes plan.json",
         _plan_options, cmd_plan),
        ("predict", "predicted step time, tokens/s and memory of one plan",
         _predict_options, cmd_predict),
        ("predictor", "train, evaluate or list the learned throughput predictor's versions",
         _predictor_options, cmd_predictor),
        ("report", "figures and one self-contained HTML page of training runs from their run logs (loss, "
            "throughput, communication, memory, tokens per expert, EP-rank load, hot and cold "
            "experts), runs compared, and a summary on the terminal",
         _report_options, cmd_report),
    ]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="onboard", description="Onboard MoE models onto the training runtime.",
                     epilog="Exit codes: 0 ok, 1 bad input (one line on stderr), 2 bad arguments, 3 verification "
                            "failed, 4 no plan fits, 5 stale bundle (onboard check), 70 internal error.")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an internal error (also ONBOARD_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    for name, help, options, func in _verbs():  # the verb's help is also its description under `onboard VERB --help`
        p = sub.add_parser(name, help=help, description=help)
        options(p)
        p.set_defaults(func=func)
    return parser


INTERNAL_ERROR = 70  # sysexits' EX_SOFTWARE: not the user's input, a bug to report


def main(argv: list[str] | None = None) -> int:
    _quiet_libraries()
    args = build_parser().parse_args(argv)
    if getattr(args, "seq_len", 1) is not None and getattr(args, "seq_len", 1) <= 0:
        print("onboard: error: --seq-len must be a positive number of tokens", file=sys.stderr)
        return 2
    from onboard.errors import OnboardError
    from runtime.errors import InputError

    try:
        return args.func(args)
    except (OnboardError, InputError) as exc:  # one line even when a message quotes the user's text
        print(f"onboard: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("onboard: interrupted", file=sys.stderr)
        return 130
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # a bug of ours or of code we call (torch's CheckpointException is a
        # BaseException): one line, and the traceback on request
        if args.debug or os.environ.get("ONBOARD_DEBUG") == "1":
            raise
        from onboard.errors import one_line

        print(f"onboard: internal error: {one_line(exc)} (rerun with --debug for the traceback, and report it)",
              file=sys.stderr)
        return INTERNAL_ERROR


if __name__ == "__main__":
    sys.exit(main())
