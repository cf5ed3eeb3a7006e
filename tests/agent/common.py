"""What the agent's tests share: candidate files for ZAYA's residual scaling and LongCat-Flash's second MLP
(right, wrong, cheating, endless), a scripted policy, tiny twins and a way to run one task on them, and the
check that a bundle ships no unverified generated file."""

from __future__ import annotations

import json
from pathlib import Path

from onboard.adapt.decision import decide
from onboard.agent.candidate import Candidate, propose_in_order
from onboard.agent.loop import Agent, SpeedCheck
from onboard.agent.sandbox.session import Limits
from onboard.agent.tasks import leftovers
from onboard.inspect.capture import capture
from onboard.inspect.inspection import build_spec
from onboard.review.families import default_config
from onboard.source import resolve
from onboard.twin import Twin

RIGHT_ZAYA = '''from runtime.generated import Generated
from runtime.residual import affine_sum


class Replacement(Generated):
    def forward(self, hidden_states, residual):
        return affine_sum(hidden_states, residual, self.hidden_states_scale, self.hidden_states_bias,
                          self.residual_scale, self.residual_bias)
'''
WRONG_ZAYA = RIGHT_ZAYA.replace("self.hidden_states_scale, self.hidden_states_bias",
                                "self.hidden_states_bias, self.hidden_states_scale")  # scale and bias swapped
# LongCat-Flash's second dense MLP (mlps.1), which no rules reading takes: what the llm tests ask a model for
RIGHT_LONGCAT = '''import torch.nn.functional as F

from runtime.generated import Generated


class Replacement(Generated):
    def forward(self, x):
        return F.linear(F.silu(F.linear(x, self.gate_proj.weight)) * F.linear(x, self.up_proj.weight),
                        self.down_proj.weight)
'''
WRONG_LONGCAT = RIGHT_LONGCAT.replace("self.gate_proj.weight)) * F.linear(x, self.up_proj.weight)",
                                      "self.up_proj.weight)) * F.linear(x, self.gate_proj.weight)")  # gate and up swapped
FALLBACK_LONGCAT = '''from runtime.generated import Generated
from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashMLP


class Replacement(Generated):
    def forward(self, x):
        return LongcatFlashMLP.forward(self, x)
'''
FALLBACK = '''from runtime.generated import Generated
from transformers.models.zaya.modeling_zaya import ZayaResidualScaling


class Replacement(Generated):
    def forward(self, hidden_states, residual):
        return ZayaResidualScaling.forward(self, hidden_states, residual)
'''
# right and slower by the same factor on any machine: the module's own work done nine times (x + 0 * y is x, exactly,
# for finite y), forward and backward (extra passes of another op, tanh, cost 0.08x on the AVX2 kind and 0.6x on
# the AVX-512 one)
SLOW_ZAYA = RIGHT_ZAYA.replace("        return affine_sum(", "        out = affine_sum(").replace(
    "self.residual_scale, self.residual_bias)\n",
    "self.residual_scale, self.residual_bias)\n        for _ in range(8):\n"
    "            out = out + 0 * affine_sum(hidden_states, residual, self.hidden_states_scale, "
    "self.hidden_states_bias, self.residual_scale, self.residual_bias)\n        return out\n")
CHATTY_ZAYA = RIGHT_ZAYA.replace("        return affine_sum(", "        for i in range(2000):\n"
                                 "            print('debugging line', i, 'x' * 100)\n        return affine_sum(")  # right
# PhiMoE's router as the rules render it (runtime.moe.sparse_mixer), written out
RIGHT_PHIMOE_ROUTER = '''import torch.nn.functional as F

from runtime.generated import Generated
from runtime.moe.sparse_mixer import jitter_input_, sparse_mixer


class Replacement(Generated):
    def forward(self, hidden_states):
        if self.training and self.input_jitter_noise > 0:
            jitter_input_(hidden_states, self.input_jitter_noise)
        logits = F.linear(hidden_states, self.weight)
        weights, experts = sparse_mixer(logits, self.router_jitter_noise, self.training)
        return logits, weights, experts
'''
EVAL_ONLY_PHIMOE_ROUTER = RIGHT_PHIMOE_ROUTER.replace("self.router_jitter_noise, self.training)",
                                                      "self.router_jitter_noise, False)")  # no sampling in training
LOOPS = RIGHT_ZAYA.replace("        return affine_sum(", "        while True:\n            pass\n        return affine_sum(")


class Scripted:
    """A policy that proposes fixed code, round by round (what a model's replies would be)."""

    name = "scripted"

    def __init__(self, *codes: str):
        self.codes = codes

    def run(self, task, module, trial, record):
        propose_in_order([Candidate(f"scripted {i + 1}", "a residual sum with an affine map per side", code, self.name)
                          for i, code in enumerate(self.codes)], trial)


def bundle_files_are_verified(bundle: Path) -> None:
    """Every generated file in a bundle has a decision entry that takes it and the bundle verified."""
    decision = json.loads((bundle / "decision.json").read_text())
    verification = json.loads((bundle / "verification.json").read_text())
    taken = {e["file"] for e in decision["generated"] if e["takes"]}
    files = {p.name for p in (bundle / "generated").glob("*")} if (bundle / "generated").exists() else set()
    assert files == taken
    assert not files or verification["passed"]


def family_twin(family: str, folder: Path):
    """The family's default config saved in `folder`: (source, twin, spec)."""
    default_config(family).save_pretrained(folder)
    source = resolve(str(folder))
    twin = Twin.build(source)
    spec = build_spec(twin, capture(twin))
    return source, twin, spec


def take_on(model, policy, tmp_path, rounds=3, limits=Limits(), speed=SpeedCheck(), path=None):
    """Run the task at `path` (default: the first) of `model` (a `family_twin`) with `policy` (a ReplayPolicy
    brings its recorded timing verdicts): (entry, agent, staging)."""
    source, twin, spec = model
    agent = Agent(policy, source, rounds=rounds, limits=limits, speed=speed)
    agent.recorded_speed = getattr(policy, "speed", {})
    tasks = leftovers(spec, twin.model, decide(spec, twin))
    task = next(t for t in tasks if t.path == path) if path else tasks[0]
    staging = tmp_path / "staging"
    staging.mkdir(parents=True)
    try:
        return agent.attempt(task, spec, twin, staging), agent, staging
    finally:
        agent.close()


