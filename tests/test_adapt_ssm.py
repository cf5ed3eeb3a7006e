"""State-space, lightning and short-conv hybrids adapt end to end: Mamba2 mixers (NemotronH, GraniteMoeHybrid),
Mamba1 mixers (Jamba), MiniMax's lightning attention and LFM3's gated short convs run on the runtime's sequence
cores beside its MoE blocks and loss, and verification catches a wrong decay (or conv shift) in any of them.

Models are transformers' own families at their default configs, as `onboard families` inspects them."""

import copy
import importlib

import pytest
import torch

from onboard.bundle import verify_swaps
from onboard.codegen import attention_kinds
from runtime.attention.swap import SEQUENCE_CORES

# the modules (the package exports functions of the same names)
lightning, selective_scan, ssd, swap = (importlib.import_module(f"runtime.attention.{name}")
                                        for name in ("lightning", "selective_scan", "ssd", "swap"))

FAMILIES = {"minimax": "lightning", "nemotron_h": "ssd_chunk_scan", "granitemoehybrid": "ssd_chunk_scan",
            "jamba": "selective_scan", "lfm3": "short_conv"}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, twin_adapter):
    return (request.param, *twin_adapter(tmp_path_factory.mktemp(request.param), family=request.param))


def _core_calls(model) -> dict:
    calls: dict = {}
    for module in model.modules():
        for kind, n in getattr(module, "runtime_core_calls", {}).items():
            calls[kind] = calls.get(kind, 0) + n
    return calls


def test_mixers_moe_and_loss_run_in_the_runtime(family):
    name, spec, twin, adapt = family
    groups, kept = attention_kinds(spec, twin)
    assert not kept, kept
    mixers = [layer.index for layer in spec.layers if layer.attention.kind.startswith(("ssm:", "linear:", "conv"))]
    assert sorted(i for g in groups for i in g["indices"]) == mixers
    result = verify_swaps(spec, twin, adapt, seeds=(0, 1))
    assert result.passed, result.note or [r.grad_failures for r in result.seeds]
    assert result.replaced == result.expected >= (0 if name == "lfm3" else 1)  # LFM3's MLPs are dense
    for r in result.seeds:
        assert r.runtime_attention_calls > 0 and r.runtime_loss_calls == 1 and r.original_calls == 0
    # the sequence core itself ran (not only the causal conv beside it)
    model = adapt(copy.deepcopy(twin.model).eval(), chunk_size=8)
    with torch.no_grad():
        model(**{k: v for k, v in twin.example_batch(0).items() if k != "labels"}, use_cache=False)
    assert set(_core_calls(model)) & ({FAMILIES[name]} | set(SEQUENCE_CORES))


def _wrong_decay(core, dim):
    def wrong(*args, **kwargs):
        args = list(args)
        args[3] = args[3].roll(1, dims=dim)  # the decay (B, T, H) of the previous token (dim 1) or head (dim 2)
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
    name, spec, twin, adapt = family
    if FAMILIES[name] == "short_conv":
        monkeypatch.setattr(swap, "causal_conv1d", _conv_late(swap.causal_conv1d))
    elif FAMILIES[name] == "selective_scan":
        monkeypatch.setattr(selective_scan, "selective_scan", _selective_late(selective_scan.selective_scan))
    else:
        module = lightning if FAMILIES[name] == "lightning" else ssd
        monkeypatch.setattr(module, "chunk_scalar_decay",
                            _wrong_decay(module.chunk_scalar_decay, 2 if module is lightning else 1))
    result = verify_swaps(spec, twin, adapt, seeds=(0,))
    assert not result.passed


def test_a_mixer_whose_scan_stays_huggingface_code_fails_verification(family, monkeypatch):
    """The conv beside a scan does not count: if only the conv runs in the runtime, the mixer was not swapped."""
    name, spec, twin, adapt = family
    if FAMILIES[name] not in ("ssd_chunk_scan", "selective_scan"):
        pytest.skip("only Mamba mixers have a conv beside their scan")
    runtime_function = swap._runtime_function

    def conv_only(kind, module, *args):
        if kind == "causal_conv1d":
            return runtime_function(kind, module, *args)
        namespace = importlib.import_module(type(module).__module__).__dict__
        return next(namespace[n] for n, k in module._runtime_kinds.items() if k == kind)  # HF's own scan

    monkeypatch.setattr(swap, "_runtime_function", conv_only)
    result = verify_swaps(spec, twin, adapt, seeds=(0,))
    assert not result.passed and "the runtime attention did not run" in result.note
