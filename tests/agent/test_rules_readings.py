"""The rules' readings on configs other than the defaults (issue 36): PhiMoE's router whatever its top-k and
jitter settings say (its mixer picks two experts in rounds regardless), a router with more to it than a projection
(Inkling's) declined with the tensors that rule it out named, the declines recorded and replayed; and the probe
hands a module activations, not leaves, so a module that scales its input in place runs as inside a model."""

from __future__ import annotations

import torch
from torch import nn

from onboard.agent.candidate import Candidate
from onboard.agent.loop import Agent
from onboard.agent.record import ReplayPolicy
from onboard.agent.rules import Declined, RulesPolicy, sparse_mixer_router
from onboard.agent.sandbox.calls import Call, cotangents_for
from onboard.agent.tasks import Task
from onboard.review.families import default_config
from onboard.source import resolve

TASK = Task("mlp.gate", "Router", (0,), (0,), "routing the runtime's block does not compute")


def _inkling_router():
    from transformers.models.inkling.modeling_inkling import InklingTopkRouter

    config = default_config("inkling_text")
    config.hidden_size, config.n_routed_experts, config.n_shared_experts = 32, 8, 1
    return InklingTopkRouter(config)


def _phimoe_router(**settings):
    from transformers.models.phimoe.modeling_phimoe import PhimoeTopKRouter

    config = default_config("phimoe")
    config.hidden_size, config.num_local_experts = 32, 6
    for key, value in settings.items():
        setattr(config, key, value)
    return PhimoeTopKRouter(config)


def test_a_router_with_more_than_its_projection_is_declined_naming_what_it_holds():
    out = list(sparse_mixer_router(TASK, _inkling_router()))
    assert len(out) == 1 and isinstance(out[0], Declined)
    assert "`global_scale`" in out[0].why and "`e_score_correction_bias`" in out[0].why and "`weight`" in out[0].why


def test_phimoe_router_is_read_whatever_its_top_k_and_jitter_settings():
    for settings in ({}, {"num_experts_per_tok": 4, "input_jitter_noise": 0.02, "router_jitter_noise": 0.05}):
        out = list(sparse_mixer_router(TASK, _phimoe_router(**settings)))
        assert out and all(isinstance(c, Candidate) for c in out), settings
    # with an input jitter set, the candidates that jitter the input come first after the band's epsilon
    jittered = list(sparse_mixer_router(TASK, _phimoe_router(input_jitter_noise=0.02)))
    assert any("inputs jittered by `input_jitter_noise`" in c.hypothesis for c in jittered)


def test_declines_are_recorded_said_and_replayed():
    events, tried = [], []

    def record(event, **fields):
        events.append({"event": event, **fields})

    def trial(candidate):
        tried.append(candidate)
        return {"stop": False}

    said = RulesPolicy().run(TASK, _inkling_router(), trial, record)
    assert tried == [] and len(said) == 1 and said[0].startswith("sparse_mixer_router: besides its projection")
    assert [e["event"] for e in events] == ["declined"]
    # a replay of the session says the same, and records it again
    replay = ReplayPolicy([{"event": "session", "policy": "rules"}, *events])
    again = []
    assert replay.run(TASK, None, trial, lambda event, **f: again.append({"event": event, **f})) == said
    assert again == events


class _ScalesInPlace(nn.Module):
    """Multiplies its input in place in training, as PhiMoE's and DBRX's routers jitter theirs."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        if self.training:
            x *= 2.0
        return x @ self.weight


def test_the_probe_gives_a_module_activations_not_leaves():
    x = torch.randn(3, 4)
    module = _ScalesInPlace().train()
    cotangents = cotangents_for([torch.empty(3, 4)], 0)
    call = Call(module, (x,), {}, grad=True, cotangents=cotangents)
    call.run()  # in place on a leaf that needs a gradient, this raised
    assert torch.equal(call.state()["s:input 0"], 2 * x)  # what the caller's tensor holds after the call
    assert torch.allclose(call.grads()["g:input 0"], 2 * cotangents[0] @ module.weight.detach().T)


def test_the_probe_finds_a_model_given_as_a_relative_directory(tmp_path, monkeypatch):
    """The probe's process runs in a scratch directory of its own: it gets the model's directory in full."""
    default_config("phimoe").save_pretrained(tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    agent = Agent(RulesPolicy(), resolve("model"), speed=None)
    ref = agent._model_ref(tmp_path / "scratch")
    assert ref == str((tmp_path / "model").resolve()) and (tmp_path / "model" / "config.json").exists()
