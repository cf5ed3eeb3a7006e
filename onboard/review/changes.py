"""`onboard review OLD NEW`: what changed between two bundles of a model, for the person approving the pull
request that changes them (`NEW` alone: a fresh bundle reviewed in full, as if against nothing).

The page is deterministic (the same two bundles give the same bytes) and opens with what needs human eyes:
generated code (the agent's), modules newly left unmatched, verification margins that shrank to within
MARGIN of a tolerance, targets swapped back to HuggingFace code or newly taken by the runtime, code made from
changed templates or runtime files, a changed model config, a bundle that fails verification. Then: provenance, per-layer spec changes,
what runs in the runtime and what stays HuggingFace code (and why), unified diffs of the code, verification
per seed old beside new, and the plan. `github` format folds the diffs into <details> blocks.

A margin is how far inside its tolerance a measured error is (bound / error): the logits' and every
gradient's error against the fp64 truth where there was one (bound: err_factor x HuggingFace's own fp32 error
+ err_floor), else relative to the fp32 run (bound: logits_rtol, grad_rtol); the loss's relative difference
(bound: loss_rtol).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import TYPE_CHECKING

from onboard.bundle import provenance
from onboard.bundle.files import read_bundle, read_verification
from onboard.bundle.kernel_list import read_kernels
from onboard.contract import load
from onboard.errors import OnboardError
from onboard.inspect.summary import ranges

if TYPE_CHECKING:
    from onboard.adapt.verify import Verification

MARGIN = 10.0  # a margin below this (error within 10x of its bound) needs human eyes
FORMATS = ("markdown", "github")
CODE = ("adapter.py", "kernels.json", "train.sh", "train.slurm")  # diffed, with generated/*.py


# what the review reads of each JSON part without a typed reader of its own (verification.json and kernels.json
# have one): key -> type, or (type, item type), or a nested shape for a list of objects; a part that does not fit
# is refused in one line naming the file and field (it arrives in a pull request)
SHAPES = {
    "decision.json": {"moe": [{"layers": (list, int), "block": str}], "attention": [{"layers": (list, int)}],
                      "loss": dict, "generated": [{"layers": (list, int), "file": str, "rounds": (list, dict),
                                                   "probe": dict}]},
    "plan.json": {},
    provenance.FILE: {"versions": dict, "files": dict, "source": dict, "onboard": dict},
}
REQUIRED_KEYS = {provenance.FILE: ("versions", "files", "source")}


def _fits(value, shape, where: str) -> None:
    """Raise OnboardError naming `where` (file: field) when `value` does not have `shape`."""
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            raise OnboardError(f"{where} must be a JSON object")
        for key, inner in shape.items():
            if key in value and value[key] is not None:
                _fits(value[key], inner, f"{where}: '{key}'")
    elif isinstance(shape, list):
        if not isinstance(value, list):
            raise OnboardError(f"{where} must be a list")
        for i, item in enumerate(value):
            _fits(item, shape[0], f"{where}[{i}]")
    elif isinstance(shape, tuple):
        kind, item = shape
        _fits(value, kind, where)
        bad = next((v for v in value if not isinstance(v, item) or isinstance(v, bool) != (item is bool)), None)
        if bad is not None:
            raise OnboardError(f"{where} must hold {item.__name__} values, not {type(bad).__name__}")
    elif not isinstance(value, shape) or (shape is int and isinstance(value, bool)):
        raise OnboardError(f"{where} must be {shape.__name__}, not {type(value).__name__}")


class Bundle:
    """The parts of a bundle the review reads (None for a part a bundle lacks)."""

    def __init__(self, folder: Path):
        self.folder, self.spec, self.source = read_bundle(folder)
        self.decision = self._json("decision.json")
        self.verification = read_verification(self.folder)
        read_kernels(self.folder)  # diffed as text below, once it is known to be a kernel list
        self.plan = self._json("plan.json")
        self.provenance = self._json(provenance.FILE)
        self.code = self._code_files()

    def _json(self, name: str):
        path = self.folder / name
        if not path.is_file():
            return None
        value = load(path)
        _fits(value, SHAPES.get(name, {}), str(path))
        missing = [k for k in REQUIRED_KEYS.get(name, ()) if k not in value]
        if missing:
            raise OnboardError(f"{path}: no '{missing[0]}' (a provenance record names versions, files and source)")
        return value

    def _code_files(self) -> dict[str, str]:
        names = [n for n in CODE if (self.folder / n).is_file()]
        names += sorted(f"generated/{p.name}" for p in (self.folder / "generated").glob("*.py"))
        return {name: (self.folder / name).read_text() for name in names}

    def generated(self) -> dict[str, dict]:
        """The agent's modules in the bundle, by file."""
        return {f"generated/{e['file']}": e for e in (self.decision or {}).get("generated", []) if e.get("file")}


