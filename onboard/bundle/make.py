"""`onboard adapt`: inspect, decide, render the adapter, verify it, and write the bundle atomically.

Bundle (`onboard.bundle.files.FILES`): spec.json, source.json, decision.json (what the runtime takes and why
the rest stays HuggingFace code), adapter.py, kernels.json (the kernel store keys it loads, with their
templates and parameters), verification.json, REVIEW.md, plan.json (`plan`, or one process by default) and
train.sh (its torchrun command). Rendered kernels go to the runtime's kernel store (`runtime.kernels.store`).
The bundle is written into a staging directory beside the target and moved into place only when complete
(`onboard.bundle.target`: what `force` may replace, the check under a lock right before the move, and what a
killed run left behind).
"""

from __future__ import annotations

import functools
import inspect
import shutil
from pathlib import Path

from onboard.adapt.codegen import render_adapter, render_kernels, render_review
from onboard.adapt.decision import Decision, decide
from onboard.adapt.verify import Verification, verify
from onboard.bundle import provenance
from onboard.bundle.files import load_adapter
from onboard.bundle.kernel_list import KernelList, KernelRecord
from onboard.bundle.launcher import write_launcher
from onboard.bundle.source_record import SourceRecord
from onboard.bundle.target import check_target, move_into_place, staging_for, tidy
from onboard.inspect.capture import capture
from onboard.inspect.inspection import build_spec
from onboard.inspect.spec import ModelSpec
from onboard.source import ModelSource
from onboard.twin import Twin
from runtime.kernels import store


def adapt(source: ModelSource, out: Path, *, force: bool = False, plan=None,
          notes: list[str] | None = None, agent=None) -> tuple[ModelSpec, Verification]:
    """Adapt `source` into a bundle at `out` (see onboard.bundle.target for what --force may replace); `notes`
    collects what was put right of a killed earlier run. `agent` (`onboard.agent.loop.Agent`) takes on the
    leftovers after deciding, and again after verifying for what verification's refusals left over; its
    generated modules are verified with the rest."""
    protect = (source.path,) if source.kind in ("local", "hf-cache", "hub") else ()
    out = check_target(out, force=force, protect=protect)
    done = tidy(out)
    if notes is not None:
        notes.extend(done)
    out = check_target(out, force=force, protect=protect)  # tidying may have moved a bundle back
    twin = Twin.build(source)
    spec = build_spec(source, twin, capture(twin))
    decision = decide(spec, twin)
    staging = staging_for(out)
    try:
        (staging / "spec.json").write_text(spec.to_json())
        (staging / "source.json").write_text(SourceRecord.of(source).to_json())
        loader = agent.loader if agent is not None else None  # generated code runs in the agent's sandbox
        if agent is not None:
            agent.take_on(spec, twin, decision, staging)
        verification = _settle(staging, spec, twin, decision, loader)
        if agent is not None and agent.take_on(spec, twin, decision, staging):  # what verification's refusals left
            verification = _settle(staging, spec, twin, decision, loader)
        if agent is not None and agent.finish(decision, verification, staging):
            verification = _render_and_verify(staging, spec, twin, decision, loader)
        write_verification(staging, spec, twin, decision, verification)
        write_launcher(staging, plan)
        provenance.write(staging, source)
        kept = move_into_place(staging, out, force=force, protect=protect)
        if notes is not None and kept:
            notes.append(f"kept {', '.join(kept)} from the bundle it replaced (not onboard's: moved into the new one)")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        if agent is not None:
            agent.close()
    return spec, verification


def _settle(staging: Path, spec: ModelSpec, twin: Twin, decision: Decision, loader=None) -> Verification:
    """Render and verify; while the bundle fails, give back what the runtime takes, one target at a time in
    `decision.suspects()` order (readings only verification can confirm first, then whole MoE blocks, which
    fall back to their experts alone, experts, attention), recording why. Once it verifies, each refusal but
    the last is taken back to see whether it was needed, so a part is left as HuggingFace code only when
    verification says so."""
    verification = _render_and_verify(staging, spec, twin, decision, loader)
    refused: list[str] = []
    while not verification.passed and (suspects := decision.suspects()):
        target = suspects[0]
        decision.refuse(target, f"{decision.reading(target)} did not verify ({_failure_detail(verification)})")
        refused.append(target)
        verification = _render_and_verify(staging, spec, twin, decision, loader)
    if not verification.passed:
        return verification
    for target in refused[:-1]:  # the last refusal is the one that made it verify
        why = decision.refused[target]
        decision.admit(target)
        trial = _render_and_verify(staging, spec, twin, decision, loader)
        if trial.passed:
            verification = trial
        else:
            decision.refuse(target, why)
            verification = _render_and_verify(staging, spec, twin, decision, loader)
    return verification


def _failure_detail(verification: Verification) -> str:
    if not verification.seeds:
        return verification.note
    seeds = verification.seeds
    return (f"max relative logits difference {max(r.logits_max_rel for r in seeds):.1e}, "
            f"loss {max(abs(r.loss_ref - r.loss_adapted) for r in seeds):.1e}")


def _render_and_verify(staging: Path, spec: ModelSpec, twin: Twin, decision: Decision, loader=None) -> Verification:
    """Render the adapter and verify it; `loader` (a callable giving the loader of generated files) runs the
    generated modules in a sandbox rather than in this process."""
    kernels = render_kernels(spec, decision)
    for kernel in kernels:
        store.put(kernel.key, kernel.text)
    (staging / "kernels.json").write_text(KernelList([KernelRecord(**k.record()) for k in kernels]).to_json())
    (staging / "adapter.py").write_text(render_adapter(spec, decision, [k.key for k in kernels]))
    return verify(spec, twin, sandboxed(load_adapter(staging).adapt, loader), decision)


def sandboxed(adapt, loader):
    """`adapt` with its generated modules loaded by `loader()` (which runs them in the agent's sandbox), where the
    adapter has generated modules; as it is otherwise."""
    if loader is None or "load_generated" not in inspect.signature(adapt).parameters:
        return adapt
    return functools.partial(adapt, load_generated=loader())


def write_verification(directory: Path, spec: ModelSpec, twin: Twin, decision: Decision,
                       verification: Verification) -> None:
    """decision.json (with what verification refused), verification.json and REVIEW.md."""
    (directory / "decision.json").write_text(decision.to_json())
    (directory / "verification.json").write_text(verification.to_json())
    twin_size = {"hidden": twin.hidden_size, "layers": len(twin.layer_signatures), "fields": twin.fields,
                 "why": twin.why_probed, "full_width": twin.full_width}
    (directory / "REVIEW.md").write_text(render_review(spec, decision, verification, twin_size))
