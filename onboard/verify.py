"""Prove an adapter computes what HuggingFace computes: the tiny twin through both, several seeds, fp32.

For each seed the twin's weights are redrawn (router biases included, so bias correction is exercised),
the same batch goes through the HuggingFace model and through an adapted deep copy, and the logits, the
loss and every parameter's gradient are compared. The run also proves the adapter ran: it counts the
runtime blocks that were called and checks that none of the replaced HuggingFace blocks was.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from onboard.errors import one_line
from onboard.spec import ModelSpec
from onboard.twin import Twin
from runtime.adapt import tensor_at

SEEDS = (0, 1, 2)
# fp32 with a different summation order (grouped GEMM vs per-expert loops): agreement to ~1e-6 relative
LOGITS_RTOL = 1e-4
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
GRAD_ATOL = 1e-7
CHECK_CHUNK = 8  # linear-attention chunk length under verification: the 32-token twin crosses 3 boundaries


@dataclass
class SeedResult:
    seed: int
    logits_max_abs: float
    logits_max_rel: float
    loss_ref: float
    loss_adapted: float
    kl: float
    grads_checked: int
    grad_worst_rel: float
    grad_worst_param: str
    grad_failures: list[str] = field(default_factory=list)
    runtime_calls: int = 0
    original_calls: int = 0
    runtime_loss_calls: int = 0  # forward passes whose loss the runtime computed (0 when the loss stays HF)
    runtime_attention_calls: int = 0  # runtime linear-attention cores and sparse attentions run
    passed: bool = False


@dataclass
class Verification:
    passed: bool
    replaced: int
    expected: int
    seeds: list[SeedResult]
    tolerances: dict
    note: str = ""
    backends: dict = field(default_factory=dict)  # runtime op -> backend that ran it (cpu, triton, npu)
    aux_loss: dict = field(default_factory=dict)  # the model's router auxiliary loss, HF vs adapted (if any)

    def to_dict(self) -> dict:
        return asdict(self)


def _redraw(model: nn.Module, spec: ModelSpec, layers_path: str, seed: int) -> None:
    """New random weights: matrices N(0, 0.05); vectors 1 + N(0, 0.05) (norm gains stay near one)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.05
            p.copy_(noise if p.dim() >= 2 else 1.0 + noise)
        stack = model.get_submodule(layers_path)
        for layer in spec.layers:
            bias = layer.mlp.router.bias if layer.mlp.router else None
            if bias and layer.index < len(stack):
                t = tensor_at(stack[layer.index], bias)
                t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype) * 0.05)


def _count_calls(modules: list[nn.Module]) -> tuple[list, list[int]]:
    counter = [0]

    def hook(*_):
        counter[0] += 1

    return [m.register_forward_hook(hook) for m in modules], counter


def expected_replacements(spec: ModelSpec, twin: Twin, targets) -> int:
    depth = len(twin.model.get_submodule(twin.layers_path))
    return sum(1 for layer in spec.layers if layer.index < depth and layer.mlp.kind == "moe" and targets(layer))


def verify(spec: ModelSpec, twin: Twin, adapt, targets, seeds=SEEDS, *, loss_swapped: bool = False,
           attention: dict | None = None) -> Verification:
    """Run the twin through HuggingFace and through `adapt`; compare everything. `targets(layer)` names the
    module (below the decoder layer) the adapter should replace, or None. Never raises: an adapter that
    crashes is a failed verification, with the error in the note. With `loss_swapped` the adapter must also
    compute the training loss in the runtime (without full logits); the logits are then compared from a
    forward pass without labels. `attention` maps "linear" / "sparse" to the layer indices whose attention the
    adapter must run in the runtime; the runtime's attention cores must then have run."""
    expected = expected_replacements(spec, twin, targets)
    tolerances = {"logits_rtol": LOGITS_RTOL, "loss_rtol": LOSS_RTOL, "grad_rtol": GRAD_RTOL, "grad_atol": GRAD_ATOL}
    try:
        return _verify(spec, twin, adapt, targets, seeds, expected, tolerances, loss_swapped, attention or {})
    except Exception as exc:  # generated code under test: report, do not crash
        return Verification(False, 0, expected, [], tolerances, f"the adapted model raised {one_line(exc)}")


