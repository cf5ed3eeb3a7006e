"""The `rules` policy: readings of a module rendered from templates/generated/, offline and deterministic.

    RulesPolicy().run(task, module, trial, record)      # trial(candidate) -> outcome, from onboard.agent.loop

Each reading looks at the module's parameters (by shape), its plain settings (`runtime.generated.settings`) and
its forward's signature, and either declines (None) or fills its template: a thin `Generated` subclass that
calls a reviewed runtime op with the module's own tensors. Where the parameters leave a choice open (which
of two equal-shaped vectors is a scale and which a bias), a reading yields its assignments in order, names
that say so first; the probe decides, and a refused assignment is the next round's repair. Readings:

- `hyper_connection`: hyper-connection weights (`runtime.hyper_connection`): DeepSeek-V4's form, a (N(N+2), N*D)
  projection, an N(N+2) bias and 3 scales, an iteration count and two epsilons in its settings; HY-V4's form
  without comb, a (2N, N*D) projection, 2N bias, 2 scales, a post magnitude;
- `residual_affine_sum`: (a + bias_a) * scale_a + (b + bias_b) * scale_b of two inputs with four (H,) vectors
  (`runtime.residual`), ZAYA's residual scaling;
- `short_conv_residual`: a depthwise causal short convolution around the identity, scaled by 1 / sqrt(W + 1) or
  not (`runtime.residual`), Inkling's short convolutions;
- `sparse_mixer_router`: one (E, H) projection to scores, then sparse-mixer routing (`runtime.moe.sparse_mixer`),
  PhiMoE's router, the routing the runtime's own MoE block does not compute.
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from onboard.adapt.codegen import environment
from onboard.agent.candidate import Candidate, propose_in_order
from onboard.agent.tasks import Task
from runtime.generated import settings

POLICY = "rules"


@dataclass(frozen=True)
class Declined:
    """A reading that recognised the module's kind and still proposes nothing: why, naming the setting or the
    tensor that rules it out (said in the agent's record and in the bundle where nothing else is proposed)."""
    reading: str
    why: str

    def __str__(self) -> str:
        return f"{self.reading}: {self.why}"

    def said(self, task: str, record) -> str:
        """Record the decline for `task` (an agent.jsonl event a replay reads back); what it says."""
        record("declined", task=task, reading=self.reading, why=self.why)
        return str(self)


def _forward_args(module: nn.Module) -> list[str]:
    """The names of the module forward's positional parameters (after self)."""
    params = inspect.signature(module.forward).parameters.values()
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _ranked(names: list[str], *hints: str) -> list[str]:
    """Names containing a hint first (in hint order), then the rest; stable."""
    return sorted(names, key=lambda n: next((i for i, h in enumerate(hints) if h in n.lower()), len(hints)))


def _render(reading: str, task: Task, hypothesis: str, **fields) -> Candidate:
    code = environment().get_template(f"generated/{reading}.py.j2").render(
        policy=POLICY, path=task.path, replaces=task.module_class, hypothesis=hypothesis, **fields)
    return Candidate(reading, hypothesis, code, POLICY)


def _streams(rows: int, cols: int) -> list[tuple[int, bool]]:
    """(stream count N, with comb) that a (rows, cols) hyper-connection projection fits: rows N(N+2) (pre,
    post, comb) or 2N (pre, post), cols a multiple of N."""
    out = []
    n = round(math.sqrt(rows + 1) - 1)
    if n >= 1 and n * (n + 2) == rows and cols % n == 0:
        out.append((n, True))
    if rows % 2 == 0 and cols % (rows // 2) == 0 and rows // 2 != n:
        out.append((rows // 2, False))
    return out


def hyper_connection(task: Task, module: nn.Module) -> Iterator[Candidate]:
    params = dict(module.named_parameters())
    args = _forward_args(module)
    if len(args) != 1:
        return
    found = settings(module)
    own_floats = _ranked([k for k, v in found.items() if "." not in k and type(v) is float], "eps")
    sub_floats = _ranked([k for k, v in found.items() if "." in k and type(v) is float], "norm", "eps")
    for fn_name, fn in params.items():
        if fn.dim() != 2:
            continue
        for n, with_comb in _streams(*fn.shape):
            bases = _ranked([k for k, p in params.items() if tuple(p.shape) == (fn.shape[0],)], "base", "bias")
            scales = _ranked([k for k, p in params.items() if tuple(p.shape) == (3 if with_comb else 2,)], "scale")
            ints = _ranked([k for k, v in found.items() if "." not in k and type(v) is int and v > 1 and v != n],
                           "sinkhorn", "iter")
            if not (bases and scales and own_floats and sub_floats and (ints or not with_comb)):
                continue
            if with_comb:  # post = 2 sigmoid(..), no eps on it (DeepSeek-V4)
                variants = [(iters, eps, [("sinkhorn_iters", f"self.{iters}")]) for iters in ints for eps in own_floats]
            else:  # post = magnitude * sigmoid(..) + eps, the magnitude a setting or 2 (HY-V4)
                magnitudes = [f"self.{k}" for k in _ranked(own_floats + ints, "magnitude", "post")]
                variants = [(None, eps, [("post_magnitude", magnitude), ("post_eps", post_eps)])
                            for eps in own_floats for magnitude in [*magnitudes, "2.0"] if magnitude != f"self.{eps}"
                            for post_eps in (f"self.{eps}", "0.0")]
            for base, scale, norm_eps, (iters, eps, extra) in itertools.product(bases, scales, sub_floats, variants):
                what = (f"comb made doubly stochastic by `{iters}` Sinkhorn iterations; returns (post, comb, the "
                        f"streams collapsed by pre)" if with_comb else
                        f"post = {dict(extra)['post_magnitude']} * sigmoid(..) + {dict(extra)['post_eps']}; "
                        f"returns (post, the streams collapsed by pre)")
                hypothesis = (f"hyper-connection weights over {n} residual streams of width {fn.shape[1] // n}"
                              f"{' (DeepSeek-V4 mHC)' if with_comb else ' without comb (HY-V4 form)'}: `{fn_name}` "
                              f"projects the streams, RMS-normalised (eps `{norm_eps}`), to the mixes, biased by "
                              f"`{base}` and scaled by `{scale}` (eps `{eps}`); {what}")
                options = [("eps", f"self.{eps}"), ("norm_eps", f"self.{norm_eps}"), *extra]
                yield _render("hyper_connection", task, hypothesis, arg=args[0], fn=fn_name, base=base, scale=scale,
                              options=options)


def _side_hints(scale: str, bias: str, arg: str) -> int:
    """How many names agree with reading `scale` and `bias` as the affine map of input `arg`."""
    return (("scale" in scale) + ("bias" in bias) + (scale.replace("scale", "") == bias.replace("bias", ""))
            + (arg.split("_")[0] in scale))


def residual_affine_sum(task: Task, module: nn.Module) -> Iterator[Candidate]:
    params = dict(module.named_parameters())
    args = _forward_args(module)
    if len(args) != 2 or len(params) != 4 or len({tuple(p.shape) for p in params.values()}) != 1:
        return
    if next(iter(params.values())).dim() != 1 or list(module.buffers()):
        return
    # each input gets one scale and one bias; assignments whose names say so come first
    orders = sorted(itertools.permutations(sorted(params)),
                    key=lambda o: -(_side_hints(o[0], o[1], args[0]) + _side_hints(o[2], o[3], args[1])))
    for scale_a, bias_a, scale_b, bias_b in orders:
        hypothesis = (f"a residual sum with an affine map per side: ({args[0]} + `{bias_a}`) * `{scale_a}` + "
                      f"({args[1]} + `{bias_b}`) * `{scale_b}`, each vector broadcast over tokens")
        yield _render("residual_affine_sum", task, hypothesis, args=args, scale_a=scale_a, bias_a=bias_a,
                      scale_b=scale_b, bias_b=bias_b)


def _signature(module: nn.Module) -> tuple[str, list[str], bool]:
    """The forward's parameters as source (annotations dropped: they name transformers' types), their names, and
    whether it takes **kwargs; defaults only of plain values."""
    parts, names, var_kw = [], [], False
    for p in inspect.signature(module.forward).parameters.values():
        if p.kind == p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
            var_kw = True
        elif p.kind == p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
        elif p.default is p.empty:
            parts.append(p.name)
        elif p.default is None or isinstance(p.default, int | float | bool | str):
            parts.append(f"{p.name}={p.default!r}")
        else:
            return "", [], False
        names.append(p.name)
    return ", ".join(parts), names, var_kw


def short_conv_residual(task: Task, module: nn.Module) -> Iterator[Candidate]:
    convs = [(name, sub) for name, sub in module.named_modules()
             if isinstance(sub, nn.Conv1d) and sub.groups == sub.in_channels == sub.out_channels]
    signature, names, var_kw = _signature(module)
    if len(convs) != 1 or not names or len(dict(module.named_parameters())) > 2:
        return
    conv_name, conv = convs[0]
    width = conv.kernel_size[0]
    prefix = f"{conv_name}." if conv_name else ""
    found = settings(module)
    width_setting = next((k for k, v in found.items() if "." not in k and v == width and type(v) is int), None)
    width_expr = f"self.{width_setting}" if width_setting else str(width)
    masks = [n for n in names[1:] if "mask" in n]
    caches = [n for n in names[1:] if "cache" in n and inspect.signature(module.forward).parameters[n].default is None]
    bias = f"self.{prefix}bias" if conv.bias is not None else "None"
    for scale, said in ((f"1 / math.sqrt({width_expr} + 1)", f"1 / sqrt({width} + 1)"), ("1.0", "1")):
        hypothesis = (f"a depthwise causal convolution of width {width} (`{prefix}weight`) around the identity: "
                      f"(conv({names[0]}{' * ' + masks[0] if masks else ''}) + {names[0]}) * {said}, in fp32")
        yield _render("short_conv_residual", task, hypothesis, signature=signature, x=names[0],
                      weight=f"{prefix}weight", bias=bias, scale=scale, mask=masks[0] if masks else None,
                      cache=caches[0] if caches else None,
                      seq_idx=f"{names[-1]}.get('seq_idx')" if var_kw else "None")


def sparse_mixer_router(task: Task, module: nn.Module) -> Iterator[Candidate | Declined]:
    params = dict(module.named_parameters())
    args = _forward_args(module)
    projections = [name for name, p in params.items() if p.dim() == 2]
    if len(args) != 1 or len(projections) != 1:
        return  # not a router of one projection of the tokens
    extra = [n for n in params if n not in projections] + [n for n, _ in module.named_buffers()]
    weight, found = projections[0], settings(module)
    experts = params[weight].shape[0]
    if extra:  # a router with more to it than its scores: a learned scale, a selection bias, ...
        yield Declined("sparse_mixer_router", f"besides its projection `{weight}` ({experts} x "
                       f"{params[weight].shape[1]}) the router holds {', '.join(f'`{n}`' for n in extra)}; the "
                       f"sparse mixer's router holds the projection alone")
        return
    if experts < 2:
        yield Declined("sparse_mixer_router", f"`{weight}` scores {experts} expert; the sparse mixer chooses 2")
        return
    # a top-k setting is no reason to decline: PhiMoE's mixer picks two experts in rounds whatever its top_k says,
    # and where a model's mixer reads it, the probe tells
    floats = _ranked([k for k, v in found.items() if "." not in k and type(v) is float], "router", "jitter", "eps")
    # the band's epsilon is one float setting; another one, if any, is the training-time input jitter
    for eps in floats:
        for jitter in [j for j in _ranked(floats, "input") if j != eps][:1] or [None]:
            hypothesis = (f"a router projection `{weight}` to {experts} scores, then sparse-mixer routing: two experts "
                          f"chosen in rounds among the scores within 2 * `{eps}` (relative) of the round's best, "
                          f"each weighted by its softmax share; Gumbel sampling and Heun's gradient estimate in "
                          f"training" + (f", inputs jittered by `{jitter}`" if jitter else "")
                          + "; returns (scores, weights, experts)")
            yield _render("sparse_mixer_router", task, hypothesis, arg=args[0], weight=weight, eps=eps,
                          input_jitter=jitter)


READINGS = (hyper_connection, residual_affine_sum, short_conv_residual, sparse_mixer_router)


class RulesPolicy:
    """Every reading's candidates for the module, in order; a failed round moves on to the next candidate."""

    name = POLICY

    def run(self, task: Task, module: nn.Module, trial, record) -> list[str]:
        """Propose every reading's candidates in turn; what the readings that declined said (recorded)."""
        declined: list[str] = []

        def candidates():
            for reading in READINGS:
                for c in reading(task, module):
                    if isinstance(c, Declined):
                        declined.append(c.said(task.path, record))
                    else:
                        yield c
        propose_in_order(candidates(), trial)
        return declined
