"""Parallel layout: FSDP2, expert parallelism and LoRA across real gloo processes match one process.

Each case pickles an adapted tiny twin (runtime MoE blocks around HuggingFace's own parameters), starts
`world` processes of tests/parallel/worker.py on gloo, trains two SGD steps with one sequence per rank,
and compares losses and every gradient (gathered to full tensors) with the same model trained in this
process on all ranks' sequences at once.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.lora import apply_lora
from runtime.plan import LoRA, Plan

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "parallel" / "worker.py"
SEQ = 12
LR = 0.5
STEPS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, job: dict, tmp_path: Path, script: Path = WORKER, timeout: int = 120) -> None:
    """Start `world` ranks of `script` with env rendezvous; fail with their output if any rank fails."""
    (tmp_path / "job.json").write_text(json.dumps(job))
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(ROOT)}
        procs.append(subprocess.Popen([sys.executable, str(script), str(tmp_path / "job.json")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    failed = [(rank, p.returncode, out[-3000:]) for rank, (p, out) in enumerate(zip(procs, outputs))
              if p.returncode]
    assert not failed, failed


def adapted_twin(name: str):
    """A catalogue model's tiny twin with its MoE blocks swapped for runtime.moe.MoEBlock."""
    import tempfile

    from onboard.bundle import load_adapter
    from onboard.capture import capture
    from onboard.codegen import render_adapter
    from onboard.inspection import build_spec
    from onboard.source import resolve
    from onboard.twin import build_twin

    source = resolve(name)
    twin = build_twin(source)
    spec = build_spec(source, twin, capture(twin))
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "spec.json").write_text(spec.to_json())
        (Path(d) / "adapter.py").write_text(render_adapter(spec, twin))
        load_adapter(Path(d)).adapt(twin.model)
    assert twin.model.onboard_replaced >= 1
    return twin.model.float().train()


class _Pickled(dict):
    def __init__(self, folder: Path):
        super().__init__()
        self.folder = folder

    def __missing__(self, name: str) -> Path:
        torch.manual_seed(0)
        self[name] = self.folder / f"{name}.pt"
        torch.save(adapted_twin(name), self[name])
        return self[name]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Pickled adapted twins by catalogue name, each built once, when first asked for."""
    return _Pickled(tmp_path_factory.mktemp("models"))


def reference(model_path: Path, plan: Plan, batch: torch.Tensor, lora_seed: int):
    """One process, all ranks' sequences in one batch: losses of every step and the first step's grads."""
    sys.path.insert(0, str(WORKER.parent))
    from worker import init_lora

    model = torch.load(model_path, weights_only=False)
    if plan.lora is not None:
        apply_lora(model, plan.lora)
        init_lora(model, lora_seed)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses, grads = [], None
    for step in range(STEPS):
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    return losses, grads


def run_case(models, tmp_path, name: str, world: int, plan: Plan):
    batch = torch.randint(3, 512, (world * plan.micro_batch, SEQ), generator=torch.Generator().manual_seed(1))
    torch.save(batch, tmp_path / "batch.pt")
    job = {"model": str(models[name]), "plan": plan.to_dict(), "batch": str(tmp_path / "batch.pt"),
           "lora_seed": 3, "steps": STEPS, "lr": LR, "out": str(tmp_path / "out.pt")}
    launch(world, job, tmp_path)
    got = torch.load(tmp_path / "out.pt", weights_only=False)
    want_losses, want_grads = reference(models[name], plan, batch, 3)
    assert got["losses"] == pytest.approx(want_losses, rel=1e-5, abs=1e-6)
    assert sorted(got["grads"]) == sorted(want_grads)
    for key, want in want_grads.items():
        torch.testing.assert_close(got["grads"][key], want, rtol=1e-4, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")
    return got


LAYOUTS = {  # name: (world, plan degrees)
    "fsdp": (2, {"dp_shard": 2}),
    "ep": (2, {"dp_replicate": 2, "ep": 2}),
    "fsdp_ep": (4, {"dp_shard": 4, "ep": 2}),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "qwen3-next-80b-a3b"])
def test_matches_single_process(models, tmp_path, name, layout, lora):
    world, degrees = LAYOUTS[layout]
    plan = Plan(**degrees, seq_len=SEQ, dtype="fp32", lora=LoRA(rank=4, alpha=8.0) if lora else None)
    got = run_case(models, tmp_path, name, world, plan)
    if lora:
        assert got["adapters"] and all(".lora_" in k for k in got["adapters"])
