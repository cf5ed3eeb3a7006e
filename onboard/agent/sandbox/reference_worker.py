"""The reference's process: HuggingFace's side of every judged call, in a process that never loads candidate
code (started by `onboard.agent.sandbox.process`; it has no secrets either, and no network where the kernel
allows a namespace of its own).

    python -m onboard.agent.sandbox.reference_worker READ_FD WRITE_FD PARENT_PID MEMORY_BYTES

    cases   {model, trust_remote_code, module_path, cases: [{batch, tokens, ids_seed, weights_seed, magnitude,
             negate, sparsity, cotangent_seed, rng}], modes}
            per case: the module's real inputs from a forward of the twin on a random batch of that length
            (stopped as soon as the module is reached), the floating positional inputs transformed (rescaled,
            negated, sparsified), a copy of the module with parameters redrawn from the case's seed, and per
            mode (eval / train) its outputs, input and parameter gradients against random cotangents, and its
            parameters and buffers after the call: everything the judge needs to hold a candidate against it
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
        out.append(a)
    return tuple(out)


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


def _judged(module, args, kwargs, case: dict, mode: str, prefix: str, tensors: dict, wire) -> dict:
    """Run one case in one mode; its outputs, gradients, state after and cotangents into `tensors`."""
    from onboard.agent.sandbox.calls import Call, cotangents_for

    module.train(mode == "train")
    graded = copy.deepcopy(module)  # before any call: a forward may change the module's buffers
    probe = Call(module, args, kwargs, grad=False, rng=case.get("rng") if mode == "train" else None)
    cotangents = cotangents_for(probe.run(), int(case["cotangent_seed"]))
    call = Call(graded, args, kwargs, rng=probe.rng, cotangents=cotangents)
    out = call.run()
    structure, _ = wire.pack(out, tensors, prefix=f"{prefix}o")
    cots, _ = wire.pack(cotangents, tensors, prefix=f"{prefix}c")
    tensors.update({f"{prefix}{k}": v for k, v in call.grads().items()})
    tensors.update({f"{prefix}{k}": v for k, v in call.state().items()})
    return {"outputs": structure, "cotangents": cots}


def cases(request: dict, wire) -> tuple[dict, dict]:
    import torch

    twin = _twin(request["model"], bool(request.get("trust_remote_code")))
    live = twin.model.get_submodule(request["module_path"])
    tensors: dict = {}
    out = []
    for i, case in enumerate(request["cases"]):
        gen = torch.Generator().manual_seed(int(case["ids_seed"]))
        ids = torch.randint(3, twin.vocab_size, (int(case.get("batch", 1)), int(case["tokens"])), generator=gen)
        args, kwargs = inputs_of(twin.model, live, ids)
        args = transform(args, case, gen)
        module = copy.deepcopy(live)
        redraw(module, int(case["weights_seed"]))
        prefix = f"c{i}."
        entry = {"state": _state(module, prefix, tensors)}
        entry["args"], _ = wire.pack(args, tensors, prefix=f"{prefix}a")
        entry["kwargs"], _ = wire.pack(kwargs, tensors, prefix=f"{prefix}k")
        entry["modes"] = {mode: _judged(copy.deepcopy(module), args, kwargs, case, mode, f"{prefix}{mode}.",
                                        tensors, wire) for mode in request.get("modes", ("eval",))}
        out.append(entry)
    return {"cases": out}, tensors


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