# ------------------------------------------------------------------------------------------------------
# what each part says, in words that compare


def layer_lines(spec: dict) -> dict[int, str]:
    """One line per layer: its mixer and channel mixer with the sizes and routing that matter."""
    out = {}
    for layer in spec.get("layers", []):
        a, m = layer.get("attention", {}), layer.get("mlp", {})
        mixer = [a.get("kind", "?")]
        mixer += [f"{a[k]} {label}" for k, label in (("num_heads", "heads"), ("num_kv_heads", "kv heads"),
                                                     ("head_dim", "head dim")) if a.get(k)]
        mixer += [f"{label} {a[k]}" for k, label in (("window", "window"), ("index_topk", "index top-k")) if a.get(k)]
        mlp = [m.get("kind", "?")]
        if m.get("kind") == "moe":
            router = m.get("router") or {}
            mlp += [f"{m.get('num_experts')} experts", f"top-{m.get('top_k', router.get('top_k'))}",
                    f"expert FFN {m.get('expert_ffn')}", f"{m.get('num_shared_experts') or 0} shared",
                    f"router {router.get('score')} {router.get('order')}"]
            mlp += [flag for flag in ("bias_correction", "group_limited", "renormalize") if router.get(flag)]
        elif m.get("ffn"):
            mlp.append(f"FFN {m['ffn']}")
        out[layer["index"]] = f"{', '.join(mixer)} | {', '.join(mlp)}"
    return out


def unmatched(spec: dict) -> dict[str, str]:
    return {u["path"]: u.get("reason", "") for u in spec.get("unmatched", [])}


def placements(decision: dict | None) -> dict[str, str]:
    """Per target (section, module path, layers): where it runs."""
    if not decision:
        return {}
    out = {}
    for m in decision.get("moe", []):
        where = {"block": "runtime MoEBlock", "experts": "runtime experts (HuggingFace router)"}.get(
            m.get("takes"), f"HuggingFace code ({m.get('why_not_block') or m.get('why') or 'not taken'})")
        out[f"moe `{m.get('block')}` layers {ranges(m.get('layers', []))}"] = where
    for a in decision.get("attention", []):
        if a.get("takes"):
            where = f"runtime {a['takes']} ({a.get('kind')})"
        else:
            where = f"HuggingFace code ({a.get('refused') or a.get('why_not') or a.get('why') or a.get('kind')})"
        out[f"attention `{a.get('path')}` ({a.get('kind')}) layers {ranges(a.get('layers', []))}"] = where
    loss = decision.get("loss") or {}
    out["loss"] = "runtime chunked loss" if loss.get("takes") else f"HuggingFace code ({loss.get('why_not') or 'not taken'})"
    for g in decision.get("generated", []):
        where = (f"generated/{g['file']} ({g.get('policy')} policy)" if g.get("file")
                 else f"HuggingFace code ({g.get('refused') or 'no candidate'})")
        out[f"module `{g.get('path')}` ({g.get('replaces')}) layers {ranges(g.get('layers', []))}"] = where
    return out


