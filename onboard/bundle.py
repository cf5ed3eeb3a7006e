"""`onboard adapt`: inspect, decide, render the adapter, verify it, and write the bundle atomically.

Bundle (`onboard.bundle_files.FILES`): spec.json, source.json, decision.json (what the runtime takes and why
the rest stays HuggingFace code), adapter.py, kernels.json (the kernel store keys it loads, with their
templates and parameters), verification.json, REVIEW.md, plan.json (`plan`, or one process by default) and
train.sh (its torchrun command). Rendered kernels go to the runtime's kernel store (`runtime.kernels.store`).
The bundle is written into a staging directory beside the target and moved into place only when complete
(`onboard.placement`: what `force` may replace, the check under a lock right before the move, and what a
killed run left behind).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from onboard.bundle_files import bundle_source, load_adapter, read_bundle, read_decision
from onboard.capture import capture
from onboard.codegen import render_adapter, render_kernels, render_review
from onboard.decision import Decision, decide
from onboard.errors import OnboardError
from onboard.inspection import build_spec
from onboard import provenance
from onboard.placement import check_target, place, staging_for, tidy
from onboard.source import ModelSource
from onboard.spec import ModelSpec
from onboard.train import write_launcher
from onboard.twin import Twin, build_twin
from onboard.verify import Verification, verify
from runtime.kernels import store


def adapt(source: ModelSource, out: Path, *, force: bool = False, plan=None,
          notes: list[str] | None = None, agent=None) -> tuple[ModelSpec, Verification]:
    """Adapt `source` into a bundle at `out` (see onboard.placement for what --force may replace); `notes`
    collects what was put right of a killed earlier run. `agent` (`onboard.agent.loop.Agent`) takes on the
    leftovers after deciding, and again after verifying for what verification's refusals left over; its
    generated modules are verified with the rest."""
    protect = (source.path,) if source.kind in ("local", "hf-cache", "hub") else ()
    out = check_target(out, force=force, protect=protect)
    done = tidy(out)
    if notes is not None:
        notes.extend(done)
    out = check_target(out, force=force, protect=protect)  # tidying may have moved a bundle back
    twin = build_twin(source)
    spec = build_spec(source, twin, capture(twin))
    decision = decide(spec, twin)
    staging = staging_for(out)
    try:
        (staging / "spec.json").write_text(spec.to_json())
        (staging / "source.json").write_text(json.dumps(
            {"ref": source.ref, "kind": source.kind, "trust_remote_code": source.trust_remote_code},
            indent=2, sort_keys=True) + "\n")
        if agent is not None:
            agent.take_on(spec, twin, decision, staging)
        verification = _settle(staging, spec, twin, decision)
        if agent is not None and agent.take_on(spec, twin, decision, staging):  # what verification's refusals left
            verification = _settle(staging, spec, twin, decision)
        if agent is not None and agent.finish(decision, verification, staging):
            verification = _render_and_verify(staging, spec, twin, decision)
        write_verification(staging, spec, twin, decision, verification)
        write_launcher(staging, plan)
        provenance.write(staging, source)
        place(staging, out, force=force, protect=protect)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return spec, verification


def _settle(staging: Path, spec: ModelSpec, twin: Twin, decision: Decision) -> Verification:
    """Render and verify; while the bundle fails, give back what the runtime takes, one target at a time in
    `decision.suspects()` order (readings only verification can confirm first, then whole MoE blocks, which
    fall back to their experts alone, experts, attention), recording why. Once it verifies, each refusal but
    the last is taken back to see whether it was needed, so a part is left as HuggingFace code only when
    verification says so."""
    verification = _render_and_verify(staging, spec, twin, decision)
    refused: list[str] = []
    while not verification.passed and (suspects := decision.suspects()):
        target = suspects[0]
        decision.refuse(target, f"{decision.reading(target)} did not verify ({_failure_detail(verification)})")
        refused.append(target)
        verification = _render_and_verify(staging, spec, twin, decision)
    if not verification.passed:
        return verification
    for target in refused[:-1]:  # the last refusal is the one that made it verify
        why = decision.refused[target]
        decision.admit(target)
        trial = _render_and_verify(staging, spec, twin, decision)
        if trial.passed:
            verification = trial
        else:
            decision.refuse(target, why)
            verification = _render_and_verify(staging, spec, twin, decision)
    return verification


def _failure_detail(verification: Verification) -> str:
    if not verification.seeds:
        return verification.note
    seeds = verification.seeds
    return (f"max relative logits difference {max(r.logits_max_rel for r in seeds):.1e}, "
            f"loss {max(abs(r.loss_ref - r.loss_adapted) for r in seeds):.1e}")


def _render_and_verify(staging: Path, spec: ModelSpec, twin: Twin, decision: Decision) -> Verification:
    kernels = render_kernels(spec, decision)
    for kernel in kernels:
        store.put(kernel.key, kernel.text)
    (staging / "kernels.json").write_text(json.dumps([k.record() for k in kernels], indent=2, sort_keys=True) + "\n")
    (staging / "adapter.py").write_text(render_adapter(spec, decision, [k.key for k in kernels]))
    return verify(spec, twin, load_adapter(staging).adapt, decision)


def write_verification(directory: Path, spec: ModelSpec, twin: Twin, decision: Decision,
                       verification: Verification) -> None:
    """decision.json (with what verification refused), verification.json and REVIEW.md."""
    (directory / "decision.json").write_text(decision.to_json())
    (directory / "verification.json").write_text(json.dumps(verification.to_dict(), indent=2, sort_keys=True) + "\n")
    twin_size = {"hidden": twin.hidden_size, "layers": len(twin.layer_signatures), "fields": twin.fields,
                 "why": twin.why_probed, "full_width": twin.full_width}
    (directory / "REVIEW.md").write_text(render_review(spec, decision, verification, twin_size))


def verify_bundle(directory: Path, *, trust_remote_code: bool = False) -> tuple[ModelSpec, Verification]:
    """Re-run verification of an existing bundle against its own decision (rewrites verification.json and
    REVIEW.md). Runs the bundle's adapter.py; the model's own code runs only with `trust_remote_code`, given
    by the caller, never read from the bundle."""
    directory, _, origin = read_bundle(directory)
    try:
        spec = ModelSpec.from_json((directory / "spec.json").read_text())
    except (ValueError, KeyError, TypeError) as exc:
        raise OnboardError(f"{directory}: unreadable bundle ({exc})") from None
    decision = read_decision(directory)
    twin = build_twin(bundle_source(origin, trust_remote_code))
    verification = verify(spec, twin, load_adapter(directory).adapt, decision)
    write_verification(directory, spec, twin, decision, verification)
    return spec, verification
