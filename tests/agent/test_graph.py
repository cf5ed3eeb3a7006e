"""The graph judge's reading (`onboard.agent.sandbox.graph`), in this process on plain modules: a candidate's
graph is refused for what the module's own graph lacks (random draws, a grad-mode switch, a detach, an in-place
change, a size it specialises, a branch on a value), and one computing the same operations is not. Through the
sandbox and the jail, the same refusals are in tests/agent/test_cheats.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from onboard.agent.sandbox.graph import capture, refusals


class Module(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(8))
        self.register_buffer("seen", torch.zeros(8))

    def forward(self, hidden, residual):
        return hidden * self.scale + residual


class Same(Module):  # the same computation, written otherwise
    def forward(self, hidden, residual):
        return torch.addcmul(residual, hidden, self.scale)


class Detaches(Module):
    def forward(self, hidden, residual):
        return hidden.detach() * self.scale + hidden * self.scale.detach() - (hidden * self.scale).detach() + residual


class Noisy(Module):
    def forward(self, hidden, residual):
        return hidden * self.scale + residual + torch.randn_like(hidden) * 1e-6


class NoGrad(Module):
    def forward(self, hidden, residual):
        with torch.no_grad():
            scaled = hidden * self.scale
        return scaled + residual


class Counts(Module):
    def forward(self, hidden, residual):
        self.seen.add_(1)
        return hidden * self.scale + residual


class Grows(Module):
    def forward(self, hidden, residual):
        with torch.no_grad():
            self.scale.mul_(1.00005)
        return hidden * self.scale + residual


class Long(Module):
    def forward(self, hidden, residual):
        out = hidden * self.scale + residual
        return out if hidden.shape[1] <= 4096 else out * 0.5


class Valued(Module):
    def forward(self, hidden, residual):
        out = hidden * self.scale + residual
        return out if float(hidden.abs().max()) < 1e5 else out * 0.5


ARGS = (torch.randn(2, 17, 8), torch.randn(2, 17, 8))


@pytest.fixture(scope="module")
def reference():
    return {mode: capture(Module(), ARGS, {}, training=mode == "train") for mode in ("eval", "train")}


def test_the_same_computation_is_not_refused_and_prints_a_graph(reference):
    for mode in ("eval", "train"):
        mine = capture(Same(), ARGS, {}, training=mode == "train")
        assert refusals(mine, reference[mode]) == [] and "def forward" in mine["code"] and len(mine["digest"]) == 64
        assert mine["sizes"]["input 0 dim 1"] == [2, None]  # the sequence stays symbolic, unbounded


@pytest.mark.parametrize("cls, words", [
    (Detaches, "detaches a tensor"), (Noisy, "draws random numbers"), (NoGrad, "switches gradient mode"),
    (Counts, "changes in place what the module does not (buffer mutation of seen)"),
    (Grows, "parameter mutation of scale"), (Long, "specialises sizes the module leaves free (input 0 dim 1"),
    (Valued, "cannot be captured whole"),
])
def test_a_graph_holding_what_the_module_lacks_is_refused(cls, words, reference):
    why = refusals(capture(cls(), ARGS, {}, training=False), reference["eval"])
    assert any(words in w for w in why), why


def test_what_the_module_itself_does_a_candidate_may_do():
    """Refusals are relative: a module that draws (dropout in training) or counts leaves its candidate free to."""
    theirs = capture(Noisy(), ARGS, {}, training=True)
    assert refusals(capture(Noisy(), ARGS, {}, training=True), theirs) == []
    assert refusals(capture(Counts(), ARGS, {}, training=False), capture(Counts(), ARGS, {}, training=False)) == []