def margins(verification: Verification | None) -> list[tuple[str, str, float]]:
    """(what, which tensor, bound / error) for every seed's logits, loss and worst gradient."""
    if not verification:
        return []
    tol = verification.tolerances
    factor, floor = tol.get("err_factor", 10), tol.get("err_floor", 0)
    out = []
    for s in verification.seeds:
        seed = f"seed {s.seed}"
        if s.truth == "fp64":
            checks = [("logits", "", s.logits_err_adapted, factor * s.logits_err_hf + floor),
                      ("gradient", s.grad_err_param, s.grad_err_adapted, factor * s.grad_err_hf + floor)]
        else:
            checks = [("logits", "", s.logits_max_rel, tol.get("logits_rtol")),
                      ("gradient", s.grad_worst_param, s.grad_worst_rel, tol.get("grad_rtol"))]
        if s.truth == "fp64" and "err_scale_min" in tol:  # written since the loss is judged against fp64
            checks.append(("loss", "", s.loss_err_adapted, factor * s.loss_err_hf + floor))
        else:
            loss_error = abs(s.loss_ref - s.loss_adapted) / max(abs(s.loss_ref), 1e-30)
            checks.append(("loss", "", loss_error, tol.get("loss_rtol")))
        for what, tensor, error, bound in checks:
            if isinstance(error, int | float) and isinstance(bound, int | float) and bound > 0:
                out.append((f"{seed} {what}", tensor or "", bound / error if error > 0 else float("inf")))
    return out


def _times(margin: float) -> str:
    return "exact" if margin == float("inf") else f"{margin:.1f}x"


# ------------------------------------------------------------------------------------------------------
# the page


def needs_eyes(old: Bundle | None, new: Bundle) -> list[str]:
    out = []
    old_generated = old.generated() if old else {}
    old_code = old.code if old else {}
    for name, entry in new.generated().items():
        if old is None or old_code.get(name) != new.code.get(name) or name not in old_generated:
            out.append(f"generated code: `{name}` replaces `{entry.get('path')}` ({entry.get('replaces')}), written by "
                       f"the {entry.get('policy')} policy: review it as code from a pull request")
    before = unmatched(old.spec) if old else {}
    for path, reason in sorted(unmatched(new.spec).items()):
        if path not in before:
            out.append(f"{'newly unmatched' if old else 'unmatched'}: `{path}` ({reason})")
    old_margins = {what: m for what, _, m in margins(old.verification)} if old else {}
    for what, tensor, margin in margins(new.verification):
        if margin < MARGIN and (old is None or old_margins.get(what, float("inf")) >= MARGIN
                                or margin < old_margins.get(what, float("inf"))):
            was = f", was {_times(old_margins[what])}" if what in old_margins else ""
            of = f" ({tensor})" if tensor else ""
            out.append(f"verification margin: {what}{of} is {margin:.1f}x inside its tolerance{was}")
    if old is not None:
        before, after = placements(old.decision), placements(new.decision)
        for target, where in sorted(after.items()):
            if where.startswith("HuggingFace code") and not before.get(target, where).startswith("HuggingFace code"):
                out.append(f"swapped back to HuggingFace code: {target}: was {before[target]}, now {where}")
            elif not where.startswith("HuggingFace code") and before.get(target) != where:
                was = f"was {before[target]}, now " if target in before else ""
                out.append(f"newly taken by the runtime: {target}: {was}{where}")
        changed = _provenance_changes(old.provenance, new.provenance)
        code_changed = [n for n in set(old_code) | set(new.code) if old_code.get(n) != new.code.get(n)]
        made_from = [c for c in changed if c.startswith(("templates/", "runtime/"))]
        if code_changed and made_from:
            out.append(f"code made from changed templates or runtime files ({', '.join(made_from[:5])}"
                       f"{' ...' if len(made_from) > 5 else ''}): {', '.join(sorted(code_changed))}")
        if "the model's config" in changed:
            out.append("the model's config changed: check the per-layer spec changes below")
    if new.verification and not new.verification.passed:
        out.append(f"verification FAILED: {new.verification.note or 'see the table below'}")
    return out


def _provenance_changes(old: dict | None, new: dict | None) -> list[str]:
    return provenance.causes(old, new) if new is not None else []


def _diff(name: str, a: str, b: str) -> str:
    return "".join(difflib.unified_diff(a.splitlines(keepends=True), b.splitlines(keepends=True),
                                        fromfile=f"old/{name}", tofile=f"new/{name}"))


def _fence(text: str, lang: str, fmt: str, summary: str) -> list[str]:
    body = [f"```{lang}", text.rstrip("\n"), "```"]
    if fmt == "github":
        return [f"<details><summary>{summary}</summary>", "", *body, "", "</details>"]
    return [f"{summary}:", "", *body]


def _number(x) -> str:
    return f"{x:.2e}" if isinstance(x, float) else str(x)


