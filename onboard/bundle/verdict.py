"""What verification said, written into a bundle: decision.json (with what verification refused),
verification.json, and REVIEW.md for the reviewer (`onboard.adapt.codegen.render_review`)."""

from __future__ import annotations

from pathlib import Path

from onboard.adapt.codegen import render_review
from onboard.adapt.decision import Decision
from onboard.adapt.verify import Verification
from onboard.inspect.spec import ModelSpec
from onboard.twin import Twin


def write_verification(directory: Path, spec: ModelSpec, twin: Twin, decision: Decision,
                       verification: Verification) -> None:
    """decision.json (with what verification refused), verification.json and REVIEW.md."""
    (directory / "decision.json").write_text(decision.to_json())
    (directory / "verification.json").write_text(verification.to_json())
    twin_size = {"hidden": twin.hidden_size, "layers": len(twin.layer_signatures), "fields": twin.fields,
                 "why": twin.why_probed, "full_width": twin.full_width}
    (directory / "REVIEW.md").write_text(render_review(spec, decision, verification, twin_size))
