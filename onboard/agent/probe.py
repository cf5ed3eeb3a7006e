"""Hold a candidate replacement against the live HuggingFace module it would replace (run by `sandbox`).

    python -m onboard.agent.probe < requests.jsonl     # one JSON result line per request line
    {"op": "speed", ...}                                 # time a candidate that passed (`speed`)

A request names the model (a reference `onboard.source.resolve` reads), the module's path in the twin and the
candidate file. The probe builds the twin (once per process: it is never changed, so a later probe sees what a
fresh process would), records the module's real inputs from a forward pass of the twin per seed, redraws a
copy of the module's parameters from the seed (whatever transformers' init left, every value matters), and for
each seed and input scale runs that copy and the candidate (built on another copy, so neither sees the
other's gradients) forward and backward with the same random output weights; a module that computes something
else in training mode (random routing, jitter, dropout) is held against the candidate in training mode too,
both drawing from torch's generator seeded alike. It passes when every floating output, input gradient and
parameter gradient is within TOLERANCE of the module's, relative to that tensor's largest value, every integer
output (expert indices) is equal, and the module's outputs differ from one seed to the next (else the inputs
exercised nothing). Network access is refused in this process before the candidate is imported.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import resource
import socket
import sys

TOLERANCE = 1e-4  # fp32, relative to the tensor's largest value: a reading of the wrong thing is off by O(1)
SCALES = (1.0, 8.0)  # input scales: a candidate that only holds near the inputs' typical size fails the second


def _no_network() -> None:
    """Refuse every connection that is not to this machine (the candidate runs in this process)."""
    connect = socket.socket.connect

    def local_only(self, address):
        host = address[0] if isinstance(address, tuple) else address
        if isinstance(host, str) and host not in ("127.0.0.1", "localhost", "::1") and not host.startswith("/"):
            raise OSError(f"the agent's probe has no network (tried {host})")
        return connect(self, address)

    socket.socket.connect = local_only


def _tensors(value) -> list:
    """The tensors in a module's output (a tensor, or a tuple / list / dict of them), in order."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for k in sorted(value) for t in _tensors(value[k])]
    return []


def _redraw(module, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for _, param in sorted(module.named_parameters()):
            std = 1 / math.sqrt(param.shape[-1]) if param.dim() >= 2 else 0.5
            param.copy_(torch.randn(param.shape, generator=gen, dtype=param.dtype) * std)


def _run(module, args, kwargs, weights_seed: int, rng_seed: int | None = None):
    """Outputs, input gradients and parameter gradients (by name) of one forward + backward; `rng_seed` seeds
    torch's global generator first (a module that draws random numbers in training)."""
    import torch

    module.zero_grad(set_to_none=True)
    leaves = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
              for a in args]
    if rng_seed is not None:
        torch.manual_seed(rng_seed)
    outputs = _tensors(module(*leaves, **kwargs))
    gen = torch.Generator().manual_seed(weights_seed)
    loss = sum((out * torch.randn(out.shape, generator=gen, dtype=out.dtype)).sum()
               for out in outputs if out.is_floating_point())
    loss.backward()
    grads = {f"input {i}": leaf.grad for i, leaf in enumerate(leaves)
             if isinstance(leaf, torch.Tensor) and leaf.grad is not None}
    grads.update({name: p.grad for name, p in sorted(module.named_parameters()) if p.grad is not None})
    return [o.detach() for o in outputs], grads


def _error(ours, theirs) -> float:
    if not theirs.is_floating_point():  # indices, masks, counts: the share of entries that differ
        return float((ours != theirs).float().mean()) if theirs.numel() else 0.0
    scale = float(theirs.abs().max()) if theirs.numel() else 0.0
    return float((ours.float() - theirs.float()).abs().max()) / max(scale, 1e-30) if theirs.numel() else 0.0


def _trains_differently(module, args, kwargs, seed: int) -> bool:
    """Whether `module` computes something else in training mode (random routing, dropout, jitter): then the
    candidate is held against it in training mode too, both drawing from one seeded generator."""
    import torch

    with torch.no_grad():
        evaluated = _tensors(module(*args, **kwargs))
        module.train()
        try:
            torch.manual_seed(seed)
            trained = _tensors(module(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args], **kwargs))
        finally:
            module.eval()
    return any(a.shape != b.shape or _error(b, a) > 0 for a, b in zip(evaluated, trained))


