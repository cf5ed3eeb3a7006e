"""The `rules` policy: readings of a module rendered from templates/generated/, offline and deterministic.

    for candidate in RulesPolicy().propose(task, module, history): ...

Each reading looks at the module's parameters (by shape), its plain settings (`runtime.generated.settings`) and
its forward's signature, and either declines (None) or fills its template: a thin `Generated` subclass that
calls a reviewed runtime op with the module's own tensors. Where the parameters leave a choice open (which
of two equal-shaped vectors is a scale and which a bias), a reading yields its assignments in order, names
that say so first; the probe decides, and a refused assignment is the next round's repair. Readings:

- `hyper_connection`: DeepSeek-V4's manifold-constrained hyper-connections (`runtime.hyper_connection`):
  a (N(N+2), N*D) projection, an N(N+2) bias and 3 scales; an iteration count and two epsilons in its settings;
- `residual_affine_sum`: (a + bias_a) * scale_a + (b + bias_b) * scale_b of two inputs with four (H,) vectors
  (`runtime.residual`), ZAYA's residual scaling.
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Iterator

from torch import nn

from onboard.agent.candidate import Candidate
from onboard.agent.tasks import Task
from onboard.codegen import environment
from runtime.generated import settings

POLICY = "rules"


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


def hyper_connection(task: Task, module: nn.Module) -> Iterator[Candidate]:
    params = dict(module.named_parameters())
    args = _forward_args(module)
    if len(args) != 1:
        return
    for fn_name, fn in params.items():
        if fn.dim() != 2:
            continue
        n = round(math.sqrt(fn.shape[0] + 1) - 1)  # rows N(N+2) = (N+1)^2 - 1
        if n < 1 or n * (n + 2) != fn.shape[0] or fn.shape[1] % n:
            continue
        bases = [k for k, p in params.items() if tuple(p.shape) == (fn.shape[0],)]
        scales = [k for k, p in params.items() if tuple(p.shape) == (3,)]
        found = settings(module)
        ints = [k for k, v in found.items() if "." not in k and type(v) is int and v > 1 and v != n]
        own_floats = [k for k, v in found.items() if "." not in k and type(v) is float]
        sub_floats = [k for k, v in found.items() if "." in k and type(v) is float]
        if not (bases and scales and ints and own_floats and sub_floats):
            continue
        for base, scale, iters, eps, norm_eps in itertools.product(
                _ranked(bases, "base", "bias"), _ranked(scales, "scale"), _ranked(ints, "sinkhorn", "iter"),
                _ranked(own_floats, "eps"), _ranked(sub_floats, "norm", "eps")):
            hypothesis = (f"manifold-constrained hyper-connection weights (DeepSeek-V4 mHC) over {n} residual "
                          f"streams of width {fn.shape[1] // n}: `{fn_name}` projects the RMS-normalised streams "
                          f"(norm eps `{norm_eps}`) to pre / post / comb mixes, biased by `{base}` and scaled by "
                          f"`{scale}`; comb made doubly stochastic by `{iters}` Sinkhorn iterations (eps "
                          f"`{eps}`); returns (post, comb, the streams collapsed by pre)")
            yield _render("hyper_connection", task, hypothesis, arg=args[0], fn=fn_name, base=base, scale=scale,
                          iters=iters, eps=eps, norm_eps=norm_eps)


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


READINGS = (hyper_connection, residual_affine_sum)


class RulesPolicy:
    """Every reading's candidates for the module, in order; a failed round moves on to the next candidate."""

    name = POLICY

    def propose(self, task: Task, module: nn.Module, history: list[dict]) -> Iterator[Candidate]:
        for reading in READINGS:
            yield from reading(task, module)
