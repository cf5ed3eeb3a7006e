"""Prove an adapter computes what HuggingFace computes: the tiny twin through both, several seeds, fp32.

For each seed the twin's weights are redrawn (router biases included, so bias correction is exercised; in the last
two the vectors of linear-attention and state-space modules, their decay rates among them, are drawn across the weak
and then the strong half of a wide range, DECAY_DRAWS), the same batch goes through the HuggingFace model in fp32,
through an adapted fp32 deep copy, and through the HuggingFace model in fp64, the truth. The logits, the loss and
every parameter's gradient are judged against the truth, tensor by tensor: the adapted model's error may be at most
ERR_FACTOR times HuggingFace's own fp32 error on the same tensor plus ERR_FLOOR, both relative to that tensor's own
largest true value (never the model's: a decay rate whose gradient is 1e-6 of the largest is judged at its own
scale, so a 10 % error there fails). A gradient that is wrong where HuggingFace's is right fails, however small it
is. HuggingFace's error is one sample of what fp32 gets wrong, and one summation order can be lucky on a cancelling
sum: a seed with a tensor past its bound is judged once more with HuggingFace's error the larger of its run's and of
the same run with the batch's rows reversed, where that run agrees with the first to fp32's tolerance. Where the
model does not run in fp64 the adapted model is compared with the fp32 HuggingFace model instead (GRAD_RTOL,
GRAD_ATOL; said in the note). The run also proves the adapter did what the adapt decision says, from the handles
`adapt(model)` returns (`runtime.swap.Swaps`): as many swaps of each kind as the decision expects in the twin, every
one of them run (its own call count), and none of the HuggingFace blocks they replaced run.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import sys
from dataclasses import dataclass, field

import torch
from torch import nn

from onboard import contract
from onboard.adapt.decision import Taken
from onboard.adapt.fp64 import Fp64Everywhere
from onboard.errors import one_line
from onboard.inspect.spec import ModelSpec
from onboard.twin import TEST_SEQ_LEN, Twin
from runtime.model_tree import tensor_at
from runtime.swap import EXPERTS, GENERATED, LINEAR_CORE, LOSS, MOE_BLOCK, SPARSE_ATTENTION, Swaps

SCHEMA_VERSION = 1  # of verification.json; 0: the same fields, written without schema_version
READABLE_VERSIONS = (0, 1)  # a base branch's bundles are reviewed against a pull request's
SEEDS = (0, 1, 2)
# fp32 with a different summation order (grouped GEMM vs per-expert loops): agreement to ~1e-6 relative
LOGITS_RTOL = 1e-4
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
GRAD_ATOL = 1e-7
CHECK_CHUNK = 8  # linear-attention chunk length under verification: the 32-token twin crosses 3 boundaries
# against the fp64 truth: the adapted fp32 error within this multiple of HuggingFace's own fp32 error, plus a
# floor for tensors HuggingFace gets (nearly) exact, where summation order alone moves the last digits
ERR_FACTOR = 10.0
ERR_FLOOR = 1e-5
# each tensor's error is relative to its own largest true value; a tensor whose true values all lie below fp32's
# smallest normal number (a gradient decays pushed under what fp32 holds, or exactly zero) is measured against
# that number instead: fp32 holds no relative precision there, in HuggingFace's run or the adapted one
TENSOR_SCALE_MIN = torch.finfo(torch.float32).tiny
# The vectors of linear-attention / state-space modules (A_log, dt_bias, ...) in the last two seeds, uniform over
# a range: weak decays (A = e^-4..1: the state carries across many chunks), then strong ones (A = 1..e^4 and
# softplus(dt) up to 4: log decays down to about -200 a token, where a decay gradient summed the wrong way loses
# its digits). Those seeds run WIDE_SEQ tokens at the runtime's own chunk length.
DECAY_DRAWS = {SEEDS[1]: ("weak", (-4.0, 0.0)), SEEDS[2]: ("strong", (0.0, 4.0))}
WIDE_SEQ = 160  # over two of the runtime's 64-token chunks, and a part


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
    # against the fp64 truth ("" when the model does not run in fp64): relative errors of the logits, and of
    # the gradient where the adapted error is furthest past HuggingFace's own
    truth: str = ""
    logits_err_hf: float = 0.0
    logits_err_adapted: float = 0.0
    grad_err_hf: float = 0.0
    grad_err_adapted: float = 0.0
    grad_err_param: str = ""
    loss_err_hf: float = 0.0
    loss_err_adapted: float = 0.0
    decays: str = ""  # "weak" / "strong": this seed drew the linear-attention / state-space vectors so
    passed: bool = False


@dataclass
class Verification(contract.Document):
    passed: bool
    replaced: int
    expected: int
    seeds: list[SeedResult]
    tolerances: dict
    note: str = ""
    backends: dict = field(default_factory=dict)  # runtime op -> backend that ran it (cpu, triton, npu)
    aux_loss: dict = field(default_factory=dict)  # the model's router auxiliary loss, HF vs adapted (if any)
    swaps: dict = field(default_factory=dict)  # handle kind -> {"expected": n, "made": n} in the twin
    packed: dict = field(default_factory=dict)  # whether the adapted model keeps packed documents apart
    schema_version: int = SCHEMA_VERSION

    @classmethod
    def from_dict(cls, data, where: str = "verification.json") -> Verification:
        """A verification record read back; one line (OnboardError) naming `where` and the field that does not fit."""
        return contract.read(cls, data, where, version=SCHEMA_VERSION, readable=READABLE_VERSIONS)


def _redraw(model: nn.Module, spec: ModelSpec, layers_path: str, seed: int, decays: tuple | None = None) -> bool:
    """New random weights: matrices N(0, 0.05); vectors 1 + N(0, 0.05) (norm gains stay near one). With
    `decays` (low, high) the vectors of linear-attention and state-space modules are uniform over that range
    instead: their decay rates (A_log, dt_bias) weak or strong. Returns whether the model has such vectors."""
    gen = torch.Generator().manual_seed(seed)
    stack = model.get_submodule(layers_path)
    wide = set()
    if decays:
        for layer in spec.layers:
            if layer.index < len(stack) and layer.attention.kind.startswith(("linear:", "ssm:")):
                module = stack[layer.index].get_submodule(layer.attention.path) if layer.attention.path else None
                wide |= {id(p) for p in (module.parameters() if module is not None else ()) if p.dim() == 1}
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.05
            if id(p) in wide:
                low, high = decays
                p.copy_(torch.rand(p.shape, generator=gen, dtype=p.dtype) * (high - low) + low)
            else:
                p.copy_(noise if p.dim() >= 2 else 1.0 + noise)
        for layer in spec.layers:
            bias = layer.mlp.router.bias if layer.mlp.router else None
            if bias and layer.index < len(stack):
                t = tensor_at(stack[layer.index], bias)
                t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype) * 0.05)
    return bool(wide)


@contextlib.contextmanager
def class_calls(model: nn.Module, classes: list[type]):
    """Count calls of each class's `forward` on any object that is not one of `model`'s own modules of that
    class: the replaced code reached through its class (on the replacement itself, or on a copy) rather than
    through an instance the model still runs. Yields a one-item list, the count."""
    count = [0]
    patched = []
    for cls in dict.fromkeys(classes):
        original = cls.forward
        own = {id(m) for m in model.modules() if type(m) is cls}  # instances the adapted model still runs

        def counted(self, *args, __original=original, __own=own, **kwargs):
            if id(self) not in __own:
                count[0] += 1
            return __original(self, *args, **kwargs)

        patched.append((cls, "forward" in vars(cls), original))
        cls.forward = counted
    try:
        yield count
    finally:
        for cls, had, original in reversed(patched):
            if had:
                cls.forward = original
            else:
                del cls.forward


def _count_calls(modules: list[nn.Module]) -> tuple[list, list[int]]:
    counter = [0]

    def hook(*_):
        counter[0] += 1

    return [m.register_forward_hook(hook) for m in modules], counter


MOE_KINDS = (MOE_BLOCK, EXPERTS)


def verify(spec: ModelSpec, twin: Twin, adapt, taken: Taken, seeds=SEEDS, against_fp64: bool = True,
           decay_draws: dict | None = None) -> Verification:
    """Run the twin through HuggingFace and through `adapt`; compare everything, and check the handles `adapt`
    returns against what the decision takes (`Decision.taken()`). Never raises: an adapter that crashes is a
    failed verification, with the error in the note. Where the decision takes the loss, the adapter computes it
    without full logits; the logits are then compared from a forward pass without labels. `against_fp64=False`
    judges every tensor against the fp32 HuggingFace run alone (GRAD_RTOL, GRAD_ATOL); `decay_draws` replaces
    DECAY_DRAWS (seed -> (name, range)); with both `False` and `{}` the rule is the one before the fp64 truth.
    It runs with torch's deterministic algorithms on a fixed number of threads (`reproducible`), so its numbers
    do not change with the run or the machine."""
    depth = len(twin.model.get_submodule(twin.layers_path))
    wanted = {kind: sum(1 for i in layers if i < depth) for kind, layers in taken.swaps.items()}
    expected = sum(wanted[k] for k in MOE_KINDS)
    tolerances = {"logits_rtol": LOGITS_RTOL, "loss_rtol": LOSS_RTOL, "grad_rtol": GRAD_RTOL, "grad_atol": GRAD_ATOL,
                  "err_factor": ERR_FACTOR, "err_floor": ERR_FLOOR, "err_scale_min": TENSOR_SCALE_MIN}
    try:
        draws = DECAY_DRAWS if decay_draws is None else decay_draws
        with reproducible():
            return _verify(spec, twin, adapt, seeds, wanted, tolerances, against_fp64, draws)
    except Exception as exc:  # generated code under test: report, do not crash
        return Verification(False, 0, expected, [], tolerances, f"the adapted model raised {one_line(exc)}")


# the intra-op threads verification runs with, whatever the machine has: a parallel reduction's rounding follows
# how it is split, so the same twin gives the same numbers on any machine of the same CPU kind
THREADS = 2


@contextlib.contextmanager
def reproducible():
    """Run the block with torch's deterministic algorithms (warning, not failing, where an op has none) on THREADS
    threads, as it was after. Verification's numbers go into the bundle, so they must not change with the run, the
    machine's load or its core count: transformers' grouped-GEMM experts gather each token once per expert it is
    routed to, and on CPU the backward of that gather adds the duplicates in parallel, in an order that changes
    from run to run with two threads or more (the last digits of every gradient upstream of an MoE block, and the
    worst errors verification.json records); the deterministic path adds them in index order."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    threads = torch.get_num_threads()
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.set_num_threads(THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


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


def _verify(spec, twin, adapt, seeds, wanted, tolerances, against_fp64, decay_draws) -> Verification:
    results = []
    made: dict[str, int] = {}
    idle: set[str] = set()  # swaps made whose runtime code never ran
    truthless: set[str] = set()  # why the model did not run in fp64 (then the fp32 comparison decides)
    kept_casts: set[str] = set()  # why the fp64 run kept the model's own fp32 casts
    for seed in seeds:
        ref = copy.deepcopy(twin.model)
        decays, decay_range = decay_draws.get(seed, ("", None))
        wide = _redraw(ref, spec, twin.layers_path, seed, decay_range)  # a model with decays to draw
        ref.eval()
        truth = copy.deepcopy(ref).double() if against_fp64 else None
        adapted = copy.deepcopy(ref)
        names = dict(adapted.named_parameters())
        # the decay seeds run the runtime's own chunk length over several chunks: that is where a decay
        # gradient summed the wrong way loses its digits; the first crosses many short chunks
        swaps = _adapt_for_checking(adapt, adapted, None if wide else CHECK_CHUNK)
        made = {kind: len(swaps.of(kind)) for kind in wanted}
        # the modules swapped out must not run: MoE blocks and experts, and what the agent's code replaced; the
        # classes the agent's code replaced not on any object the adapted model does not run as HuggingFace code
        original_hooks, original_calls = _count_calls([s.replaced for s in swaps.of(*MOE_KINDS, GENERATED)])
        batch = twin.example_batch(seed, WIDE_SEQ if wide else TEST_SEQ_LEN)
        out_ref = ref(**batch, use_cache=False)
        out_ref.loss.backward()
        out_truth, why_no_truth, casts = _truth(truth, batch) if against_fp64 else (None, "not asked for", "")
        if casts:
            kept_casts.add(casts)
        with class_calls(adapted, [type(s.replaced) for s in swaps.of(GENERATED)]) as stray:
            out_ad = adapted(**batch, use_cache=False)
            out_ad.loss.backward()
        original_calls[0] += stray[0]
        for h in original_hooks:
            h.remove()
        runtime_calls = sum(swaps.calls(kind) for kind in MOE_KINDS)
        loss_calls, attention_calls = swaps.calls(LOSS), _attention_calls(swaps)
        logits_ad = out_ad.logits
        if logits_ad is None or logits_ad.numel() == 0:  # the runtime loss never made logits: ask for them
            with torch.no_grad():
                logits_ad = adapted(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
        result = _compare(seed, ref, out_ref, out_ad.loss, logits_ad, names, runtime_calls, original_calls[0],
                          truth if out_truth is not None else None, out_truth,
                          reorder=lambda: _reordered(ref, batch))
        result.decays = decays if wide else ""
        if why_no_truth:
            truthless.add(why_no_truth)
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
    if truthless:
        notes.append(f"judged against HuggingFace fp32 (no fp64 run: {sorted(truthless)[0]})")
    if kept_casts:
        notes.append(f"fp64 truth with {sorted(kept_casts)[0]}")
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
                        swaps={kind: {"expected": n, "made": made.get(kind, 0)} for kind, n in wanted.items() if n},
                        packed=packed_documents(twin, spec, adapt))


PACKED_RTOL = 1e-4  # a document that sees its neighbour is off by O(1e-2) or more


def packed_documents(twin: Twin, spec: ModelSpec, adapt) -> dict:
    """Whether the adapted twin keeps packed documents apart, as training on packed text needs: two documents
    laid end to end in one row (`runtime.train.data.model_inputs`: positions restart, the cores get the
    boundaries), the second one's logits against the same document alone. Not a condition of `passed`:
    `onboard train` refuses packed data where this says no."""
    import numpy as np

    from runtime.train.data import PackedCorpus, model_inputs

    try:
        model = copy.deepcopy(twin.model)
        _redraw(model, spec, twin.layers_path, 0)
        model.eval()
        _adapt_for_checking(adapt, model)
        first, second = 5, TEST_SEQ_LEN - 5
        tokens = twin.example_batch(0)["input_ids"][0, :first + second].numpy()
        corpus = PackedCorpus(tokens, np.array([0, first]), first + second)
        inputs = model_inputs(corpus, 0, 0, 0, grad_accum=1, dp=1, micro_batch=1)
        inputs.pop("labels")
        with torch.no_grad():
            packed = model(**inputs, use_cache=False).logits[0, first:]
            alone = model(input_ids=inputs["input_ids"][:, first:], use_cache=False).logits[0]
    except Exception as exc:  # noqa: BLE001 - model code that refuses packed inputs; never fails verification
        return {"kept_apart": False, "why": f"the adapted model refused packed inputs: {one_line(exc, 160)}"}
    error = float((packed - alone).abs().max() / alone.abs().max().clamp_min(1e-30))
    out = {"kept_apart": error <= PACKED_RTOL, "max_rel_error": error}
    if not out["kept_apart"]:
        out["why"] = (f"a packed document's logits differ from the document's alone by {error:.1e} (relative): a "
                      f"layer carries state or attention across the boundary")
    return out


def _truth(model: nn.Module, batch: dict):
    """The fp64 run (forward and backward) of the HuggingFace model: (output, why not, casts kept). It runs under
    `Fp64Everywhere`, so the model's own upcasts to fp32 (norms, softmaxes, the loss, the scans and their decays)
    stay fp64; a model whose code fails that way runs once more with them as written (casts kept: a reason,
    said in the note). Its experts run as transformers' plain loop (grouped GEMMs take no fp64), and its chunked
    sequence scans with chunks of one token: transformers' chunked scans split exp(G_i - G_j) into
    exp(G_i) exp(-G_j) over a chunk, which under strong decay is inexact in fp64 too, so only the token-by-token
    recurrence they compute at chunk 1 is the truth. (None, why not, "") when it does not run in fp64 at all."""
    try:
        model.set_experts_implementation("eager")
    except (AttributeError, ValueError, RuntimeError):
        pass  # a model without a choice of experts implementation runs as it is
    _token_by_token(model)
    try:
        with Fp64Everywhere():
            out = model(**batch, use_cache=False)
            out.loss.backward()
        return out, None, ""
    except Exception as exc:  # noqa: BLE001 - model code we do not own: fp64 throughout may not fit it
        casts = f"the model's own fp32 casts kept (in fp64 throughout it raised {one_line(exc, 100)})"
    model.zero_grad(set_to_none=True)
    try:
        out = model(**batch, use_cache=False)
        out.loss.backward()
    except Exception as exc:  # noqa: BLE001 - model code we do not own may not take fp64
        return None, one_line(exc, 120), ""
    return out, None, casts


def _token_by_token(model: nn.Module) -> None:
    """Make the chunked scans a model's own forwards call (found by signature) run with chunks of one token,
    and lightning blocks with blocks of one token (in place: `model` is verification's fp64 copy)."""
    import functools

    from runtime.attention import find_linear_cores
    from runtime.swap import Swap, forward_with_globals

    for module in model.modules():
        namespace = vars(sys.modules[type(module).__module__])
        scans = [name for name in find_linear_cores(module) if _takes_chunks(namespace.get(name))]
        if scans:
            Swap("truth").set_forward(module, forward_with_globals(type(module), {
                name: functools.partial(_one_token_chunks, namespace[name]) for name in scans}))
        elif isinstance(getattr(module, "block_size", None), int) and hasattr(module, "slope_rate"):
            module.block_size = 1


def _takes_chunks(fn) -> bool:
    """Whether `fn` is a chunked scan (a chunk_size parameter); a sequential scan is token by token already."""
    try:
        return callable(fn) and "chunk_size" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _one_token_chunks(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` with its chunk_size argument (given by position or by name) set to one."""
    names = list(inspect.signature(fn).parameters)
    at = names.index("chunk_size")
    if at < len(args):
        args = (*args[:at], 1, *args[at + 1:])
    else:
        kwargs["chunk_size"] = 1
    return fn(*args, **kwargs)


def _error(x: torch.Tensor, truth: torch.Tensor) -> float:
    """max |x - truth| / max |truth|, in fp64: relative to the tensor's own scale, whatever the model's. A tensor
    whose true values all lie below TENSOR_SCALE_MIN is measured against that."""
    x, truth = x.detach().double(), truth.detach().double()
    return float((x - truth).abs().max() / truth.abs().max().clamp_min(TENSOR_SCALE_MIN))


def judge(hf: torch.Tensor, adapted: torch.Tensor, truth: torch.Tensor,
          hf_again: torch.Tensor | None = None) -> tuple[float, float, float]:
    """One tensor against its fp64 truth: (HuggingFace's fp32 error, the adapted error, how far the adapted error
    lies past its bound; > 0 fails). Both errors are relative to this tensor's own largest true value. With
    `hf_again`, HuggingFace's same tensor summed in another order, HuggingFace's error is the larger of the two."""
    e_hf, e_ad = _error(hf, truth), _error(adapted, truth)
    if hf_again is not None:
        e_hf = max(e_hf, _error(hf_again, truth))
    return e_hf, e_ad, _excess(e_ad, e_hf)


def _excess(err_adapted: float, err_hf: float) -> float:
    """How far the adapted error lies past what the rule allows it (ERR_FACTOR x HuggingFace's + ERR_FLOOR)."""
    return err_adapted - (ERR_FACTOR * err_hf + ERR_FLOOR)


def _adapt_for_checking(adapt, model: nn.Module, chunk: int | None = CHECK_CHUNK) -> Swaps:
    """Adapt `model`, with linear-attention chunks short enough that the twin's sequence spans several:
    chunk boundaries are where a chunked recurrence goes wrong. The handles it returns, as Swaps."""
    takes_chunk = chunk is not None and "chunk_size" in inspect.signature(adapt).parameters
    swaps = adapt(model, chunk_size=chunk) if takes_chunk else adapt(model)
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


def _reordered(model: nn.Module, batch: dict) -> dict:
    """HuggingFace's fp32 run of `batch` once more, its rows in reverse order: the same numbers summed in another
    order (a weight's gradient sums over every token of the batch). {"logits", "loss", "grads"}, the logits put
    back in the batch's order. Its errors against the truth are a second sample of what fp32 alone gets wrong."""
    other = copy.deepcopy(model)
    other.zero_grad(set_to_none=True)
    out = other(**{k: v.flip(0) for k, v in batch.items()}, use_cache=False)
    out.loss.backward()
    return {"logits": out.logits.detach().flip(0), "loss": out.loss.detach(),
            "grads": {name: p.grad for name, p in other.named_parameters()}}


def same_function(out_ref, again: dict) -> bool:
    """Whether HuggingFace's run with the batch's rows reversed (`_reordered`) computed what its first run did, to
    fp32's agreement (LOGITS_RTOL, LOSS_RTOL): only then are its errors a second sample of fp32's. A model whose
    output depends on the order of the batch (tokens dropped past an expert's capacity, first come first served)
    computes something else reversed, and its errors there would loosen every bound; they are not taken."""
    a, b = out_ref.logits.detach().double(), again["logits"].double()
    loss, loss_again = float(out_ref.loss.detach()), float(again["loss"])
    return (float((a - b).abs().max()) <= LOGITS_RTOL * max(1.0, float(a.abs().max()))
            and abs(loss - loss_again) <= LOSS_RTOL * max(1.0, abs(loss)))


@dataclass
class AgainstTruth:
    """Every tensor judged against the fp64 truth: what failed, where the adapted error lies furthest past its
    bound, and the logits' and the loss's errors (HuggingFace's, the adapted model's)."""
    failures: list[str]
    worst: tuple[float, float, float, str]  # (margin, HuggingFace's error, the adapted error, parameter)
    logits: tuple[float, float, float]  # judge()'s (HuggingFace's error, the adapted error, excess)
    loss: tuple[float, float, float]


def against_truth(ref, out_ref, loss_adapted, logits_adapted, adapted_params, truth, out_truth,
                   again: dict | None = None) -> AgainstTruth:
    """Judge the logits, the loss and every gradient against the truth. HuggingFace's fp32 error on a tensor is
    the larger of its run's and, when `again` (`_reordered`) is given, of the same run summed in another order:
    one summation order can land a tensor much closer to the truth than fp32 promises (a gradient that is a
    cancelling sum of many terms), and a bound ten times that luck is a bound on the luck, not on the adapter."""
    true_params = dict(truth.named_parameters())
    failures, worst = [], (-math.inf, 0.0, 0.0, "")
    for name, p in ref.named_parameters():
        q, t = adapted_params[name], true_params.get(name)
        if p.grad is None or q.grad is None or t is None or t.grad is None:
            continue
        e_hf, e_ad, margin = judge(p.grad, q.grad, t.grad, again["grads"].get(name) if again else None)
        worst = max(worst, (margin, e_hf, e_ad, name), key=lambda w: w[0])
        if margin > 0:
            failures.append(f"{name}: error {e_ad:.2g} against fp64, HuggingFace's own fp32 error {e_hf:.2g} "
                            f"(largest true value {float(t.grad.abs().max()):.1e})")
    logits = judge(out_ref.logits, logits_adapted, out_truth.logits, again["logits"] if again else None)
    loss = judge(out_ref.loss, loss_adapted, out_truth.loss, again["loss"] if again else None)
    failures += [f"{what}: error {ad:.2g} against fp64, HuggingFace's own fp32 error {hf:.2g}"
                 for what, (hf, ad, excess) in (("logits", logits), ("loss", loss)) if excess > 0]
    return AgainstTruth(failures, worst, logits, loss)


def _compare(seed, ref, out_ref, loss_adapted, logits_adapted, adapted_params, runtime_calls,
             original_calls, truth=None, out_truth=None, reorder=None) -> SeedResult:
    """One seed's verdict. Against the fp64 truth (`truth`, `out_truth`), a tensor past its bound is judged once
    more with HuggingFace's error also taken in a second summation order (`reorder()`, run only then), where that run
    computes the same function (`same_function`)."""
    a, b = out_ref.logits.detach().double(), logits_adapted.detach().double()
    scale = max(1.0, float(a.abs().max()))
    max_abs = float((a - b).abs().max())
    kl = float(torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True,
                                          reduction="batchmean") / a.shape[1])
    loss_ref, loss_ad = float(out_ref.loss.detach()), float(loss_adapted.detach())
    true_params = dict(truth.named_parameters()) if truth is not None else {}
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
        t = true_params.get(name)
        if (t is None or t.grad is None) and diff > GRAD_RTOL * ref_max + GRAD_ATOL:  # no truth: fp32 decides
            failures.append(f"{name}: max |dgrad| {diff:.3g} vs max |grad| {ref_max:.3g}")
    logits_ok = max_abs <= LOGITS_RTOL * scale
    loss_ok = abs(loss_ref - loss_ad) <= LOSS_RTOL * max(1.0, abs(loss_ref))
    judged = AgainstTruth([], (-math.inf, 0.0, 0.0, ""), (0.0, 0.0, 0.0), (0.0, 0.0, 0.0))
    if truth is not None:
        args = (ref, out_ref, loss_adapted, logits_adapted, adapted_params, truth, out_truth)
        judged = against_truth(*args)
        if judged.failures and reorder is not None:
            again = reorder()
            if same_function(out_ref, again):
                judged = against_truth(*args, again=again)
        failures += judged.failures
        logits_ok, loss_ok = judged.logits[2] <= 0, judged.loss[2] <= 0
    _, err_hf, err_ad, err_name = judged.worst
    passed = (logits_ok and loss_ok and not failures and original_calls == 0 and math.isfinite(loss_ad))
    return SeedResult(seed, max_abs, max_abs / scale, loss_ref, loss_ad, kl, checked, worst, worst_name,
                      failures[:20], runtime_calls, original_calls, truth="fp64" if truth is not None else "",
                      logits_err_hf=judged.logits[0], logits_err_adapted=judged.logits[1], grad_err_hf=err_hf,
                      grad_err_adapted=err_ad, grad_err_param=err_name, loss_err_hf=judged.loss[0],
                      loss_err_adapted=judged.loss[1], passed=passed)