_TWINS: dict = {}  # model reference -> its twin, built once per probe process and never changed


def _twin(request: dict):
    from onboard.source import resolve
    from onboard.twin import build_twin

    key = (request["model"], request.get("trust_remote_code", False))
    if key not in _TWINS:
        _TWINS[key] = build_twin(resolve(key[0], trust_remote_code=key[1]))
    return _TWINS[key]


def probe(request: dict) -> dict:
    import torch

    from runtime.generated import load_generated

    torch.set_num_threads(1)
    twin = _twin(request)
    live = twin.model.get_submodule(request["module_path"])
    replacement = load_generated(request["candidate"])
    cases, reference_outputs, problems = [], [], []
    setups = []  # per seed: its inputs to the module and a redrawn copy of the module
    for seed in request.get("seeds", (0, 1, 2)):
        seen = {}
        hook = live.register_forward_pre_hook(
            lambda _, args, kwargs: seen.setdefault("inputs", (args, kwargs)), with_kwargs=True)
        with torch.no_grad():
            twin.model(**{k: v for k, v in twin.example_batch(seed).items() if k != "labels"}, use_cache=False)
        hook.remove()
        if "inputs" not in seen:
            return {"passed": False, "note": f"{request['module_path']} did not run in the twin's forward"}
        module = copy.deepcopy(live)  # redrawn on a copy: the twin, and the next probe's inputs, stay as built
        _redraw(module, seed)
        setups.append((seed, *seen["inputs"], module))
    # a difference in training may show on some inputs only (a random choice that mostly agrees with the best)
    trains = any(_trains_differently(module, args, kwargs, seed) for seed, args, kwargs, module in setups)
    modes = ("eval", "train") if trains else ("eval",)
    for seed, args, kwargs, module in setups:
        candidate = replacement(copy.deepcopy(module))
        for mode, scale in itertools.product(modes, request.get("scales", SCALES)):
            module.train(mode == "train")
            candidate.train(mode == "train")
            rng = seed if mode == "train" else None
            scaled = [a * scale if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
            theirs, their_grads = _run(module, scaled, kwargs, seed, rng)
            ours, our_grads = _run(candidate, scaled, kwargs, seed, rng)
            where = f"seed {seed}" + (" in training mode" if mode == "train" else "")
            if len(ours) != len(theirs) or any(a.shape != b.shape for a, b in zip(ours, theirs)):
                shapes = [tuple(t.shape) for t in ours], [tuple(t.shape) for t in theirs]
                return {"passed": False, "cases": cases,
                        "note": f"{where}: output shapes {shapes[0]} where the module gives {shapes[1]}"}
            if [a.dtype for a in ours] != [b.dtype for b in theirs]:
                return {"passed": False, "cases": cases, "note": f"{where}: output dtypes "
                        f"{[str(a.dtype) for a in ours]} where the module gives {[str(b.dtype) for b in theirs]}"}
            if set(our_grads) != set(their_grads):
                missing = sorted(set(their_grads) ^ set(our_grads))
                return {"passed": False, "cases": cases,
                        "note": f"{where}: gradients differ in what they reach ({', '.join(missing[:4])})"}
            out_err = max((_error(a, b) for a, b in zip(ours, theirs)), default=0.0)
            grad_errs = {name: _error(our_grads[name], g) for name, g in their_grads.items()}
            worst = max(grad_errs, key=grad_errs.get) if grad_errs else ""
            case = {"seed": seed, "scale": scale, "output_error": out_err,
                    "grad_error": grad_errs.get(worst, 0.0), "worst_grad": worst}
            if mode == "train":
                case["mode"] = mode
            cases.append(case)
            if out_err > TOLERANCE or case["grad_error"] > TOLERANCE:
                problems.append(f"{where} x{scale:g}: output error {out_err:.1e}, worst gradient {worst} "
                                f"{case['grad_error']:.1e} (tolerance {TOLERANCE:.0e})")
            if scale == 1.0 and mode == "eval":
                reference_outputs.append(theirs)
        module.eval()
    if len(reference_outputs) > 1 and all(
            _error(a, b) < 1e-3 for a, b in zip(reference_outputs[0], reference_outputs[1])):
        problems.append("the module's outputs do not vary with its inputs: the probe would prove nothing")
    return {"passed": not problems, "cases": cases, "note": "; ".join(problems[:3])}


SAMPLE_SECONDS = 0.05  # each timing sample repeats a call this long: a millisecond call alone is mostly noise


def time_against(module, replacement, args, kwargs, repeats: int) -> dict:
    """Forward + backward times (ms) of `module` and `replacement` on the same inputs and output weights: the
    fastest of `repeats` samples each (on a shared machine interference only ever adds time), a sample being
    as many calls as fill SAMPLE_SECONDS, sampled alternately after two untimed calls each; their ratio (above
    1: the replacement is faster) and the largest error of the outputs relative to each one's largest value."""
    import time

    import torch

    outs = [o for o in _tensors(module(*args, **kwargs)) if o.is_floating_point()]
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]

    def fwd_bwd(mod):
        mod.zero_grad(set_to_none=True)
        leaves = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point()
                  else a for a in args]
        start = time.perf_counter()
        got = [o for o in _tensors(mod(*leaves, **kwargs)) if o.is_floating_point()]
        sum((o * w).sum() for o, w in zip(got, weights)).backward()
        return time.perf_counter() - start, [o.detach() for o in got]

    results: dict = {}
    for _ in range(2):  # untimed: the allocator's first growth falls on neither
        (first, results["hf"]), results["generated"] = fwd_bwd(module), fwd_bwd(replacement)[1]
    calls = max(1, int(SAMPLE_SECONDS / max(first, 1e-5)))
    times: dict = {"hf": [], "generated": []}
    for _ in range(repeats):
        for name, mod in (("hf", module), ("generated", replacement)):
            total = 0.0
            for _ in range(calls):
                seconds, results[name] = fwd_bwd(mod)
                total += seconds
            times[name].append(total / calls)
    hf, ours = (min(times[n]) for n in ("hf", "generated"))
    error = max((_error(a, b) for a, b in zip(results["generated"], results["hf"])), default=0.0)
    return {"hf_ms": hf * 1e3, "generated_ms": ours * 1e3, "ratio": hf / ours, "max_rel_error": error}


