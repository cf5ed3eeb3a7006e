"""The reference's process: HuggingFace's side of every judged call, in a process that never loads candidate
code (started by `onboard.agent.sandbox.process`; it has no secrets either, and no network where the kernel
allows a namespace of its own).

    python -m onboard.agent.sandbox.reference_worker READ_FD WRITE_FD PARENT_PID MEMORY_BYTES

    cases   {model, trust_remote_code, module_path, cases: [{batch, tokens, ids_seed, weights_seed, magnitude,
             negate, sparsity, outliers, bf16_values, dtype, frozen, autocast, second, cotangent_seed, rng}], modes}
            per case: the module's real inputs from a forward of the twin on a random batch of that length
            (stopped as soon as the module is reached), the floating positional inputs transformed (rescaled,
            negated, sparsified, a few entries made outliers, rounded to bf16 values), a copy of the module with
            parameters redrawn from the case's seed, module and floating inputs in the case's dtype, and per
            mode (eval / train) its outputs, input and parameter gradients against random cotangents, its
            parameters and buffers after the call and whether it drew random numbers; second derivatives where
            the case asks (`second`: a seed); outside fp32 the tolerance, from the same case's error against
            fp64; `frozen`: the modes whose calls have every parameter frozen (a LoRA fine-tune's module),
            `autocast`: every call's forward under bf16 autocast (the runtime's bf16 training): everything the
            judge needs to hold a candidate against it. A case in a dtype the module does
            not run in here is skipped, saying why.
    speed   {model, trust_remote_code, layers_path, layer, path, width, tokens, cotangent_seed}
            the same for one case at `width` times the twin's width (the model's first layer + 1 layers)
    repeat  {times}                                the speed case again, `times` times (timed from outside)
    end

The twin is built once per process and never changed: every case works on a copy of the module.
"""

from __future__ import annotations

import copy
import math
import os
import sys

_TWINS: dict = {}
_SPEED: dict = {}


class _Reached(Exception):
    """Raised from the module's pre-hook: its inputs are recorded and the rest of the forward is not needed."""


def redraw(module, seed: int) -> None:
    """Every parameter drawn anew from `seed` (whatever transformers' init left, every value matters)."""
    import torch

    gen = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for _, param in sorted(module.named_parameters()):
            std = 1 / math.sqrt(param.shape[-1]) if param.dim() >= 2 else 0.5
            param.copy_(torch.randn(param.shape, generator=gen, dtype=param.dtype) * std)


def inputs_of(model, module, input_ids):
    """The (args, kwargs) `module` is called with when `model` runs on `input_ids` (its first call)."""
    import torch

    seen = {}

    def hook(_, args, kwargs):
        seen["inputs"] = (args, kwargs)
        raise _Reached

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False)
    except _Reached:
        pass
    finally:
        handle.remove()
    if "inputs" not in seen:
        raise ValueError("the module did not run in the model's forward")
    return seen["inputs"]


