"""One call of a module, run the same way in the reference's process and in the candidate's: the inputs as
fresh leaves, torch's generator seeded where the call draws random numbers, forward, and backward with the
judge's cotangents; what it yields is the same set of tensors on both sides, named alike.

    call = Call(module, args, kwargs, grad=True, rng=None, cotangents=None)
    outputs = call.run()
    call.grads()          # {"g:input 0": ..., "g:<param>": ...}
    call.state()          # {"s:<param or buffer>": ...} after the call
    call.drew             # whether an unseeded call drew from torch's generator (evaluation mode must not)
    call.stream           # where a seeded call left the generator: both sides draw alike or not at all
    call.written          # the parameters, buffers and inputs the call changed in place (their version counters)
    call.second(cots, seed)  # {"h:input 0": ..., "h:<param>": ...}: second derivatives (below)

    Call(module, args, kwargs, **conditions(case, mode))   # frozen / autocast as a drawn case says

    sequence(module, batches, seed=..., rng=...)   # one module called again and again, as training uses it
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from onboard.agent.sandbox.wire import leaves


def map_leaves(fn, value):
    """`value` (tuples, lists and dicts of leaves) with `fn` applied to every leaf."""
    if isinstance(value, tuple | list):
        return type(value)(map_leaves(fn, v) for v in value)
    if isinstance(value, dict):
        return {k: map_leaves(fn, v) for k, v in value.items()}
    return fn(value)


def floats(value) -> list[torch.Tensor]:
    """The floating tensors of a value, in order (what cotangents pair with)."""
    return [t for t in leaves(value) if t.is_floating_point()]


class Call:
    def __init__(self, module: nn.Module, args, kwargs: dict, *, grad: bool = True, rng: int | None = None,
                 cotangents=None, inference: bool = False, frozen: bool = False, autocast: bool = False):
        """`inference`: without gradients, under torch.inference_mode (as generation runs) rather than no_grad;
        `frozen`: every parameter with requires_grad off, as a LoRA fine-tune leaves the module's own weights;
        `autocast`: the forward under torch.autocast in bf16, as the runtime trains in bf16 (fp32 parameters,
        backward outside it, as torch's recipe has it)."""
        self.module, self.grad, self.rng, self.cotangents = module, grad, rng, cotangents
        self.inference = inference and not grad
        self.autocast = autocast
        if frozen:
            module.requires_grad_(False)
        self.inputs: list[torch.Tensor] = []

        def leaf(t):
            if isinstance(t, torch.Tensor):
                t = t.detach().clone()
                if grad and t.is_floating_point():
                    t.requires_grad_()
                self.inputs.append(t)
            return t

        self.args, self.kwargs = map_leaves(leaf, tuple(args)), map_leaves(leaf, dict(kwargs))
        self.given: list[torch.Tensor] = []  # what the module was given in the last run, in the order of `inputs`
        self.outputs: list[torch.Tensor] = []  # floating outputs of the last run, for a later backward
        self.params = list(module.parameters())
        self.drew = False
        self.stream = ""
        self.written: list[str] = []

    def _given(self, t):
        """A module receives activations, not leaves: a copy of a leaf that needs a gradient (which reaches the
        leaf), so that a module that scales its input in place (PhiMoE's and DBRX's training jitter) runs as it
        does inside a model."""
        if isinstance(t, torch.Tensor):
            t = t.clone() if t.requires_grad else t
            self.given.append(t)
        return t

    def run(self):
        """Forward (and backward, with cotangents); the module's output."""
        for t in (*self.params, *self.inputs):
            t.grad = None
        if self.rng is not None:  # the CPU generator alone (torch.manual_seed also queues seeds for other
            torch.default_generator.manual_seed(int(self.rng))  # devices, reading the stack, which is refused)
        before = torch.default_generator.get_state()
        self.given = []
        watched = {**dict(self.module.named_parameters()), **dict(self.module.named_buffers())}
        with (torch.inference_mode() if self.inference else torch.set_grad_enabled(self.grad),
              torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast)):
            args, kwargs = map_leaves(self._given, self.args), map_leaves(self._given, self.kwargs)
            watched.update({f"input {i}": t for i, t in enumerate(self.given)})
            versions = {name: _version(t) for name, t in watched.items()}
            out = self.module(*args, **kwargs)
        # an unseeded call that draws is noise no test can pin down, and it moves the stream of whatever draws next
        after = torch.default_generator.get_state()
        self.drew = self.rng is None and not torch.equal(before, after)
        self.stream = hashlib.sha256(after.numpy().tobytes()).hexdigest()[:16] if self.rng is not None else ""
        self.outputs = floats(out)
        if self.cotangents is not None:
            self.backward(self.cotangents)
        # what the call wrote in place, by torch's own count (every in-place op on a tensor or a view of it, in any
        # spelling, moves its version): a change below the tolerance, a mark in the low bits, shows here exactly
        self.written = sorted(name for name, t in watched.items() if _version(t) != versions[name])
        return out

    def _paired(self, cotangents) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(output, cotangent) for each floating output that needs a gradient; ValueError where the cotangents
        do not fit the outputs."""
        given = floats(cotangents)
        if len(given) != len(self.outputs) or any(a.shape != b.shape for a, b in zip(self.outputs, given)):
            raise ValueError(f"outputs of shapes {[tuple(a.shape) for a in self.outputs]} where the module gives "
                             f"{[tuple(b.shape) for b in given]}")
        # copies: a tensor read off the wire may sit at any alignment, and the kernels a backward picks (so the
        # last bits of its sums) depend on it; fresh memory makes a call give the same bits on every run
        return [(a, b.to(a.dtype, copy=True)) for a, b in zip(self.outputs, given) if a.requires_grad]

    def backward(self, cotangents) -> None:
        pairs = self._paired(cotangents)
        if pairs:
            torch.autograd.backward([a for a, _ in pairs], [b for _, b in pairs])

    def second(self, cotangents, seed: int) -> dict[str, torch.Tensor]:
        """Second derivatives, after `run` with gradients and no cotangents: with first derivatives
        g = d<c, out>/dz over the inputs and parameters z (c: `cotangents`), the gradient of <w, g> for random
        weights w drawn from `seed`. A module whose first derivatives are right but pass through detached
        copies gives zeros here where the module gives its curvature."""
        named = {f"h:input {i}": t for i, t in enumerate(self.inputs) if t.requires_grad}
        named.update({f"h:{n}": p for n, p in self.module.named_parameters() if p.requires_grad})
        names = sorted(named)  # both sides draw the weights in one order, whatever order their parameters are in
        leaves = [named[n] for n in names]
        pairs = self._paired(cotangents)
        if not pairs or not leaves:
            return {}
        first = torch.autograd.grad([a for a, _ in pairs], leaves, [b for _, b in pairs], create_graph=True,
                                    allow_unused=True)
        gen = torch.Generator().manual_seed(seed)
        weights = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in leaves]
        terms = [(g * w).sum() for g, w in zip(first, weights) if g is not None and g.requires_grad]
        if not terms:
            return {}
        second = torch.autograd.grad(torch.stack(terms).sum(), leaves, allow_unused=True)
        return {n: h for n, h in zip(names, second) if h is not None}

    def grads(self) -> dict[str, torch.Tensor]:
        out = {f"g:input {i}": t.grad for i, t in enumerate(self.inputs) if t.grad is not None}
        out.update({f"g:{n}": p.grad for n, p in self.module.named_parameters() if p.grad is not None})
        return out

    def state(self) -> dict[str, torch.Tensor]:
        """The parameters and buffers after the call, and the inputs after it (a module that changes a tensor
        it was given, in place, changes its caller's: the judge holds both sides to the same)."""
        out = {f"s:{n}": p for n, p in self.module.named_parameters()}
        out.update({f"s:{n}": b for n, b in self.module.named_buffers()})
        out.update({f"s:input {i}": t for i, t in enumerate(self.given or self.inputs)})
        return out


def conditions(case: dict, mode: str) -> dict:
    """How a drawn case calls the module in `mode` (`Call`'s `frozen` and `autocast`), alike on both sides."""
    return {"frozen": mode in case.get("frozen", ()), "autocast": bool(case.get("autocast"))}


def _version(t: torch.Tensor) -> int:
    """A tensor's in-place version (-1 for an inference tensor, which keeps none)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def cotangents_for(outputs, seed: int):
    """Random cotangents for the floating outputs of `outputs` (the judge's output weights), drawn from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in floats(outputs)]


SEQUENCE_CALLS = 20
LEARNING_RATE = 1e-2


def sequence(module: nn.Module, batches: list, *, seed: int, rng: int) -> dict[str, torch.Tensor]:
    """One module object called SEQUENCE_CALLS times, as a training run and then inference call it, and what is
    compared after every call, by name ("<step>.o<i>" outputs, "<step>.s:" parameters, "<step>.b:" buffers,
    "<step>.grad:" the parameters' .grad):

    1, 2. the micro-batches `batches` ((args, kwargs) each) in training mode, forward and backward with random
          cotangents, their gradients accumulating in .grad (nothing zeroes them between the two);
    3.    after an optimizer step (p -= LEARNING_RATE * p.grad, the gradients cleared), an evaluation call;
    4...  the first batch again, alternating training and evaluation mode, with and without gradients (backward
          where on), to SEQUENCE_CALLS calls.

    Training-mode calls are seeded from `rng` and the step, the cotangents drawn from `seed`, alike on both
    sides. A module that keeps anything from call to call that the module it replaces does not (grown
    parameters, a counter, gradients zeroed or cut once they exist) shows it here."""
    gen = torch.Generator().manual_seed(seed)
    params = dict(module.named_parameters())
    seen: dict[str, torch.Tensor] = {}

    def call(step: int, args, kwargs, *, training: bool, grad: bool) -> None:
        module.train(training)
        if training:
            torch.default_generator.manual_seed(int(rng) + step)
        fresh = map_leaves(lambda t: t.detach().clone().requires_grad_(grad and t.is_floating_point())
                     if isinstance(t, torch.Tensor) else t, (tuple(args), dict(kwargs)))
        with torch.set_grad_enabled(grad):
            out = module(*fresh[0], **fresh[1])
        outputs = floats(out)
        cotangents = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in outputs]
        pairs = [(a, c) for a, c in zip(outputs, cotangents) if grad and a.requires_grad]
        if pairs:
            torch.autograd.backward([a for a, _ in pairs], [c for _, c in pairs])
        seen.update({f"{step}.o{i}": t.detach().clone() for i, t in enumerate(outputs)})
        seen.update({f"{step}.s:{n}": p.detach().clone() for n, p in params.items()})
        seen.update({f"{step}.b:{n}": b.detach().clone() for n, b in module.named_buffers()})
        seen.update({f"{step}.grad:{n}": p.grad.clone() for n, p in params.items() if p.grad is not None})

    for step, (args, kwargs) in enumerate(batches, 1):
        call(step, args, kwargs, training=True, grad=True)
    with torch.no_grad():  # the caller's optimizer, the same on both sides
        for p in params.values():
            if p.grad is not None:
                p.sub_(p.grad, alpha=LEARNING_RATE)
            p.grad = None
    args, kwargs = batches[0]
    for step in range(len(batches) + 1, SEQUENCE_CALLS + 1):
        call(step, args, kwargs, training=step % 2 == 0 and step > len(batches) + 1, grad=step % 3 == 0)
    return seen
