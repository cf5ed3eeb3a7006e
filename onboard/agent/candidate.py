"""A candidate replacement (what a policy proposes for one task in one round), and how policies propose.

A policy has a `name` and `run(task, module, trial, record)`: it proposes candidates by calling
`trial(candidate)`, which checks, probes and records each one and answers with its outcome (`outcome` in
words, `stop` when the task is settled or its rounds are spent); the loop, not the policy, decides what a
round costs and when it ends. `record(event, **fields)` adds to the session's record what only the policy
sees (a model's requests and replies). `propose_in_order` runs a policy whose candidates are a list worked through in order.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    reading: str  # the policy's name for what it read the module as
    hypothesis: str  # what the module computes, in words
    code: str  # a generated file: class Replacement(runtime.generated.Generated)
    policy: str  # "rules", "llm"


def propose_in_order(candidates, trial) -> None:
    """Try `candidates` in order until one passes or the budget stops it."""
    for candidate in candidates:
        if trial(candidate)["stop"]:
            return