def transform(args, case: dict, gen):
    """The floating positional inputs rescaled to the case's largest |value| (`magnitude`, 0: as they are),
    negated and sparsified as the case says."""
    import torch

    out = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            magnitude = float(case.get("magnitude") or 0.0)
            if magnitude and a.numel() and float(a.abs().max()) > 0:
                a = a * (magnitude / a.abs().max())
            if case.get("negate"):
                a = -a
            if case.get("sparsity"):
                a = a * (torch.rand(a.shape, generator=gen) >= float(case["sparsity"])).to(a.dtype)
            if case.get("outliers") and a.numel():  # one entry in a thousand (at least one) 100x the rest
                picked = torch.randperm(a.numel(), generator=gen)[: max(1, a.numel() // 1000)]
                a = a.flatten().index_put((picked,), a.flatten()[picked] * 100.0).view(a.shape)
            if case.get("bf16_values"):  # values a bf16 model gives, held in the case's dtype
                a = a.to(torch.bfloat16).to(a.dtype)
        out.append(a)
    return tuple(out)


def _cast(value, dtype):
    """Every floating tensor in `value` (a structure of them) in `dtype`."""
    import torch

    from onboard.agent.sandbox.calls import map_leaves

    return map_leaves(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, value)


def _twin(model: str, trust: bool):
    from onboard.source import resolve
    from onboard.twin import Twin

    key = (model, trust)
    if key not in _TWINS:
        _TWINS[key] = Twin.build(resolve(model, trust_remote_code=trust))
    return _TWINS[key]


def _state(module, prefix: str, tensors: dict) -> dict:
    from runtime.generated import ModuleState

    state = ModuleState.of(module)
    tensors.update({f"{prefix}p:{n}": p for n, p in state.parameters.items()})
    tensors.update({f"{prefix}b:{n}": b for n, b in state.buffers.items()})
    return {"settings": state.settings, "parameters": sorted(state.parameters), "buffers": sorted(state.buffers),
            "persistent": sorted(state.persistent), "replaces": state.replaces}


def _judged(module, args, kwargs, case: dict, mode: str, cotangents=None) -> dict:
    """Run one case in one mode: what the judge is sent, by name (outputs, cotangents, gradients, state after,
    second derivatives), and the outputs' structure. `cotangents` given: those (the fp64 run of a case in another
    dtype takes the case's own)."""
    from onboard.agent.sandbox.calls import Call, conditions, cotangents_for

    module.train(mode == "train")
    second = case.get("second")
    fresh = copy.deepcopy(module) if second is not None else None  # before any call: a forward may change buffers
    graded = copy.deepcopy(module)
    how = conditions(case, mode)
    probe = Call(module, args, kwargs, grad=False, rng=case.get("rng") if mode == "train" else None, **how)
    out = probe.run()
    if cotangents is None:
        cotangents = cotangents_for(out, int(case["cotangent_seed"]))
    call = Call(graded, args, kwargs, rng=probe.rng, cotangents=cotangents, **how)
    out = call.run()
    named = {"o": out, "c": cotangents, **call.grads(), **call.state()}
    if fresh is not None:
        twice = Call(fresh, args, kwargs, rng=probe.rng, **how)
        twice.run()
        named.update(twice.second(cotangents, int(second)))
    return {"named": named, "drew": probe.drew or call.drew, "stream": call.stream,
            "written": {"grad": call.written, "no_grad": probe.written}}


def _tolerance(run: dict, exact: dict) -> dict:
    """4x the largest error of a run in a lower precision against the same case in fp64 (outputs; gradients,
    second derivatives included), at least the fp32 tolerance: what a candidate as exact as the module itself
    in that dtype stays within."""
    from onboard.agent.sandbox.judge import TOLERANCE, error
    from onboard.agent.sandbox.wire import leaves

    def worst(pairs) -> float:
        return max((error(a, b) for a, b in pairs), default=0.0)

    mine, theirs = run["named"], exact["named"]
    out = worst(zip(leaves(mine["o"]), leaves(theirs["o"])))
    grad = worst((mine[k], theirs[k]) for k in mine if k[:2] in ("g:", "h:") and k in theirs)
    return {"output": max(TOLERANCE, 4 * out), "gradient": max(TOLERANCE, 4 * grad)}


def _packed(run: dict, prefix: str, tensors: dict, wire) -> dict:
    named = dict(run["named"])
    entry = {"drew": run["drew"], "stream": run["stream"], "written": run["written"]}
    entry["outputs"], _ = wire.pack(named.pop("o"), tensors, prefix=f"{prefix}o")
    entry["cotangents"], _ = wire.pack(named.pop("c"), tensors, prefix=f"{prefix}c")
    tensors.update({f"{prefix}{k}": v for k, v in named.items()})
    entry["second"] = any(k.startswith("h:") for k in named)
    return entry


def _case(live, twin, case: dict, prefix: str, modes, tensors: dict, wire, kept: list | None = None) -> dict:
    """One case's entry; `kept`, where given, gets (module before any call, args, kwargs)."""
    import torch

    gen = torch.Generator().manual_seed(int(case["ids_seed"]))
    ids = torch.randint(3, twin.vocab_size, (int(case.get("batch", 1)), int(case["tokens"])), generator=gen)
    args, kwargs = inputs_of(twin.model, live, ids)
    args = transform(args, case, gen)
    module = copy.deepcopy(live)
    redraw(module, int(case["weights_seed"]))
    mixed = case.get("dtype") == "mixed"  # the first floating input in bf16, the rest and the module in fp32
    dtype = torch.float32 if mixed else getattr(torch, str(case.get("dtype") or "float32"), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"a case in {case.get('dtype')!r}")
    exact = None
    if dtype != torch.float32 or mixed:
        exact = (copy.deepcopy(module).double(), _cast(args, torch.float64), _cast(kwargs, torch.float64))
    if mixed:  # a bf16 block's output beside an fp32 residual stream, as bf16 models call residual modules
        first = next((i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
        if first is None:
            raise TypeError("no floating input to give in bf16")
        args = tuple(a.to(torch.bfloat16) if i == first else a for i, a in enumerate(args))
        exact = (exact[0], tuple(a.double() if i == first else e for i, (a, e) in enumerate(zip(args, exact[1]))),
                 exact[2])
    elif dtype != torch.float32:
        module, args, kwargs = module.to(dtype), _cast(args, dtype), _cast(kwargs, dtype)
    if kept is not None:
        kept.append((copy.deepcopy(module), args, kwargs))
    runs = {mode: _judged(copy.deepcopy(module), args, kwargs, case, mode) for mode in modes}
    entry = {"state": _state(module, prefix, tensors)}
    entry["args"], _ = wire.pack(args, tensors, prefix=f"{prefix}a")
    entry["kwargs"], _ = wire.pack(kwargs, tensors, prefix=f"{prefix}k")
    entry["modes"] = {mode: _packed(run, f"{prefix}{mode}.", tensors, wire) for mode, run in runs.items()}
    if exact is not None:  # from evaluation mode, which draws nothing: train mode's dropout may draw otherwise in fp64
        run = runs.get("eval") or _judged(copy.deepcopy(module), args, kwargs, case, "eval")
        truth = {**case, "autocast": False}  # fp64 throughout: autocast would leave it so anyway
        entry["tolerance"] = _tolerance(run, _judged(exact[0], exact[1], exact[2], truth, "eval",
                                                     cotangents=_cast(run["named"]["c"], torch.float64)))
    return entry


def cases(request: dict, wire) -> tuple[dict, dict]:
    twin = _twin(request["model"], bool(request.get("trust_remote_code")))
    live = twin.model.get_submodule(request["module_path"])
    tensors: dict = {}
    out = []
    kept: list = []  # the first two cases' modules and inputs: the sequence's micro-batches
    for i, case in enumerate(request["cases"]):
        prefix = f"c{i}."
        if case.get("dtype", "float32") == "float32":
            out.append(_case(live, twin, case, prefix, request.get("modes", ("eval",)), tensors, wire,
                             kept if i < 2 else None))
            continue
        mine: dict = {}
        try:  # outside fp32, a module may not run at all here (an op without a CPU kernel in that dtype)
            out.append(_case(live, twin, case, prefix, request.get("modes", ("eval",)), mine, wire))
            tensors.update(mine)
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            out.append({"skipped": f"the module does not run in {case['dtype']} here: "
                                   f"{(str(exc).splitlines() or [''])[0][:200]}"})
    header = {"cases": out}
    asked = request.get("sequence")
    if asked and len(kept) == 2:  # the first case's module, its inputs and the second's as two micro-batches
        from onboard.agent.sandbox.calls import sequence

        module = kept[0][0]
        got = sequence(module, [(args, kwargs) for _, args, kwargs in kept], seed=int(asked["seed"]),
                       rng=int(asked["rng"]))
        tensors.update({f"q.{k}": v for k, v in got.items()})
        header["sequence"] = True
    return header, tensors


def speed(request: dict, wire) -> tuple[dict, dict]:
    import torch

    from onboard.agent.sandbox.calls import Call, cotangents_for
    from onboard.source import resolve
    from onboard.twin import Twin, instantiate

    key = (request["model"], bool(request.get("trust_remote_code")), request["layer"], request.get("width", 8))
    if key not in _SPEED:
        source = resolve(request["model"], trust_remote_code=key[1])
        cfg = Twin.build(source, layers=request["layer"] + 1, width=request.get("width", 8), check=False).config.to_dict()
        _SPEED[key] = (instantiate(source, type(source.config).from_dict(cfg)).eval(), cfg)
    model, cfg = _SPEED[key]
    module = model.get_submodule(f"{request['layers_path']}.{request['layer']}.{request['path']}")
    vocab = min(int(cfg.get("vocab_size") or 1000), 1000)
    ids = torch.randint(3, vocab, (1, request.get("tokens", 1024)),
                        generator=torch.Generator().manual_seed(int(request.get("ids_seed", 0))))
    args, kwargs = inputs_of(model, module, ids)
    module = copy.deepcopy(module)
    redraw(module, int(request.get("weights_seed", 0)))
    tensors: dict = {}
    entry = {"state": _state(module, "", tensors)}
    entry["args"], _ = wire.pack(args, tensors, prefix="a")
    entry["kwargs"], _ = wire.pack(kwargs, tensors, prefix="k")
    graded = copy.deepcopy(module)
    cotangents = cotangents_for(Call(module, args, kwargs, grad=False).run(), int(request["cotangent_seed"]))
    call = Call(graded, args, kwargs, cotangents=cotangents)
    out = call.run()
    entry["outputs"], _ = wire.pack(out, tensors, prefix="o")
    entry["cotangents"], _ = wire.pack(cotangents, tensors, prefix="c")
    entry["written"] = call.written
    tensors.update(call.grads())
    tensors.update(call.state())
    _SPEED["last"] = call
    return entry, tensors


def main(argv: list[str]) -> None:
    read_fd, write_fd, parent, memory = (int(a) for a in argv[1:5])
    from onboard.agent.sandbox import confine

    network = confine.early(parent)
    confine.memory(memory)
    import torch
    from transformers import AutoModelForCausalLM  # noqa: F401 - imported before the first request needs it

    from onboard.agent.sandbox import wire
    import onboard.source  # noqa: F401
    import onboard.twin.build  # noqa: F401

    torch.set_num_threads(1)
    reader, writer = os.fdopen(read_fd, "rb"), os.fdopen(write_fd, "wb")
    wire.write(writer, {"ready": os.getpid(), "network": network or "a network namespace of its own"})
    while True:
        try:
            request, _ = wire.read(reader)
        except EOFError:
            return
        op = request.get("op")
        if op == "end":
            return
        try:
            if op == "cases":
                header, tensors = cases(request, wire)
            elif op == "speed":
                header, tensors = speed(request, wire)
            elif op == "repeat":
                for _ in range(int(request.get("times", 1))):
                    _SPEED["last"].run()
                header, tensors = {"repeated": True}, {}
            else:
                header, tensors = {"error": f"unknown op {op!r}"}, {}
        except Exception as exc:  # noqa: BLE001 - the model's own failure on these inputs: reported, not fatal
            header, tensors = {"error": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:400]}"}, {}
        wire.write(writer, header, tensors)


if __name__ == "__main__":
    main(sys.argv)
    # ended as asked: nothing here to save, and tearing down an interpreter that imported torch takes a
    # second that every round and every sandbox close would wait for
    sys.stderr.flush()
    os._exit(0)
