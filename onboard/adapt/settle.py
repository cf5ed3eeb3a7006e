"""The order of an adapt run's render-and-verify trials: what the runtime takes in each, decided from how the
last one verified.

`trials(decision, spec, twin, staging, agent)` is a generator. It yields what the runtime takes in the next trial
(`Decision.taken()`), is sent that trial's `Verification`, and returns the verification the bundle keeps; the
caller renders and verifies (`onboard.bundle.make`), this module only decides:

- while the bundle fails, it gives back what the runtime takes, one target at a time in `decision.suspects()`
  order (the agent's generated modules, then readings only verification can confirm, then whole MoE blocks,
  which fall back to their experts alone, experts, attention), recording why;
- once it verifies, each refusal but the last is taken back to see whether it was needed, so a part is left as
  HuggingFace code only when verification says so;
- with an agent (`onboard.agent.loop.Agent`, passed in, never imported: adapt does not depend on the agent), the
  agent takes on the leftovers as decided, and again after the first settling for what verification's refusals
  left over; a bundle that failed as a whole loses the generated modules that were in it (`Agent.finish`) and is
  rendered and verified once more.
"""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path

from onboard.adapt.decision import Decision, Taken
from onboard.adapt.verify import Verification
from onboard.inspect.spec import ModelSpec
from onboard.twin import Twin

Trials = Generator[Taken, Verification, Verification]


def trials(decision: Decision, spec: ModelSpec, twin: Twin, staging: Path, agent=None) -> Trials:
    """Every trial an adapt run needs, the agent's rounds included (module docstring)."""
    verification = None
    for first in (True, False):  # as decided, then what verification's refusals left over
        offered = agent is not None and agent.take_on(spec, twin, decision, staging)
        if first or offered:  # the second round only where a new generated module passed its own checks
            verification = yield from settle(decision)
    if agent is not None and agent.finish(decision, verification, staging):
        verification = yield decision.taken()
    return verification


def settle(decision: Decision) -> Trials:
    """Give back what fails verification, then take back each refusal verification did not need."""
    verification = yield decision.taken()
    refused: list[str] = []
    while not verification.passed and (suspects := decision.suspects()):
        target = suspects[0]
        decision.refuse(target, f"{decision.reading(target)} did not verify ({failure_detail(verification)})")
        refused.append(target)
        verification = yield decision.taken()
    if not verification.passed:
        return verification
    for target in refused[:-1]:  # the last refusal is the one that made it verify
        why = decision.refused[target]
        decision.admit(target)
        trial = yield decision.taken()
        if trial.passed:
            verification = trial
        else:
            decision.refuse(target, why)
            verification = yield decision.taken()  # the files on disk back to the bundle that verified
    return verification


def failure_detail(verification: Verification) -> str:
    """Why a trial failed, in the words a refusal records: the check that failed, not figures that passed."""
    if not verification.seeds:
        return verification.note
    reasons = [verification.note] if verification.note else []
    for r in verification.seeds:
        if r.passed:
            continue
        if r.original_calls:
            reasons.append(f"seed {r.seed}: the HuggingFace code it replaces still ran ({r.original_calls} calls)")
        if r.grad_failures:
            more = f" and {len(r.grad_failures) - 1} more" if len(r.grad_failures) > 1 else ""
            reasons.append(f"seed {r.seed}: {r.grad_failures[0]}{more}")
        if not r.original_calls and not r.grad_failures and not verification.note:
            reasons.append(f"seed {r.seed}: max relative logits difference {r.logits_max_rel:.1e}, "
                           f"loss {abs(r.loss_ref - r.loss_adapted):.1e}")
        break  # the first failing seed says enough
    return "; ".join(reasons) or "verification failed (see verification.json)"
