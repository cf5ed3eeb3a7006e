"""A module's forward as `torch.export` captures it, and what the judge reads off the capture: run the same way in
the reference's process (on HuggingFace's module) and in the candidate's (in its jail), so the two graphs are
compared as what each side computes, not as what either says.

    graph = capture(module, args, kwargs, training=False)
    # {"ops": [...], "rng": [...], "grad_mode": [...], "detach": [...], "mutations": [[kind, target], ...],
    #  "sizes": {"input 0 dim 1": [low, high] or static size, ...}, "code": the printed graph, "digest": sha256}
    # or {"error": one line} where the module cannot be captured whole
    refusals(candidate_graph, reference_graph) -> list of reasons (empty: the graph holds nothing the module's lacks)

Every dimension of every tensor input is left to `torch.export` to keep symbolic (Dim.AUTO): a size the code
specialises (a branch on the sequence length, a reshape to a fixed batch) shows as a static size or a narrowed
range, and a branch on a value (`if x.max() > 1000`) cannot be captured at all. The training-mode graph
(`export`'s own IR) shows random-number ops, grad-mode switches and detaches as the code wrote them; its
functionalised form (`run_decompositions({})`) names what the forward changes in place: parameters, buffers and
inputs. What the graph holds is then judged against the reference's graph for the same inputs and mode:
nothing random, no grad-mode switch, no detach, no mutation, no narrower size, that the module's own graph lacks.
"""

from __future__ import annotations

import hashlib
import inspect
import re

import torch

RNG = re.compile(r"rand|bernoulli|normal|exponential|uniform|dropout|multinomial|poisson|geometric|cauchy|"
                 r"log_normal|random")
GRAD_MODE = re.compile(r"set_grad_enabled|_set_grad|inference_mode|no_grad|enable_grad")
DETACH = re.compile(r"\bdetach|\balias\b|lift_fresh")
EFFECTS = re.compile(r"with_effects|_print|record_stream|_assert_async")


def _dims(value) -> dict:
    """Dim.AUTO for every dimension of every tensor in `value` (the structure `export`'s dynamic_shapes takes)."""
    from torch.export import Dim

    if isinstance(value, torch.Tensor):
        return {d: Dim.AUTO for d in range(value.dim())}
    if isinstance(value, tuple | list):
        return type(value)(_dims(v) for v in value)
    if isinstance(value, dict):
        return {k: _dims(v) for k, v in value.items()}
    return None


def _bound(value) -> int | None:
    """A range's end as an int; None where it is unbounded (sympy's infinities)."""
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError, AttributeError):
        return None


def _sizes(program) -> dict:
    """Per user input dimension: [low, high] where symbolic (high None: unbounded), else its static size."""
    names = set(program.graph_signature.user_inputs)
    ranges = {str(k): v for k, v in program.range_constraints.items()}
    out = {}
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder" and n.name in names]
    for i, node in enumerate(placeholders):
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        for d, size in enumerate(value.shape):
            label = f"input {i} dim {d}"
            if isinstance(size, torch.SymInt):
                vr = ranges.get(str(size.node.expr))
                out[label] = [None, None] if vr is None else [_bound(vr.lower), _bound(vr.upper)]
            else:
                out[label] = int(size)
    return out


def capture(module: torch.nn.Module, args, kwargs: dict, *, training: bool) -> dict:
    """The module's forward in `training` mode, captured (module docstring); {"error": ...} where it cannot be."""
    from torch.export import export

    module.train(training)
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)  # export takes the shapes by parameter
        shapes = {name: _dims(value) for name, value in bound.arguments.items()}
        program = export(module, tuple(args), dict(kwargs), dynamic_shapes=shapes, strict=False)
        functional = program.run_decompositions({})
    except Exception as exc:  # noqa: BLE001 - what cannot be captured is the finding
        return {"error": f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"}
    ops = sorted({str(n.target) for n in program.graph.nodes if n.op == "call_function"})
    mutations = sorted([spec.kind.name, str(spec.target)] for spec in functional.graph_signature.output_specs
                       if spec.kind.name.endswith("_MUTATION"))
    code = program.graph_module.print_readable(print_output=False, include_stride=False, include_device=False)
    code = re.sub(r"# File: .*\n", "", code)  # where the code lives differs between the sides and runs
    return {"ops": ops, "rng": [o for o in ops if RNG.search(o)], "grad_mode": [o for o in ops if GRAD_MODE.search(o)],
            "detach": [o for o in ops if DETACH.search(o)], "effects": [o for o in ops if EFFECTS.search(o)],
            "mutations": mutations, "sizes": _sizes(program), "code": code,
            "digest": hashlib.sha256(code.encode()).hexdigest()}


def _narrower(mine, theirs) -> bool:
    if isinstance(theirs, int):  # the module specialises it too: a candidate may as well
        return False
    if isinstance(mine, int):
        return True
    low, high = mine
    their_low, their_high = theirs
    return (low or 0) > (their_low or 0) or (their_high is None and high is not None) or \
        (high is not None and their_high is not None and high < their_high)


def refusals(mine: dict, theirs: dict) -> list[str]:
    """Why the candidate's graph is refused next to the module's for the same inputs and mode (empty: it is not)."""
    if "error" in mine:
        return [f"it cannot be captured whole as a graph ({mine['error']}), where the module can"]
    why = []
    for kind, words in (("rng", "draws random numbers"), ("grad_mode", "switches gradient mode"),
                        ("detach", "detaches a tensor from the graph"), ("effects", "has effects outside the tensors")):
        extra = sorted(set(mine.get(kind, ())) - set(theirs.get(kind, ())))
        if extra:
            why.append(f"it {words} where the module does not ({', '.join(extra[:3])})")
    extra = [f"{kind.lower().replace('_', ' ')} of {target}" for kind, target in mine.get("mutations", ())
             if [kind, target] not in theirs.get("mutations", ())]
    if extra:
        why.append(f"it changes in place what the module does not ({', '.join(extra[:3])})")
    narrowed = [label for label, size in mine.get("sizes", {}).items()
                if label in theirs.get("sizes", {}) and _narrower(size, theirs["sizes"][label])]
    if narrowed:
        shown = ", ".join(f"{label}: {mine['sizes'][label]}" for label in narrowed[:3])
        why.append(f"it specialises sizes the module leaves free ({shown})")
    return why