def review(old_dir: Path | None, new_dir: Path, fmt: str = "markdown") -> str:
    if fmt not in FORMATS:
        raise OnboardError(f"unknown review format {fmt!r}: choose from {', '.join(FORMATS)}")
    new = Bundle(new_dir)
    old = Bundle(old_dir) if old_dir is not None else None
    name = new.spec.get("name", new.folder.name)
    lines = [f"# onboard review: {name}" if old is None else
             f"# onboard review: {old.spec.get('name', old.folder.name)} -> {name}", ""]
    same = old is not None and _identical(old, new)
    if same:
        lines += ["No changes: the two bundles hold the same code, spec, decision, verification verdicts and plan.", ""]
    eyes = needs_eyes(old, new)
    lines += ["## Needs human eyes", ""] + ([f"- {e}" for e in eyes] or ["- nothing"]) + [""]
    lines += _provenance_section(old, new)
    lines += _spec_section(old, new)
    lines += _placement_section(old, new)
    lines += _code_section(old, new, fmt)
    lines += _verification_section(old, new)
    lines += _plan_section(old, new)
    return "\n".join(lines).rstrip("\n") + "\n"


def _identical(old: Bundle, new: Bundle) -> bool:
    return (old.code == new.code and old.spec == new.spec and old.decision == new.decision
            and _verdicts(old.verification) == _verdicts(new.verification) and old.plan == new.plan)


def _verdicts(verification: Verification | None) -> dict | None:
    from onboard.review.check import verdicts

    return verdicts(verification) if verification is not None else None


