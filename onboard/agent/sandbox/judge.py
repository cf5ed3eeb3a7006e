"""The judge: the only place a candidate's verdict is made, in the `onboard` process, which never imports
candidate code. It draws the inputs, asks the reference's process for HuggingFace's answers and the
candidate's process for the candidate's, compares the tensors it is sent, and decides.

    judge = Judge(sandbox)
    round_ = judge.round(worker)                # one candidate's process and its wall-clock budget
    result = judge.probe(round_, module_path=..., code=..., name=..., draw=judge.draw(sha, task, round))
    timed = judge.speed(round_, ...)            # judged like the rest, then timed from outside

What a candidate cannot predict (`draw`): the cases are drawn from an HMAC of the candidate's own code, task
and round under a key kept outside the bundle and out of every sandboxed process (`judge_key`), so nothing a
candidate can see tells it its inputs, and a replay on the same installation draws the same ones (the record
stays byte for byte). Each probe holds the candidate against the module on seven cases, each with the module's
parameters redrawn: lengths from 1 token to 4096 (primes, which are a multiple of no chunk size; even lengths
and powers of two; past the timing run's 1024 and the twin's TWIN_SEQ), batches of 1 to 8, inputs rescaled from
|x| <= 1e-4 to 1e4, negated, sparsified, with outliers among ordinary values and as exact bf16 values, in fp32,
fp64 and bf16, and with a bf16 first input beside fp32 under bf16 autocast, as the runtime trains in bf16 (each
against the module in the same dtypes, outside fp32 within the tolerance the module's own error against fp64
gives), and with the parameters frozen as a LoRA fine-tune leaves them (the bf16 case's training calls, the
autocast case's evaluation calls). Every case runs in evaluation and in training
mode (torch's generator seeded alike on both sides, and left where the module leaves it), each with gradients and
again without (no_grad in training, inference_mode in evaluation); one case compares second derivatives in both
modes, and one module object is called 20 times (`calls.sequence`). Every output, input gradient, parameter
gradient, and the parameters, buffers and inputs after the call (a change in place is a change to the caller's
tensors) must be within TOLERANCE of the module's, relative to each tensor's largest value (integer outputs
exactly); the parameters, buffers and inputs a call changes in place must be those the module changes (torch's
version counters: exact, however small the change); and a call in evaluation mode may draw from torch's
generator only where the module does. The timing run's outputs and gradients are judged the same way before its time counts.

The candidate fails on the first thing that is wrong, and the note says what, naming the class of failure:
"wrong" (it computes something else), "refused by the sandbox" (what the audit hook stopped), "ran past"
(its wall-clock budget), or "its process" (it died, or answered with something that is not a reply).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import random
import time

import torch

from onboard.agent.sandbox import wire
from onboard.agent.sandbox.calls import SEQUENCE_CALLS, conditions
from onboard.agent.sandbox.process import Stopped, Worker
from onboard.user_key import user_key

TOLERANCE = 1e-4  # fp32, relative to the tensor's largest value: a reading of the wrong thing is off by O(1)
TWIN_SEQ = 160  # the longest sequence the twin is verified at (onboard.adapt.verify.WIDE_SEQ)
KEY_ENV = "ONBOARD_JUDGE_KEY"  # a file holding the judge's key (default: ~/.cache/onboard/judge.key)
MODES = ("eval", "train")
SAMPLE_SECONDS = 0.05  # CPU time per timing sample (the kernel counts it in nanoseconds)


SEQUENCE_STEPS = {1: "the first micro-batch, training", 2: "the second micro-batch, gradients accumulated",
                  3: "an evaluation call after an optimizer step"}


def _primes(low: int, high: int) -> list[int]:
    return [n for n in range(max(low, 2), high + 1) if all(n % d for d in range(2, int(n ** 0.5) + 1))]


SHORT = _primes(17, 61)
MEDIUM = list(range(96, 257, 2))  # even, 128 and 256 among them
LONG = (2048, 4096)  # with any length from 1537 (past every length judged before this draw) to 4096
TINY = range(1, 17)
PRECISE, COARSE = (1e-4, 1e-3, 1e-2), (1e3, 1e4)  # magnitudes far from the model's own


def judge_key() -> bytes:
    """The installation's judge key (`onboard.user_key`: made on first use, readable by the user alone); a key for
    this process only where no file can be kept."""
    return user_key("judge.key", KEY_ENV)


def draw(key: bytes, *parts: str) -> list[dict]:
    """The cases for one probe, drawn from HMAC(key, parts) (the module docstring says what they span)."""
    digest = hmac.new(key, "\0".join(parts).encode(), hashlib.sha256).digest()
    rng = random.Random(int.from_bytes(digest, "little"))

    def seeds() -> dict:
        return {"ids_seed": rng.getrandbits(31), "weights_seed": rng.getrandbits(31),
                "cotangent_seed": rng.getrandbits(31), "rng": rng.getrandbits(31)}

    short, first = rng.choice(SHORT), seeds()
    # the second case is the first's inputs and weights negated and rescaled: whatever a candidate reads the sign of
    # (a sum, a mean, one entry), one of the two has it the other way. Drawn apart, both could land on one sign
    # (one key in about sixteen did, and "right only for positive sums" passed)
    mirrored = {**seeds(), "ids_seed": first["ids_seed"], "weights_seed": first["weights_seed"]}
    plain = {"magnitude": 0.0, "negate": False, "sparsity": 0.0, "outliers": False, "bf16_values": False,
             "dtype": "float32"}
    return [  # magnitude: each floating positional input rescaled to this largest |value| (0: as the model gave it)
        {**plain, "batch": 2, "tokens": short, **first, "second": rng.getrandbits(31)},
        {**plain, "batch": 2, "tokens": short, "magnitude": 64.0, "negate": True, "bf16_values": True, **mirrored},
        {**plain, "batch": rng.randint(4, 8), "tokens": rng.choice(MEDIUM), "magnitude": rng.choice(PRECISE),
         "negate": rng.random() < 0.5, "sparsity": 0.5, "outliers": True, **seeds()},
        {**plain, "batch": 1, "tokens": rng.choice((*LONG, rng.randint(1537, 4096))),
         "magnitude": round(rng.uniform(1.0, 16.0), 3), "negate": rng.random() < 0.5, **seeds()},
        {**plain, "batch": rng.randint(1, 8), "tokens": rng.choice(TINY), "magnitude": rng.choice(COARSE),
         "dtype": "float64", **seeds()},
        # a LoRA fine-tune freezes the module's own weights: training calls of a bf16 case, then evaluation calls
        # of the mixed one, which also runs under autocast, as the runtime trains in bf16
        {**plain, "batch": rng.randint(1, 8), "tokens": rng.choice(SHORT), "dtype": "bfloat16", "frozen": ["train"],
         **seeds()},
        {**plain, "batch": rng.randint(1, 8), "tokens": rng.choice(TINY), "dtype": "mixed", "frozen": ["eval"],
         "autocast": True, **seeds()},
    ]


def once_differentiable(code: str) -> list[str]:
    """The runtime ops differentiable once (`capabilities.ONCE_DIFFERENTIABLE`) that `code` names: with one named
    and one really run in the call (the candidate's process counts their calls), its second derivatives are not
    compared (a name that is not code refuses the candidate elsewhere: the guard)."""
    import ast

    from onboard.agent.capabilities import ONCE_DIFFERENTIABLE

    short = {name.rpartition(".")[2] for name in ONCE_DIFFERENTIABLE}
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return []
    named = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    named |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    named |= {a.name.rpartition(".")[2] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    return sorted(short & named)


def describe(case: dict) -> str:
    """A case in words: "batch 1, 1109 tokens, inputs rescaled to |x| <= 8.2, negated, bfloat16"."""
    words = [f"batch {case.get('batch', 1)}, {case['tokens']} tokens"]
    if case.get("magnitude"):
        words.append(f"inputs rescaled to |x| <= {case['magnitude']:g}")
    words += [w for w, on in (("negated", case.get("negate")), ("half zeros", case.get("sparsity")),
                              ("with outliers", case.get("outliers")), ("bf16 values", case.get("bf16_values")))
              if on]
    if case.get("dtype") == "mixed":
        words.append("the first input in bfloat16, the rest in float32")
    elif case.get("dtype", "float32") != "float32":
        words.append(case["dtype"])
    if case.get("autocast"):
        words.append("under bf16 autocast")
    if case.get("frozen"):
        words.append(f"parameters frozen in {' and '.join(case['frozen'])} mode")
    return ", ".join(words)


def error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Largest difference relative to `theirs`' largest value (floating); the share of entries that differ."""
    if not theirs.numel():
        return 0.0
    if not theirs.is_floating_point():
        return float((ours != theirs).float().mean())
    a, b = ours.double(), theirs.double()
    same = (a == b) | (a.isnan() & b.isnan())  # equal infinities, and NaN where the module gives NaN, agree
    if not bool((~same & ~b.isfinite()).any()) and bool(same.all()):
        return 0.0
    finite = b[b.isfinite()]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    diff = (a - b).abs().masked_fill(same, 0).max()
    return float(diff) / max(scale, 1e-30) if torch.isfinite(diff) else float("inf")


def _structure(ours, theirs, path: str = "output") -> str:
    """Why two unpacked values differ in structure, shape or dtype ("" when they do not)."""
    if isinstance(theirs, torch.Tensor):
        if not isinstance(ours, torch.Tensor):
            return f"{path} is a {type(ours).__name__} where the module gives a tensor"
        if ours.shape != theirs.shape or ours.dtype != theirs.dtype:
            return (f"{path} of shape {tuple(ours.shape)} and {ours.dtype} where the module gives "
                    f"{tuple(theirs.shape)} and {theirs.dtype}")
        return ""
    if isinstance(theirs, tuple | list):
        if not isinstance(ours, tuple | list) or len(ours) != len(theirs):
            return f"{path} holds {_describe(ours)} where the module gives {_describe(theirs)}"
        return next((why for i, (a, b) in enumerate(zip(ours, theirs)) if (why := _structure(a, b, f"{path}[{i}]"))),
                    "")
    if isinstance(theirs, dict):
        if not isinstance(ours, dict) or set(ours) != set(theirs):
            return f"{path} holds {_describe(ours)} where the module gives {_describe(theirs)}"
        return next((why for k in theirs if (why := _structure(ours[k], theirs[k], f"{path}[{k!r}]"))), "")
    return "" if ours == theirs or (ours is None and theirs is None) else f"{path} is {ours!r} where the module gives {theirs!r}"


def _describe(value) -> str:
    if isinstance(value, tuple | list):
        return f"{len(value)} items"
    if isinstance(value, dict):
        return f"keys {sorted(value)[:6]}"
    return type(value).__name__


def _failed(round_, header: dict, where: str = "") -> None:
    """Refused where the audit hook refused something (its words, from the reply or from stderr); Wrong where
    the candidate's process answered with an error; nothing where it answered."""
    if header.get("refused") or round_.refused():
        raise Refused(header.get("error", "").partition("the sandbox refused ")[2] or round_.refused())
    if "error" in header:
        raise Wrong(f"{where}: {header['error']}" if where else header["error"])


def _errors(where: str, label: str, mine: dict, expected: dict, measured: dict | None = None,
            order=None) -> dict[str, float]:
    """Per name (sorted, or by `order`), the error of the candidate's tensor against the module's; Wrong where the
    two reach different names or a tensor's shape differs."""
    if set(mine) != set(expected):
        missing = sorted(set(mine) ^ set(expected), key=order)
        raise Wrong(f"{where}: {label}s differ in what they reach ({', '.join(missing[:4])})", measured)
    names = sorted(expected, key=order)
    for name in names:
        if mine[name].shape != expected[name].shape:
            raise Wrong(f"{where}: {label} of {name} has shape {tuple(mine[name].shape)}, the module's "
                        f"{tuple(expected[name].shape)}", measured)
    return {name: error(mine[name], expected[name]) for name in names}


def _prefixed(tensors: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


class Round:
    """One candidate's round: its process, the wall clock left to the round, and what one call may take."""

    def __init__(self, worker: Worker, seconds: float, cpu_seconds: float, call_seconds: float):
        self.worker, self.cpu_seconds, self.call_seconds = worker, cpu_seconds, call_seconds
        self.deadline = time.monotonic() + seconds
        self.seconds = seconds
        self.calls = 0

    def request(self, header: dict, tensors: dict | None = None, *, seconds: float | None = None
                ) -> tuple[dict, dict]:
        """One request, stopped past `seconds` (default: the limit of one call) or past the round's end."""
        left = self.deadline - time.monotonic()
        limit = min(left, seconds if seconds is not None else self.call_seconds)
        why = (f"ran past its round's {self.seconds:.0f} s and was stopped" if limit == left
               else f"ran past {limit:.0f} s in one call and was stopped")
        if limit <= 0:
            self.worker.kill()
            raise Stopped(why)
        try:
            return self.worker.request(header, tensors, seconds=limit, cpu_seconds=self.cpu_seconds)
        except Stopped as exc:
            if "ran past" in str(exc):
                raise Stopped(why) from None
            raise

    def refused(self) -> str:
        return "; ".join(self.worker.refusals[:3])


class Judge:
    def __init__(self, sandbox, key: bytes | None = None):
        self.sandbox = sandbox
        self.key = key if key is not None else judge_key()

    def draw(self, *parts: str) -> list[dict]:
        return draw(self.key, *parts)

    def _reference(self, request: dict) -> tuple[dict, dict]:
        header, tensors = self.sandbox.reference().request(
            {"model": self.sandbox.model_ref, "trust_remote_code": self.sandbox.trust_remote_code, **request},
            seconds=self.sandbox.limits.reference_seconds)
        if "error" in header:
            raise ReferenceFailed(header["error"])
        return header, tensors

    def _load(self, round_: Round, code: str, name: str) -> None:
        header, _ = round_.request({"op": "load", "key": "candidate", "name": name, "code": code})
        if "error" in header:
            raise Wrong(f"it does not load: {header['error']}")

    def _call(self, round_: Round, state: dict, state_tensors: dict, args, kwargs, *, training: bool,
              grad: bool, rng, cotangents, second: int | None = None, inference: bool = False,
              frozen: bool = False, autocast: bool = False) -> tuple[object, dict]:
        """The candidate's outputs, and what came with them by name (g:, h:, s:, and "drew")."""
        tensors = {f"p:{n}": state_tensors[f"p:{n}"] for n in state["parameters"]}
        tensors.update({f"b:{n}": state_tensors[f"b:{n}"] for n in state["buffers"]})
        a, _ = wire.pack(args, tensors, prefix="a")
        k, _ = wire.pack(kwargs, tensors, prefix="k")
        c = None if cotangents is None else wire.pack(cotangents, tensors, prefix="c")[0]
        round_.calls += 1
        header, got = round_.request({"op": "call", "id": round_.calls, "key": "candidate", "state": state,
                                      "args": a, "kwargs": k, "training": training, "grad": grad, "rng": rng,
                                      "cotangents": c, "second": second, "inference": inference,
                                      "frozen": frozen, "autocast": autocast}, tensors)
        _failed(round_, header)
        try:
            written = header.get("written", [])
            if not (isinstance(written, list) and all(isinstance(w, str) for w in written)):
                raise wire.WireError("'written' is not a list of names")
            return wire.unpack(header["outputs"], got), {**got, "drew": header.get("drew") is True,
                                                         "stream": str(header.get("stream", "")),
                                                         "once": header.get("once") is True, "written": written}
        except (wire.WireError, KeyError) as exc:
            raise Broken(f"an answer that is not one ({exc})") from None

    @staticmethod
    def _writes(where: str, got: dict, expected: list) -> None:
        """Wrong where the candidate changed in place other parameters, buffers or inputs than the module did (by
        torch's version counters: exact, however small the change)."""
        mine, theirs = set(got.get("written", ())), set(expected or ())
        if mine - theirs:
            raise Wrong(f"{where}: it changes {', '.join(sorted(mine - theirs)[:4])} in place, where the module "
                        f"changes {', '.join(sorted(theirs)) or 'nothing'}")
        if theirs - mine:
            raise Wrong(f"{where}: it does not change {', '.join(sorted(theirs - mine)[:4])} in place as the module "
                        f"does")

    def _compare(self, where: str, ours, got: dict, theirs, theirs_tensors: dict, *, gradients: bool,
                 tolerance: dict | None = None, second: bool = False) -> dict:
        """`tolerance`: {"output": ..., "gradient": ...} outside fp32 (TOLERANCE for the state after, whatever the
        dtype: an unchanged tensor is unchanged exactly); `second`: second derivatives (h:) are compared too."""
        why = _structure(ours, theirs)
        if why:
            raise Wrong(f"{where}: {why}")
        tolerance = tolerance or {}
        out_err = max((error(a, b) for a, b in zip(wire.leaves(ours), wire.leaves(theirs))), default=0.0)
        measured = {"output_error": out_err}
        limit = max(TOLERANCE, float(tolerance.get("output", TOLERANCE)))
        if out_err > limit:
            raise Wrong(f"{where}: output error {out_err:.1e} (tolerance {limit:.0e})", measured)
        for kind, label in (("g:", "gradient"), ("h:", "second derivative"), ("s:", "state after the call")):
            if (kind == "g:" and not gradients) or (kind == "h:" and not second):
                continue
            limit = max(TOLERANCE, float(tolerance.get("gradient", TOLERANCE))) if kind != "s:" else TOLERANCE
            errs = _errors(where, label, _prefixed(got, kind), _prefixed(theirs_tensors, kind), measured)
            worst = max(errs, key=errs.get) if errs else ""  # ties: the first name (safetensors' order is not fixed)
            if kind == "g:":
                measured.update(grad_error=errs.get(worst, 0.0), worst_grad=worst)
            if errs.get(worst, 0.0) > limit:
                raise Wrong(f"{where}: {label} of {worst} off by {errs[worst]:.1e} (tolerance {limit:.0e})",
                            measured)
        return measured

    def _sequence(self, round_: Round, entries: list[dict], tensors: dict, asked: dict) -> dict:
        """The candidate called again and again on one object (`calls.sequence`): two micro-batches accumulated,
        an optimizer step, then calls in both modes; everything after every call against the module's."""
        sent = {f"p:{n}": tensors[f"c0.p:{n}"] for n in entries[0]["state"]["parameters"]}
        sent.update({f"b:{n}": tensors[f"c0.b:{n}"] for n in entries[0]["state"]["buffers"]})
        batches = []
        for i, entry in enumerate(entries):
            args, kwargs = wire.unpack(entry["args"], tensors), wire.unpack(entry["kwargs"], tensors)
            batches.append({"args": wire.pack(args, sent, prefix=f"q{i}a")[0],
                            "kwargs": wire.pack(kwargs, sent, prefix=f"q{i}k")[0]})
        header, got = round_.request({"op": "sequence", "key": "candidate", "state": entries[0]["state"],
                                      "batches": batches, **asked}, sent)
        where = "a sequence of calls on one module"
        _failed(round_, header, where)
        errs = _errors(where, "tensor after a call", got, _prefixed(tensors, "q."),
                       order=lambda k: (int(k.partition(".")[0]), k))  # in the order of the calls
        for name, err in errs.items():
            if err > TOLERANCE:
                step, _, what = name.partition(".")
                raise Wrong(f"{where}: after call {step} of {SEQUENCE_CALLS} "
                            f"({SEQUENCE_STEPS.get(int(step), 'the first batch again')}), {what} off by {err:.1e} "
                            f"(tolerance {TOLERANCE:.0e})")
        worst = max(errs, key=errs.get, default="")
        return {"sequence_error": errs.get(worst, 0.0), "worst": worst}

    def round(self, worker: Worker) -> Round:
        limits = self.sandbox.limits
        return Round(worker, limits.wall_seconds, limits.cpu_seconds, limits.call_seconds)

    def probe(self, round_: Round, *, module_path: str, code: str, name: str, draw: list[dict]) -> dict:
        """Hold the candidate against the module on the drawn cases (module docstring); the result the record
        keeps: passed, a note naming what failed, and per case what was drawn and measured."""
        measured: list[dict] = []
        extra: dict = {}  # what is not a case: dtypes skipped, the sequence of calls

        def result(passed: bool, note: str) -> dict:
            return {"passed": passed, "cases": measured, "note": note, **extra}

        try:
            asked = {"seed": draw[0]["cotangent_seed"] ^ 0x5EC, "rng": draw[0]["rng"]}
            reference, tensors = self._reference({"op": "cases", "module_path": module_path, "cases": draw,
                                                  "modes": list(MODES), "sequence": asked})
            self._load(round_, code, name)
            firsts = []
            once = once_differentiable(code)
            for i, (case, entry) in enumerate(zip(draw, reference["cases"])):
                record = {k: case[k] for k in ("tokens", "batch", "magnitude", "negate", "sparsity", "outliers",
                                               "bf16_values", "dtype") if k in case}
                record.update({k: case[k] for k in ("frozen", "autocast") if case.get(k)})
                if "skipped" in entry:  # a dtype the module itself does not run in here
                    extra.setdefault("skipped", []).append(record | {"why": entry["skipped"]})
                    continue
                state = entry["state"]
                mine = _prefixed(tensors, f"c{i}.")  # its state, as p:/b: keys
                args, kwargs = wire.unpack(entry["args"], tensors), wire.unpack(entry["kwargs"], tensors)
                tolerance = entry.get("tolerance")
                for mode in MODES:
                    theirs = wire.unpack(entry["modes"][mode]["outputs"], tensors)
                    theirs_tensors = _prefixed(tensors, f"c{i}.{mode}.")  # its gradients and state after, g:/s:
                    cotangents = wire.unpack(entry["modes"][mode]["cotangents"], tensors)
                    where = f"{describe(case)}, {mode} mode"
                    measured.append(record | {"mode": mode})
                    rng = case["rng"] if mode == "train" else None
                    how = conditions(case, mode)
                    ours, got = self._call(round_, state, mine, args, kwargs, training=mode == "train", grad=True,
                                           rng=rng, cotangents=cotangents, **how)
                    try:
                        measured[-1].update(self._compare(where, ours, got, theirs, theirs_tensors, gradients=True,
                                                          tolerance=tolerance))
                    except Wrong as exc:
                        measured[-1].update(exc.measured)
                        raise
                    written = entry["modes"][mode].get("written") or {}
                    self._writes(where, got, written.get("grad"))
                    if mode == "eval":
                        firsts.append(wire.leaves(theirs)[:1])
                    if got.get("drew") and not entry["modes"][mode].get("drew"):
                        raise Wrong(f"{where}: it draws from torch's random generator where the module draws "
                                    f"nothing (its outputs are noise no test can pin down)")
                    if rng is not None and got.get("stream") != entry["modes"][mode].get("stream"):
                        raise Wrong(f"{where}: it draws from torch's random generator other than the module does "
                                    f"(the generator ends elsewhere: every later draw in training moves)")
                    # the same call without gradients (activation checkpointing's first forward under no_grad in
                    # training, generation under inference_mode): a candidate must not depend on them being on
                    ours, got = self._call(round_, state, mine, args, kwargs, training=mode == "train", grad=False,
                                           rng=rng, cotangents=None, inference=mode == "eval", **how)
                    self._compare(f"{where}, without gradients", ours, got, theirs, theirs_tensors,
                                  gradients=False, tolerance=tolerance)
                    self._writes(f"{where}, without gradients", got, written.get("no_grad"))
                    if entry["modes"][mode].get("second"):
                        ours, got = self._call(round_, state, mine, args, kwargs, training=mode == "train",
                                               grad=True, rng=rng, cotangents=cotangents, second=case["second"],
                                               **how)
                        if once and got.get("once"):  # it named one, and one ran in this very call
                            extra["second"] = f"not compared: it calls {', '.join(once)}, differentiable once"
                        else:
                            self._compare(f"{where}, second derivatives", ours, got, theirs, theirs_tensors,
                                          gradients=False, tolerance=tolerance, second=True)
                        self._writes(f"{where}, second derivatives", got, written.get("grad"))
            if reference.get("sequence"):
                extra["sequence"] = {"calls": SEQUENCE_CALLS,
                                     **self._sequence(round_, reference["cases"][:2], tensors, asked)}
            if not _varies(firsts):
                return result(False, "the module's outputs do not vary with its inputs: the probe would prove nothing")
        except ReferenceFailed as exc:
            return result(False, f"the module itself failed on the drawn inputs: {exc}")
        except Refused as exc:
            return result(False, f"refused by the sandbox: {exc}")
        except Wrong as exc:
            refused = round_.refused()
            note = f"refused by the sandbox: {refused}" if refused else f"wrong: {exc}"
            return result(False, note)
        except (Stopped, Broken) as exc:
            return result(False, f"its process {exc}")
        return result(True, "")

    def speed(self, round_: Round, *, layers_path: str, layer: int, path: str, code: str, name: str,
              width: int, tokens: int, repeats: int, seed_parts: tuple[str, ...]) -> dict:
        """The candidate against the module at `width` times the twin's width and `tokens` tokens: judged like a
        probe case, then forward + backward timed by the kernel's count of each process's CPU time (neither
        can lie about it), `repeats` samples each, alternately; the ratio (above 1: the candidate is faster) is
        the median of the pairs' ratios, `upper` their upper quartile, the times reported the fastest of each."""
        worker = round_.worker
        rng = random.Random(int.from_bytes(hmac.new(self.key, "\0".join(("speed", *seed_parts)).encode(),
                                                    hashlib.sha256).digest(), "little"))
        try:
            entry, tensors = self._reference({"op": "speed", "layers_path": layers_path, "layer": layer,
                                              "path": path, "width": width, "tokens": tokens,
                                              "ids_seed": rng.getrandbits(31), "weights_seed": rng.getrandbits(31),
                                              "cotangent_seed": rng.getrandbits(31)})
            self._load(round_, code, name)
            args, kwargs = wire.unpack(entry["args"], tensors), wire.unpack(entry["kwargs"], tensors)
            theirs = wire.unpack(entry["outputs"], tensors)
            ours, got = self._call(round_, entry["state"], tensors, args, kwargs, training=False, grad=True, rng=None,
                                   cotangents=wire.unpack(entry["cotangents"], tensors))
            measured = self._compare(f"{tokens} tokens at {width}x the twin's width", ours, got, theirs, tensors,
                                     gradients=True)
            self._writes(f"{tokens} tokens at {width}x the twin's width", got, entry.get("written"))
            reference = self.sandbox.reference()
            once = _cpu(reference, lambda: self._reference({"op": "repeat", "times": 1}))
            calls = max(1, int(SAMPLE_SECONDS / max(once, 1e-4)))
            times: dict = {"hf": [], "generated": []}
            with _same_core(reference, worker):
                for _ in range(repeats):
                    times["hf"].append(_cpu(reference, lambda: self._reference({"op": "repeat", "times": calls}))
                                       / calls)
                    times["generated"].append(_cpu(worker, lambda: round_.request(
                        {"op": "repeat", "id": round_.calls, "times": calls},
                        seconds=max(round_.call_seconds, 20 * calls * times["hf"][-1]))) / calls)
            if round_.refused():
                raise Refused(round_.refused())
        except ReferenceFailed as exc:
            return {"note": f"the module itself failed at {width}x the twin's width: {exc}"}
        except Refused as exc:
            return {"note": f"refused by the sandbox: {exc}"}
        except Wrong as exc:
            return {"note": f"wrong: {exc}"}
        except (Stopped, Broken) as exc:
            return {"note": f"its process {exc}"}
        # the median of adjacent pairs' ratios: the machine's own drift (a neighbour's load, the clock) moves both
        # of a pair alike, and a sample disturbed on one side moves the median little
        ratios = sorted(h / max(g, 1e-12) for h, g in zip(times["hf"], times["generated"]))
        ratio, upper = ratios[len(ratios) // 2], ratios[(3 * len(ratios)) // 4]
        hf, ours_ms = min(times["hf"]), min(times["generated"])
        return {"hf_ms": hf * 1e3, "generated_ms": ours_ms * 1e3, "ratio": ratio, "upper": upper,
                "max_rel_error": measured["output_error"], "shapes": [list(a.shape) for a in wire.leaves(args)]}


@contextlib.contextmanager
def _same_core(*workers: Worker):
    """Both processes on one core while they are timed: cores of a shared machine run at different speeds (a
    neighbour on the other hyperthread), and that would be measured as the candidate's."""
    cores = sorted(os.sched_getaffinity(0))
    before = {}
    try:
        for w in workers:
            before[w.pid] = os.sched_getaffinity(w.pid)
            os.sched_setaffinity(w.pid, {cores[-1]})
    except OSError:
        pass
    try:
        yield
    finally:
        for pid, cpus in before.items():
            try:
                os.sched_setaffinity(pid, cpus)
            except OSError:
                pass


def _cpu(worker: Worker, run) -> float:
    before = worker.cpu_seconds()
    run()
    return worker.cpu_seconds() - before


def _varies(firsts: list[list[torch.Tensor]]) -> bool:
    """Whether the module's first outputs differ between two cases of the same shape (else any two shapes)."""
    outs = [f[0] for f in firsts if f]
    same = [(a, b) for i, a in enumerate(outs) for b in outs[i + 1:] if a.shape == b.shape]
    if not same:
        return len({tuple(o.shape) for o in outs}) > 1
    return any(error(a, b) >= 1e-3 for a, b in same)


class Wrong(Exception):
    def __init__(self, what: str, measured: dict | None = None):
        super().__init__(what)
        self.measured = measured or {}


class Refused(Exception):
    """What the candidate's process's audit hook refused."""


class Broken(Exception):
    """A reply that is not one."""


class ReferenceFailed(Exception):
    """The module itself failed on the drawn inputs (its own code, not the candidate's)."""
