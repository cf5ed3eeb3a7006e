"""Prove an adapter computes what HuggingFace computes: the tiny twin through both, several seeds, fp32.

For each seed the twin's weights are redrawn (router biases included, so bias correction is exercised),
the same batch goes through the HuggingFace model and through an adapted deep copy, and the logits, the
loss and every parameter's gradient are compared. The run also proves the adapter did what the adapt
decision says, from the handles `adapt(model)` returns (`runtime.swap.Swaps`): as many swaps of each kind
as the decision expects in the twin, every one of them run (its own call count), and none of the
HuggingFace blocks they replaced run.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from onboard.decision import Decision
from onboard.errors import one_line
from onboard.spec import ModelSpec
from onboard.twin import Twin
from runtime.model_tree import tensor_at
from runtime.swap import EXPERTS, LINEAR_CORE, LOSS, MOE_BLOCK, SPARSE_ATTENTION, Swaps

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
    swaps: dict = field(default_factory=dict)  # handle kind -> {"expected": n, "made": n} in the twin

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


MOE_KINDS = (MOE_BLOCK, EXPERTS)


def verify(spec: ModelSpec, twin: Twin, adapt, decision: Decision, seeds=SEEDS) -> Verification:
    """Run the twin through HuggingFace and through `adapt`; compare everything, and check the handles `adapt`
    returns against `decision`. Never raises: an adapter that crashes is a failed verification, with the error
    in the note. Where the decision takes the loss, the adapter computes it without full logits; the logits are
    then compared from a forward pass without labels."""
    depth = len(twin.model.get_submodule(twin.layers_path))
    wanted = decision.expected(depth)
    expected = sum(wanted[k] for k in MOE_KINDS)
    tolerances = {"logits_rtol": LOGITS_RTOL, "loss_rtol": LOSS_RTOL, "grad_rtol": GRAD_RTOL, "grad_atol": GRAD_ATOL}
    try:
        return _verify(spec, twin, adapt, seeds, wanted, tolerances)
    except Exception as exc:  # generated code under test: report, do not crash
        return Verification(False, 0, expected, [], tolerances, f"the adapted model raised {one_line(exc)}")


def _attention_calls(swaps: Swaps) -> int:
    """Calls of the runtime's attention: sequence cores of linear-attention / state-space swaps (the causal conv
    beside them does not count: a mixer whose conv ran in the runtime but whose scan did not has not been
    swapped) and sparse attentions over picked keys."""
    linear = sum(n for s in swaps.of(LINEAR_CORE) for kind, n in s.calls.items() if kind != "causal_conv1d")
    return linear + sum(s.calls["sparse"] for s in swaps.of(SPARSE_ATTENTION))


def _ran(swap) -> bool:
    """Whether the runtime code behind a swap ran (a linear-attention swap whose conv alone ran did not, nor a
    sparse-attention swap whose indexer alone ran)."""
    return sum(n for kind, n in swap.calls.items() if kind not in ("causal_conv1d", "indexer")) > 0


def _verify(spec, twin, adapt, seeds, wanted, tolerances) -> Verification:
    results = []
    made: dict[str, int] = {}
    idle: set[str] = set()  # swaps made whose runtime code never ran
    for seed in seeds:
        ref = copy.deepcopy(twin.model)
        _redraw(ref, spec, twin.layers_path, seed)
        ref.eval()
        adapted = copy.deepcopy(ref)
        names = dict(adapted.named_parameters())
        swaps = _adapt_for_checking(adapt, adapted)
        made = {kind: len(swaps.of(kind)) for kind in wanted}
        original_hooks, original_calls = _count_calls([s.replaced for s in swaps.of(*MOE_KINDS)])
        batch = twin.example_batch(seed)
        out_ref = ref(**batch, use_cache=False)
        out_ref.loss.backward()
        out_ad = adapted(**batch, use_cache=False)
        out_ad.loss.backward()
        for h in original_hooks:
            h.remove()
        runtime_calls = sum(swaps.calls(kind) for kind in MOE_KINDS)
        loss_calls, attention_calls = swaps.calls(LOSS), _attention_calls(swaps)
        logits_ad = out_ad.logits
        if logits_ad is None or logits_ad.numel() == 0:  # the runtime loss never made logits: ask for them
            with torch.no_grad():
                logits_ad = adapted(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
        result = _compare(seed, ref, out_ref, out_ad.loss, logits_ad, names, runtime_calls, original_calls[0])
        result.runtime_loss_calls = loss_calls
        result.runtime_attention_calls = attention_calls
        never = {s.path or s.kind for s in swaps if not _ran(s)}
        idle |= never
        if never or (wanted[LOSS] and not loss_calls) or (wanted[LINEAR_CORE] + wanted[SPARSE_ATTENTION]
                                                        and not attention_calls):
            result.passed = False
        results.append(result)
    replaced, expected = sum(made.get(k, 0) for k in MOE_KINDS), sum(wanted[k] for k in MOE_KINDS)
    aux = _aux_losses(twin, spec, adapt) if replaced or wanted[LOSS] else {}
    counts_match = made == wanted
    passed = bool(results) and all(r.passed for r in results) and counts_match and aux.get("passed", True)
    notes = [f"adapter made {made.get(kind, 0)} {kind} swaps, expected {n}" for kind, n in wanted.items()
             if made.get(kind, 0) != n]
    if idle:
        notes.append(f"swapped but never run: {', '.join(sorted(idle)[:5])}{' ...' if len(idle) > 5 else ''}")
    if not expected and not notes:
        notes.append("no MoE block the runtime can take over" + ("" if wanted[LOSS] else
                                                                  ": the adapter leaves the model as it is"))
    if wanted[LINEAR_CORE] + wanted[SPARSE_ATTENTION] and results and not all(r.runtime_attention_calls
                                                                             for r in results):
        notes.append("the runtime attention did not run")
    if wanted[LOSS] and results and not all(r.runtime_loss_calls for r in results):
        notes.append("the runtime loss did not run")
    if not aux.get("passed", True):
        notes.append("the router auxiliary loss differs")
    return Verification(passed, replaced, expected, results, tolerances, "; ".join(notes),
                        _backends() if replaced else {}, aux,
                        swaps={kind: {"expected": n, "made": made.get(kind, 0)} for kind, n in wanted.items() if n})


def _adapt_for_checking(adapt, model: nn.Module) -> Swaps:
    """Adapt `model`, with linear-attention chunks short enough that the twin's sequence spans several:
    chunk boundaries are where a chunked recurrence goes wrong. The handles it returns, as Swaps."""
    import inspect

    swaps = adapt(model, chunk_size=CHECK_CHUNK) if "chunk_size" in inspect.signature(adapt).parameters else adapt(model)
    if not isinstance(swaps, list):
        raise TypeError(f"adapt() returned {type(swaps).__name__}, not the handles of its swaps (runtime.swap.Swaps)")
    return Swaps(swaps)


def _aux_losses(twin: Twin, spec: ModelSpec, adapt) -> dict:
    """With router logits requested, the model's auxiliary load-balancing loss must not change."""
    ref = copy.deepcopy(twin.model)
    _redraw(ref, spec, twin.layers_path, 0)
    ref.eval()
    adapted = copy.deepcopy(ref)
    _adapt_for_checking(adapt, adapted)
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