def _sequence_core_calls(calls) -> int:
    """Calls of the runtime's linear-attention / state-space cores (the causal conv beside them does not count:
    a mixer whose conv ran in the runtime but whose scan did not has not been swapped)."""
    return sum(n for kind, n in calls.items() if kind != "causal_conv1d")


def _verify(spec, twin, adapt, targets, seeds, expected, tolerances, loss_swapped, attention) -> Verification:
    from runtime.attention import LINEAR_CORE_CALLS, reset_sparse_calls, sparse_calls
    from runtime.moe import MoEBlock, RoutedExperts

    results = []
    replaced = 0
    depth = len(twin.model.get_submodule(twin.layers_path))
    attention_expected = {mode: sum(1 for i in indices if i < depth) for mode, indices in attention.items()}
    attention_swapped = 0
    for seed in seeds:
        ref = copy.deepcopy(twin.model)
        _redraw(ref, spec, twin.layers_path, seed)
        ref.eval()
        adapted = copy.deepcopy(ref)
        names = dict(adapted.named_parameters())
        stack = adapted.get_submodule(twin.layers_path)
        originals = [stack[layer.index].get_submodule(targets(layer)) for layer in spec.layers
                     if layer.index < len(stack) and layer.mlp.kind == "moe" and targets(layer)]
        original_hooks, original_calls = _count_calls(originals)
        _adapt_for_checking(adapt, adapted)
        replaced = getattr(adapted, "onboard_replaced", 0)
        runtime_hooks, runtime_calls = _count_calls([m for m in adapted.modules() if isinstance(m, (MoEBlock, RoutedExperts))])
        batch = twin.example_batch(seed)
        out_ref = ref(**batch, use_cache=False)
        out_ref.loss.backward()
        attention_swapped = getattr(adapted, "onboard_attention_swapped", 0)
        linear_before = _sequence_core_calls(LINEAR_CORE_CALLS)
        reset_sparse_calls()
        out_ad = adapted(**batch, use_cache=False)
        out_ad.loss.backward()
        attention_calls = {"linear": _sequence_core_calls(LINEAR_CORE_CALLS) - linear_before, "sparse": sparse_calls()["sparse"]}
        loss_calls = getattr(adapted, "onboard_loss_calls", 0)
        for h in original_hooks + runtime_hooks:
            h.remove()
        logits_ad = out_ad.logits
        if logits_ad is None or logits_ad.numel() == 0:  # the runtime loss never made logits: ask for them
            with torch.no_grad():
                logits_ad = adapted(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
        result = _compare(seed, ref, out_ref, out_ad.loss, logits_ad, names, runtime_calls[0], original_calls[0])
        result.runtime_loss_calls = loss_calls
        result.runtime_attention_calls = sum(attention_calls.values())
        if loss_swapped and loss_calls == 0:
            result.passed = False
        if any(attention_expected.get(mode) and not attention_calls[mode] for mode in attention_calls):
            result.passed = False
        results.append(result)
    aux = _aux_losses(twin, spec, adapt) if replaced or loss_swapped else {}
    wanted = sum(attention_expected.values())
    passed = (bool(results) and all(r.passed for r in results) and replaced == expected and aux.get("passed", True)
              and attention_swapped == wanted)
    note = "" if replaced == expected else f"adapter replaced {replaced} blocks, expected {expected}"
    if expected == 0:
        note = "no MoE block the runtime can take over" + ("" if loss_swapped else
                                                         ": the adapter leaves the model as it is")
    if attention_swapped != wanted:
        note = (note + "; " if note else "") + f"adapter swapped {attention_swapped} attention layers, expected {wanted}"
    if wanted and results and not all(r.runtime_attention_calls for r in results):
        note = (note + "; " if note else "") + "the runtime attention did not run"
    if loss_swapped and results and not all(r.runtime_loss_calls for r in results):
        note = (note + "; " if note else "") + "the runtime loss did not run"
    if not aux.get("passed", True):
        note = (note + "; " if note else "") + "the router auxiliary loss differs"
    return Verification(passed, replaced, expected, results, tolerances, note, _backends() if replaced else {}, aux)


def _adapt_for_checking(adapt, model: nn.Module) -> nn.Module:
    """Adapt `model`, with linear-attention chunks short enough that the twin's sequence spans several:
    chunk boundaries are where a chunked recurrence goes wrong."""
    import inspect

    if "chunk_size" in inspect.signature(adapt).parameters:
        return adapt(model, chunk_size=CHECK_CHUNK)
    return adapt(model)


def _aux_losses(twin: Twin, spec: ModelSpec, adapt) -> dict:
    """With router logits requested, the model's auxiliary load-balancing loss must not change."""
    ref = copy.deepcopy(twin.model)
    _redraw(ref, spec, twin.layers_path, 0)
    ref.eval()
    adapted = _adapt_for_checking(adapt, copy.deepcopy(ref))
    batch = twin.example_batch(0)
    try:
        with torch.no_grad():
            a = ref(**batch, use_cache=False, output_router_logits=True)
    except Exception:  # the model itself cannot produce router logits: nothing to keep equal
        return {}
    a_aux = getattr(a, "aux_loss", None)
    if a_aux is None:
        return {}
    try:
        with torch.no_grad():
            b = adapted(**batch, use_cache=False, output_router_logits=True)
    except Exception as exc:  # noqa: BLE001 - generated code under test
        return {"passed": False, "error": one_line(exc)}
    b_aux = getattr(b, "aux_loss", None)
    a_aux, b_aux = float(a_aux), float(b_aux) if b_aux is not None else float("nan")
    # the training loss with the auxiliary term added in
    a_loss, b_loss = float(a.loss), float(b.loss) if b.loss is not None else float("nan")
    close = [abs(x - y) <= LOSS_RTOL * max(1.0, abs(x)) for x, y in ((a_aux, b_aux), (a_loss, b_loss))]
    return {"hf": a_aux, "adapted": b_aux, "hf_loss": a_loss, "adapted_loss": b_loss, "passed": all(close)}


def _backends() -> dict:
    from runtime.kernels import registry
    from runtime.moe.dispatch import permute, unpermute
    from runtime.moe.grouped import grouped_mm

    return {op: registry.backend_of(op, ref) for op, ref in
            (("moe.grouped_mm", grouped_mm), ("moe.permute", permute), ("moe.unpermute", unpermute))}


def _compare(seed, ref, out_ref, loss_adapted, logits_adapted, adapted_params, runtime_calls,
             original_calls) -> SeedResult:
    a, b = out_ref.logits.detach().double(), logits_adapted.detach().double()
    scale = max(1.0, float(a.abs().max()))
    max_abs = float((a - b).abs().max())
    kl = float(torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True,
                                          reduction="batchmean") / a.shape[1])
    loss_ref, loss_ad = float(out_ref.loss.detach()), float(loss_adapted.detach())
    failures, worst, worst_name, checked = [], 0.0, "", 0
    for name, p in ref.named_parameters():
        q = adapted_params[name]
        if p.grad is None and q.grad is None:
            continue
        checked += 1
        if (p.grad is None) != (q.grad is None):
            failures.append(f"{name}: gradient only on one side")
            continue
        g, h = p.grad.double(), q.grad.double()
        ref_max = float(g.abs().max())
        diff = float((g - h).abs().max())
        rel = diff / (ref_max + 1e-6)  # tensors with (nearly) no gradient do not dominate the report
        if rel > worst:
            worst, worst_name = rel, name
        if diff > GRAD_RTOL * ref_max + GRAD_ATOL:
            failures.append(f"{name}: max |dgrad| {diff:.3g} vs max |grad| {ref_max:.3g}")
    passed = (max_abs <= LOGITS_RTOL * scale and abs(loss_ref - loss_ad) <= LOSS_RTOL * max(1.0, abs(loss_ref))
              and not failures and original_calls == 0 and math.isfinite(loss_ad))
    return SeedResult(seed, max_abs, max_abs / scale, loss_ref, loss_ad, kl, checked, worst, worst_name,
                      failures[:20], runtime_calls, original_calls, passed=passed)