def speed(request: dict) -> dict:
    """The candidate against the module at `width` times the twin's width and `tokens` tokens (the module's real
    inputs from one forward of the first layer + 1 layers of that model), `time_against`; plus the input shapes."""
    import torch

    from onboard.source import resolve
    from onboard.train import scaled_config
    from runtime.generated import load_generated

    torch.set_num_threads(request.get("threads", 1))
    source = resolve(request["model"], trust_remote_code=request.get("trust_remote_code", False))
    layer = request["layer"]
    cfg = scaled_config(source, layers=layer + 1, width=request.get("width", 8))
    model = source.build(type(source.config).from_dict(cfg)).eval()
    module = model.get_submodule(f"{request['layers_path']}.{layer}.{request['path']}")
    seen = {}
    hook = module.register_forward_pre_hook(lambda _, a, k: seen.setdefault("in", (a, k)), with_kwargs=True)
    vocab = min(int(cfg.get("vocab_size") or 1000), 1000)
    ids = torch.randint(3, vocab, (1, request.get("tokens", 1024)), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    hook.remove()
    args, kwargs = seen["in"]
    replacement = load_generated(request["candidate"])(copy.deepcopy(module))
    result = time_against(module, replacement, args, kwargs, request.get("repeats", 3))
    result["shapes"] = [list(a.shape) for a in args if isinstance(a, torch.Tensor)]
    return result


def main() -> None:
    """One request per input line, one JSON result line each, until the input ends or a request says "end".
    What candidates print goes to stderr: stdout carries the results alone."""
    _no_network()
    results, sys.stdout = sys.stdout, sys.stderr
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("op") == "end":  # the session's end (onboard.agent.zygote)
            break
        used = resource.getrusage(resource.RUSAGE_SELF)
        budget = int(used.ru_utime + used.ru_stime) + int(request.get("cpu_seconds", 300))
        resource.setrlimit(resource.RLIMIT_CPU, (budget, resource.getrlimit(resource.RLIMIT_CPU)[1]))
        try:
            result = speed(request) if request.get("op") == "speed" else probe(request)
        except Exception as exc:  # the candidate's own failure: reported to the policy as the round's outcome
            result = {"passed": False, "note": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"}
        print(json.dumps(result, sort_keys=True), file=results, flush=True)


if __name__ == "__main__":
    main()
