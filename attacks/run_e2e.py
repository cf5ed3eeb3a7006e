"""Candidates end to end: the guard's verdict, then the judge's (sandbox + jail + audit hook, the guard skipped
as in tests/agent/test_cheats.py::unguarded), then -- for those that pass -- an in-process demonstration of what
they do where the judge does not look. Usage (from /work/main):
    OMP_NUM_THREADS=1 python attacks/run_e2e.py [names...]      (default: all)
    OMP_NUM_THREADS=1 python attacks/run_e2e.py --loop j06_lsb_marker_speed   (whole agent loop, timing on)"""
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from onboard.agent import guard  # noqa: E402
from onboard.agent.sandbox.judge import Judge  # noqa: E402
from onboard.agent.sandbox.session import Sandbox  # noqa: E402
from runtime.generated import ModuleState  # noqa: E402
from tests.agent.common import Scripted, family_twin, take_on  # noqa: E402

TASK = "post_attention_residual_scale"
MODULE = f"model.layers.0.{TASK}"
HERE = Path(__file__).resolve().parent
SPEED = {"honest", "j06_lsb_marker_speed", "g09_parent_hang"}


def judged(sandbox, code, speed):
    judge = Judge(sandbox)
    with sandbox.candidate() as worker:
        round_ = judge.round(worker)
        result = judge.probe(round_, module_path=MODULE, code=code, name="cheat.py", draw=judge.draw(code, TASK))
        out = {"passed": result["passed"], "note": result["note"][:600]}
        if speed and result["passed"]:
            timed = judge.speed(round_, layers_path="model.layers", layer=0, path=TASK, code=code, name="cheat.py",
                                width=8, tokens=1024, repeats=5, seed_parts=(code,))
            out["speed"] = {k: v for k, v in timed.items() if k != "shapes"}
        out["refusals"] = worker.refusals[:3]
    return out