def _provenance_section(old: Bundle | None, new: Bundle) -> list[str]:
    def row(b: Bundle | None) -> list[str]:
        p = (b.provenance or {}) if b else {}
        src = p.get("source", b.source.to_dict() if b else {})
        return [f"{p.get('onboard', {}).get('version', '-')} @ {(p.get('onboard', {}).get('commit') or '-')[:12]}",
                p.get("versions", {}).get("transformers", "-"), p.get("versions", {}).get("torch", "-"),
                f"{src.get('ref', '-')}" + (f" @ {src['revision']}" if src.get("revision") else ""),
                (src.get("config_sha256") or "-")[:12]]

    heads = ["onboard", "transformers", "torch", "model", "config sha256"]
    lines = ["## Provenance", "", "| | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    if old is not None:
        lines.append("| old | " + " | ".join(row(old)) + " |")
    lines.append("| new | " + " | ".join(row(new)) + " |")
    if old is not None:
        changed = _provenance_changes(old.provenance, new.provenance)
        lines += ["", "Changed since the old bundle: " + (", ".join(f"`{c}`" for c in changed) if changed else "nothing")]
        if new.provenance:
            added, dropped = provenance.uses(old.provenance, new.provenance)
            lines += [f"Now also made from: {', '.join(f'`{f}`' for f in added)}"] if added else []
            lines += [f"No longer made from: {', '.join(f'`{f}`' for f in dropped)}"] if dropped else []
    return lines + [""]


def _spec_section(old: Bundle | None, new: Bundle) -> list[str]:
    lines = ["## Spec", ""]
    after = layer_lines(new.spec)
    if old is None:
        groups: dict[str, list[int]] = {}
        for i, text in sorted(after.items()):
            groups.setdefault(text, []).append(i)
        lines += [f"- layers {ranges(idx)}: {text}" for text, idx in sorted(groups.items(), key=lambda g: g[1][0])]
    else:
        before = layer_lines(old.spec)
        changes: dict[tuple[str, str], list[int]] = {}
        for i in sorted(set(before) | set(after)):
            if before.get(i) != after.get(i):
                changes.setdefault((before.get(i, "(no layer)"), after.get(i, "(no layer)")), []).append(i)
        if old.spec.get("num_layers") != new.spec.get("num_layers"):
            lines.append(f"- layers: {old.spec.get('num_layers')} -> {new.spec.get('num_layers')}")
        for (a, b), idx in sorted(changes.items(), key=lambda c: c[1][0]):
            lines += [f"- layers {ranges(idx)}:", f"  - old: {a}", f"  - new: {b}"]
        gone = sorted(set(unmatched(old.spec)) - set(unmatched(new.spec)))
        lines += [f"- now matched: `{p}`" for p in gone]
        if len(lines) == 2:
            lines.append("- no change")
    now = unmatched(new.spec)
    if now:
        lines += ["", "Unmatched (stays HuggingFace code):", ""] + [f"- `{p}`: {r}" for p, r in sorted(now.items())]
    return lines + [""]


def _placement_section(old: Bundle | None, new: Bundle) -> list[str]:
    lines = ["## What runs where", "", "| target | " + ("old | " if old else "") + "new |",
             "|---|" + ("---|" if old else "") + "---|"]
    before, after = (placements(old.decision) if old else {}), placements(new.decision)
    for target in sorted(set(before) | set(after)):
        if old is None:
            lines.append(f"| {target} | {after.get(target, '-')} |")
        else:
            mark = "" if before.get(target) == after.get(target) else " **changed**"
            lines.append(f"| {target} | {before.get(target, '-')} | {after.get(target, '-')}{mark} |")
    return lines + [""]


def _code_section(old: Bundle | None, new: Bundle, fmt: str) -> list[str]:
    lines = ["## Code", ""]
    after = new.code
    if old is None:
        for name, text in after.items():
            lang = "json" if name.endswith(".json") else "python" if name.endswith(".py") else "bash"
            lines += _fence(text, lang, fmt, f"`{name}`") + [""]
        return lines
    before = old.code
    diffs = [(n, _diff(n, before.get(n, ""), after.get(n, ""))) for n in sorted(set(before) | set(after))]
    diffs = [(n, d) for n, d in diffs if d]
    if not diffs:
        return lines + ["No code changed.", ""]
    for name, diff in diffs:
        lines += _fence(diff, "diff", fmt, f"`{name}`") + [""]
    return lines


def _verification_section(old: Bundle | None, new: Bundle) -> list[str]:
    def seeds(b: Bundle | None) -> dict:
        return {s.seed: s for s in (b.verification.seeds if b and b.verification else [])}

    verdict = (lambda b: "PASSED" if b.verification and b.verification.passed else "FAILED")
    lines = ["## Verification", ""]
    tol = new.verification.tolerances if new.verification else {}
    lines.append("Tolerances: " + ", ".join(f"{k} {v:g}" for k, v in sorted(tol.items())))
    lines.append("")
    lines.append(f"Verdict: {verdict(old) + ' -> ' if old else ''}{verdict(new)}")
    lines += ["", "| seed | truth | logits max rel | loss ref / adapted | worst gradient rel | passed |",
              "|---|---|---|---|---|---|"]
    before, after = seeds(old), seeds(new)
    for seed in sorted(set(before) | set(after), key=str):
        for label, s in (("old", before.get(seed)), ("new", after.get(seed))):
            if s is None or (old is None and label == "old"):
                continue
            tag = f"{seed} ({label})" if old else f"{seed}"
            lines.append(f"| {tag} | {s.truth} | {_number(s.logits_max_rel)} | "
                         f"{_number(s.loss_ref)} / {_number(s.loss_adapted)} | "
                         f"{_number(s.grad_worst_rel)} (`{s.grad_worst_param}`) | {s.passed} |")
    m_old = {what: m for what, _, m in margins(old.verification)} if old else {}
    m_new = margins(new.verification)
    if m_new:
        lines += ["", "Margins (bound / error; below 10x needs human eyes):", ""]
        for what, tensor, margin in m_new:
            was = f" (was {_times(m_old[what])})" if what in m_old else ""
            lines.append(f"- {what}{f' ({tensor})' if tensor else ''}: {_times(margin)}{was}")
    return lines + [""]


def _plan_section(old: Bundle | None, new: Bundle) -> list[str]:
    lines = ["## Plan", ""]
    keys = ("dp_shard", "dp_replicate", "tp", "pp", "ep", "cp", "micro_batch", "grad_accum", "recompute", "offload",
            "dtype", "seq_len")

    def text(plan: dict | None) -> str:
        if not plan:
            return "none"
        out = ", ".join(f"{k} {plan.get(k)}" for k in keys if k in plan)
        predicted = plan.get("predicted") or {}
        if predicted:
            out += "; predicted " + ", ".join(f"{k} {_number(v)}" for k, v in sorted(predicted.items()))
        return out

    if old is not None and old.plan != new.plan:
        lines += [f"- old: {text(old.plan)}", f"- new: {text(new.plan)}"]
    else:
        lines.append(f"- {text(new.plan)}" + (" (unchanged)" if old is not None else ""))
    return lines + [""]
