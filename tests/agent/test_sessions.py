"""Leftovers the rules policy cannot take, turned into verified runtime code by replaying recorded llm sessions
(issue 15). The sessions in tests/agent/sessions/ were written by hand as a model's replies (no endpoint is
reachable here); replaying them runs the real LangChain agent on a scripted chat model, and the code in them
meets the same guard, probe and whole-twin verification as any other."""

from __future__ import annotations

from pathlib import Path

import pytest

from onboard.agent.loop import run
from onboard.review.families import default_config
from onboard.source import resolve
from tests.agent.common import bundle_files_are_verified

pytest.importorskip("langchain")
pytestmark = pytest.mark.slow  # four adapts with their probes: about a minute

SESSIONS = Path(__file__).with_name("sessions")
TAKEN = {  # what each session's model replaced, beyond what the rules policy takes
    "axk2": {"input_layernorm", "post_attention_layernorm"},  # a gated RMSNorm with a low-rank gate
    "longcat_flash": {"mlps.1"},  # the layer's second dense MLP
    "inkling2_text": {"attention_input", "mlp_input"},  # attention over the block states (block attention residuals)
    "zaya": {"mlp.gate"},  # a router network over experts and a skip slot, its state carried to the next layer
}


@pytest.mark.parametrize("family", sorted(TAKEN))
def test_a_recorded_llm_session_replays_into_verified_code(family, tmp_path):
    default_config(family).save_pretrained(tmp_path / family)
    # keep_slower: what is tested here is that the code verifies; the speed rule has its own test (test_agent.py)
    _, verification, agent = run(resolve(str(tmp_path / family)), tmp_path / "bundle",
                                 replay=SESSIONS / f"{family}.jsonl", keep_slower=True)
    assert verification.passed, verification.note
    by_policy = {e.path: e.policy for e in agent.decision_entries if e.takes}
    assert {path for path, policy in by_policy.items() if policy == "llm"} == TAKEN[family]
    assert verification.swaps["generated"]["made"] == verification.swaps["generated"]["expected"] > 0
    bundle_files_are_verified(tmp_path / "bundle")
