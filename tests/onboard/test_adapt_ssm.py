"""State-space, lightning and short-conv hybrids adapt end to end: Mamba2 mixers (NemotronH, GraniteMoeHybrid),
Mamba1 mixers (Jamba), MiniMax's lightning attention and LFM3's gated short convs run on the runtime's sequence
cores beside its MoE blocks and loss, and verification catches a wrong decay (or conv shift) in any of them.

Models are transformers' own families at their default configs, as `onboard families` inspects them."""

import copy
import importlib

import pytest
import torch

from onboard.adapt.verify import verify

# the modules (the package exports functions of the same names)
linear_core, lightning, selective_scan, ssd = (importlib.import_module(f"runtime.attention.{name}")
                                               for name in ("linear_core", "lightning", "selective_scan", "ssd"))

FAMILIES = {"minimax": "lightning", "nemotron_h": "ssd_chunk_scan", "granitemoehybrid": "ssd_chunk_scan",
            "jamba": "selective_scan", "lfm3": "short_conv"}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, twin_adapter):
    return (request.param, *twin_adapter(tmp_path_factory.mktemp(request.param), family=request.param))


def test_mixers_moe_and_loss_run_in_the_runtime(family):
    name, spec, twin, decision, adapt = family
    assert not decision.kept_attention(), decision.kept_attention()
    mixers = [layer.index for layer in spec.layers if layer.attention.kind.startswith(("ssm:", "linear:", "conv"))]
    assert sorted(i for e in decision.swapped_attention() for i in e.layers) == mixers
    result = verify(spec, twin, adapt, decision.taken(), seeds=(0, 1))
    assert result.passed, result.note or [r.grad_failures for r in result.seeds]
    assert result.replaced == result.expected >= (0 if name == "lfm3" else 1)  # LFM3's MLPs are dense
    for r in result.seeds:
        assert r.runtime_attention_calls > 0 and r.runtime_loss_calls == 1 and r.original_calls == 0
    # each mixer's sequence core itself ran (not only the causal conv beside it)
    model = copy.deepcopy(twin.model).eval()
    swaps = adapt(model, chunk_size=8)
    with torch.no_grad():
        model(**{k: v for k, v in twin.example_batch(0).items() if k != "labels"}, use_cache=False)
    mixer_swaps = swaps.of("linear_core")
    assert len(mixer_swaps) == sum(1 for i in mixers if i < len(model.get_submodule(twin.layers_path)))
    assert all(s.calls[FAMILIES[name]] == 1 for s in mixer_swaps), [s.calls for s in mixer_swaps]


def _wrong_decay(core, position, dim):
    def wrong(*args, **kwargs):
        args = list(args)
        args[position] = args[position].roll(1, dims=dim)
        return core(*args, **kwargs)
    return wrong


def _selective_late(core):
    def late(hidden_states, dt, *args, **kwargs):
        return core(hidden_states, dt.roll(1, dims=-1), *args, **kwargs)
    return late


def _conv_late(conv):
    def late(hidden_states, *args, **kwargs):
        return conv(hidden_states, *args, **kwargs).roll(1, dims=-1)  # each token gets the previous one's
    return late


def test_a_wrong_decay_fails_verification(family, monkeypatch):
    """Mamba's decay one token late; lightning's (constant in time) that of the neighbouring head; a short
    conv mixer's output one token late."""
    name, spec, twin, decision, adapt = family
    if FAMILIES[name] == "short_conv":
        monkeypatch.setattr(linear_core, "causal_conv1d", _conv_late(linear_core.causal_conv1d))
    elif FAMILIES[name] == "selective_scan":
        monkeypatch.setattr(selective_scan, "selective_scan", _selective_late(selective_scan.selective_scan))
    elif FAMILIES[name] == "lightning":  # the decay (H,) of the neighbouring head
        monkeypatch.setattr(lightning, "chunk_constant_decay", _wrong_decay(lightning.chunk_constant_decay, 1, 0))
    else:  # the decay (B, T, H) of the previous token
        monkeypatch.setattr(ssd, "chunk_scalar_decay", _wrong_decay(ssd.chunk_scalar_decay, 3, 1))
    result = verify(spec, twin, adapt, decision.taken(), seeds=(0,))
    assert not result.passed


def test_a_mixer_whose_scan_stays_huggingface_code_fails_verification(family, monkeypatch):
    """The conv beside a scan does not count: if only the conv runs in the runtime, the mixer was not swapped."""
    name, spec, twin, decision, adapt = family
    if FAMILIES[name] not in ("ssd_chunk_scan", "selective_scan"):
        pytest.skip("only Mamba mixers have a conv beside their scan")
    rebuild = linear_core.forward_with_globals

    def conv_only(cls, replacements):  # the runtime's conv goes in; the scan stays transformers' own
        return rebuild(cls, {name: fn for name, fn in replacements.items() if fn.__name__ == "conv"})

    monkeypatch.setattr(linear_core, "forward_with_globals", conv_only)
    result = verify(spec, twin, adapt, decision.taken(), seeds=(0,))
    assert not result.passed and "the runtime attention did not run" in result.note
