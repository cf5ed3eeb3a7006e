"""`onboard adapt`: inspect, decide, render the adapter, verify it, and write the bundle atomically.

Bundle (`onboard.bundle.files.FILES`): spec.json, source.json, decision.json (what the runtime takes and why
the rest stays HuggingFace code), adapter.py, kernels.json (the kernel store keys it loads, with their
templates and parameters), verification.json, REVIEW.md, plan.json (`plan`, or one process by default) and
train.sh (its torchrun command). Rendered kernels go to the runtime's kernel store (`runtime.kernels.store`).
The bundle is written into a staging directory beside the target and moved into place only when complete
(`onboard.bundle.target`: what `force` may replace, the check under a lock right before the move, and what a
killed run left behind). The trials of rendering and verifying run in `onboard.bundle.render`, in the order
`onboard.adapt.settle` asks for; what verification said is written by `onboard.bundle.verdict`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from onboard.adapt.decision import decide
from onboard.adapt.settle import trials
from onboard.adapt.verify import Verification
from onboard.bundle import provenance
from onboard.bundle.launcher import write_launcher
from onboard.bundle.render import render_and_verify
from onboard.bundle.source_record import SourceRecord
from onboard.bundle.target import check_target, move_into_place, staging_for, tidy
from onboard.bundle.verdict import write_verification
from onboard.inspect.capture import capture
from onboard.inspect.inspection import build_spec
from onboard.inspect.spec import ModelSpec
from onboard.source import ModelSource
from onboard.twin import Twin
from runtime.kernels import store as kernel_store


def adapt(source: ModelSource, out: Path, *, force: bool = False, plan=None,
          notes: list[str] | None = None, agent=None) -> tuple[ModelSpec, Verification]:
    """Adapt `source` into a bundle at `out` (see onboard.bundle.target for what --force may replace); `notes`
    collects what was put right of a killed earlier run. `agent` (`onboard.agent.loop.Agent`) takes on the
    leftovers after deciding, and again after verifying for what verification's refusals left over
    (`onboard.adapt.settle`); its generated modules are verified with the rest."""
    protect = (source.path,) if source.kind in ("local", "hf-cache", "hub") else ()
    out = check_target(out, force=force, protect=protect)
    kernel_store.check_writable()
    done = tidy(out)
    if notes is not None:
        notes.extend(done)
    out = check_target(out, force=force, protect=protect)  # tidying may have moved a bundle back
    twin = Twin.build(source)
    spec = build_spec(twin, capture(twin))
    decision = decide(spec, twin)
    staging = staging_for(out)
    try:
        (staging / "spec.json").write_text(spec.to_json())
        (staging / "source.json").write_text(SourceRecord.of(source).to_json())
        loader = agent.loader if agent is not None else None  # generated code runs in the agent's sandbox
        verification = render_and_verify(staging, spec, twin, trials(decision, spec, twin, staging, agent), loader)
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