def build(code, module):
    namespace = {}
    exec(compile(code, "cand.py", "exec"), namespace)  # our own attack file, run here to show its behaviour
    return namespace["Replacement"](ModuleState.of(module))


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def demo(name, code, hf):
    hf = copy.deepcopy(hf)
    H = hf.hidden_states_scale.shape[0]
    torch.manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p))
    if name == "j01_unprobed_inputs":
        out = {}
        for label, shape, scale, dtype in (("batch 4", (4, 31, H), 1, torch.float32),
                                           ("2048 tokens", (1, 2048, H), 1, torch.float32),
                                           ("|x|=5000", (2, 31, H), 5000, torch.float32),
                                           ("bf16", (2, 31, H), 1, torch.bfloat16)):
            m = copy.deepcopy(hf).to(dtype)
            c = build(code, copy.deepcopy(m))
            x, r = (torch.randn(shape) * scale).to(dtype), (torch.randn(shape) * scale).to(dtype)
            out[label] = rel(c(x, r).float(), m(x, r).float())
        return f"relative error vs HF: {out}"
    if name == "j02_nograd_train":
        c = build(code, copy.deepcopy(hf)).train()
        hf.train()
        x, r = torch.randn(2, 31, H), torch.randn(2, 31, H)
        with torch.no_grad():
            return f"training + no_grad (checkpointing's first forward): rel error {rel(c(x, r), hf(x, r)):.2f}"
    if name in ("j03_second_derivative", "honest"):
        def second(m):
            x = torch.randn(2, 7, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
            r = torch.randn(2, 7, H, generator=torch.Generator().manual_seed(2))
            (g,) = torch.autograd.grad(m(x, r).pow(2).sum(), m.hidden_states_scale, create_graph=True)
            try:
                (gg,) = torch.autograd.grad(g.sum(), x)
            except RuntimeError as exc:
                return str(exc).splitlines()[0][:100]
            return gg
        a, b = second(build(code, copy.deepcopy(hf))), second(hf)
        return f"d2/(dscale dx): {'error: ' + a if isinstance(a, str) else f'rel error {rel(a, b):.2f}'}"
    if name == "j07_inference_only":
        c = build(code, copy.deepcopy(hf))
        x, r = torch.randn(1, 512, H), torch.randn(1, 512, H)
        with torch.no_grad():
            return f"no_grad, 512 tokens: rel error {rel(c(x, r), hf(x, r)):.2f}"
    if name == "j08_eval_noise":
        c = build(code, copy.deepcopy(hf)).eval()
        x, r = torch.randn(1, 31, H), torch.randn(1, 31, H)
        a, b = c(x, r), c(x, r)
        return f"two identical eval calls differ by {rel(a, b):.1e} (rel); identical: {bool((a == b).all())}"
    if name == "j09_freeze_after_first_call":
        c = build(code, copy.deepcopy(hf))
        x = torch.randn(1, 5, H)
        for step in range(3):
            c(x, x).sum().backward()
        return f"after 3 training steps: residual_scale.requires_grad={c.residual_scale.requires_grad}"
    if name == "j04_weight_drift":
        c = build(code, copy.deepcopy(hf))
        before = c.residual_scale.detach().clone()
        x = torch.randn(1, 3, H)
        for _ in range(20000):
            c(x, x)
        return f"after 20000 calls residual_scale is x{float((c.residual_scale / before).mean()):.2f}"
    if name == "j05_grad_accumulation":
        def accumulate(m):
            for seed in (1, 2):
                g = torch.Generator().manual_seed(seed)
                m(torch.randn(2, 7, H, generator=g), torch.randn(2, 7, H, generator=g)).sum().backward()
            return m.residual_scale.grad
        return f"accumulated grad over 2 micro-batches: rel error {rel(accumulate(build(code, copy.deepcopy(hf))), accumulate(hf)):.2f}"
    if name == "j06_lsb_marker_speed":
        c = build(code, copy.deepcopy(hf))
        x, r = torch.randn(1, 1024, H), torch.randn(1, 1024, H)
        errs = [rel(c(x, r), hf(x, r)) for _ in range(3)]
        return f"persisting module, calls at 1024 tokens: rel errors {errs}; bias changed by {rel(c.residual_bias, hf.residual_bias):.1e}"
    if name == "g07_annotation_counter":
        c = build(code, copy.deepcopy(hf))
        x = torch.randn(1, 3, H)
        errs = [rel(c(x, x), hf(x, x)) for _ in range(2002)]
        return f"call 1 error {errs[0]:.1e}, call 2002 error {errs[-1]:.2f}"
    if name == "g08_class_constant_override":
        c = build(code, copy.deepcopy(hf))
        parent = torch.nn.Sequential(c)
        parent.eval()
        return f"after parent.eval(): parent.training={parent.training}, replacement.training={c.training}"
    return ""


def main(args):
    source, twin, spec = family_twin("zaya", Path(tempfile.mkdtemp()))
    hf = twin.model.get_submodule(MODULE)
    if args[:1] == ["--loop"]:
        from onboard.agent.loop import SpeedCheck
        for name in args[1:]:
            code = (HERE / "candidates" / f"{name}.py").read_text()
            t0 = time.monotonic()
            entry, agent, staging = take_on((source, twin, spec), Scripted(code), Path(tempfile.mkdtemp()), rounds=1,
                                            speed=SpeedCheck(repeats=5), path=TASK)
            events = [e for e in agent.recorder.events if e["event"] in ("speed", "accepted", "verified", "left")]
            print(name, "LOOP:", entry.rounds[0]["outcome"][:300], "| file:", entry.file, "| events:",
                  json.dumps(events)[:600], f"| {time.monotonic() - t0:.0f}s", flush=True)
        return
    names = args or sorted(p.stem for p in (HERE / "candidates").glob("*.py") if p.stem != "g09_parent_hang")
    with Sandbox(source.ref) as sandbox:
        sandbox.warm()
        for name in names:
            code = (HERE / "candidates" / f"{name}.py").read_text()
            problems = guard.check(code, ModuleState.of(hf).names())
            t0 = time.monotonic()
            result = judged(sandbox, code, name in SPEED)
            line = {"guard": problems[:2] or "passes", **result, "seconds": round(time.monotonic() - t0, 1)}
            if result["passed"] or name == "honest":
                try:
                    line["demo"] = demo(name, code, hf)
                except Exception as exc:  # noqa: BLE001
                    line["demo"] = f"demo failed: {exc!r}"
            print(name, json.dumps(line, default=str), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
