"""`onboard verify BUNDLE`: verification of an existing bundle run again against its own decision (rewrites
verification.json and REVIEW.md). An agent's bundle has its generated code run in the agent's sandbox."""

from __future__ import annotations

import inspect
from pathlib import Path

from onboard.adapt.verify import Verification, verify
from onboard.bundle.files import bundle_source, load_adapter, read_bundle, read_decision
from onboard.bundle.render import sandboxed
from onboard.bundle.verdict import write_verification
from onboard.errors import OnboardError
from onboard.inspect.spec import ModelSpec
from onboard.twin import Twin


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
    twin = Twin.build(bundle_source(origin, trust_remote_code))
    adapter = load_adapter(directory).adapt
    if "load_generated" in inspect.signature(adapter).parameters:  # an agent's bundle: its generated code sandboxed
        from onboard.agent.sandbox.remote import Host
        from onboard.agent.sandbox.session import Sandbox

        with Sandbox() as sandbox, Host(sandbox) as host:
            verification = verify(spec, twin, sandboxed(adapter, lambda: host.load), decision.taken())
    else:
        verification = verify(spec, twin, adapter, decision.taken())
    write_verification(directory, spec, twin, decision, verification)
    return spec, verification
