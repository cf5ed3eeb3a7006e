"""A candidate replacement: what a policy proposes for one task in one round."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    reading: str  # the policy's name for what it read the module as
    hypothesis: str  # what the module computes, in words
    code: str  # a generated file: class Replacement(runtime.generated.Generated)
    policy: str  # "rules", "llm"
