"""Parallel layout: FSDP2, expert parallelism and LoRA across real gloo processes match one process.

Each case pickles an adapted tiny twin (runtime MoE blocks around HuggingFace's own parameters), starts
`world` processes of tests/parallel/worker.py on gloo, trains two SGD steps with one sequence per rank,
and compares losses and every gradient (gathered to full tensors) with the same model trained in this
process on all ranks' sequences at once.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

from runtime.lora import apply_lora
from runtime.moe import MoEBlock
from runtime.plan import LoRA, Plan
from tests import budget
from tests.parallel.zygote import Zygote, rank_env

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "parallel" / "worker.py"
SEQ = 12
LR = 0.5
STEPS = 3


def launch(world: int, job: dict, tmp_path: Path, script: Path = WORKER, timeout: int = 300) -> None:
    """Start `world` ranks of `script` with env rendezvous; fail with their output if any rank fails. A launch in
    which a rank was killed by a signal (a segmentation fault in the gloo transport, seen once in a CI run of 1,167
    tests and not again in isolation) runs once more; a crash that repeats, and every error a rank reports, fails."""
    failed = _launch_once(world, job, tmp_path, script, timeout)
    if failed and any(code < 0 for _, code, _ in failed):
        budget.relaunch()  # one world more than the site declares
        failed = _launch_once(world, job, tmp_path, script, timeout)
    assert not failed, failed


def _launch_once(world: int, job: dict, tmp_path: Path, script: Path, timeout: int) -> list:
    """(rank, return code, last output) of every rank that failed. The ranks are forks of this test process's zygote,
    which imported the torch stack once (tests/parallel/zygote.py), each with its own environment rendezvous, as
    torchrun's."""
    (tmp_path / "job.json").write_text(json.dumps(job))
    env = rank_env()
    started = Zygote.shared().start(world, [script, tmp_path / "job.json"], env=env, logs=tmp_path / "ranks")
    codes = started.wait(timeout)
    return [(rank, code, started.log(rank)) for rank, code in sorted(codes.items()) if code]


def write_bundle(name: str, folder: Path, layers: int | None = None) -> Path:
    """A catalogue model's (or `family:<model_type>`'s) tiny twin (or its first `layers` layers at twin width), its
    rendered adapter (runtime MoE blocks around HuggingFace's own parameters) and its weights, as
    tests/parallel/worker.py `load_model` reads them."""
    from onboard.adapt.codegen import render_adapter
    from onboard.adapt.decision import decide
    from onboard.inspect.capture import capture
    from onboard.inspect.inspection import build_spec
    from onboard.twin import Twin

    sys.path.insert(0, str(WORKER.parent))
    from worker import source_of

    source = source_of(name)
    torch.manual_seed(0)
    twin = Twin.build(source)
    spec = build_spec(twin, capture(twin))
    folder.mkdir(parents=True)
    (folder / "spec.json").write_text(spec.to_json())
    (folder / "adapter.py").write_text(render_adapter(spec, decide(spec, twin).taken()))
    (folder / "model.txt").write_text(name)
    model = twin.model
    if layers is not None:
        (folder / "layers.txt").write_text(str(layers))
        model = Twin.build(source, layers=layers, check=False).model
    torch.save(model.state_dict(), folder / "weights.pt")
    return folder


class _Bundles(dict):
    def __init__(self, folder: Path):
        super().__init__()
        self.folder = folder

    def __missing__(self, key: str) -> Path:
        name, _, layers = key.partition("@")  # "name@4": the twin's first 4 layers
        self[key] = write_bundle(name, self.folder / key.replace("@", "-"), int(layers) if layers else None)
        return self[key]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Bundle folders by catalogue name, each written once, when first asked for."""
    return _Bundles(tmp_path_factory.mktemp("models"))


def reference(model_path: Path, plan: Plan, batch: torch.Tensor, lora_seed: int):
    """One process, all ranks' sequences in one batch: losses of every step, the first step's gradients,
    the final parameters."""
    sys.path.insert(0, str(WORKER.parent))
    from worker import init_lora, load_model

    model = load_model(str(model_path))
    assert any(isinstance(m, MoEBlock) for m in model.modules())
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
    return losses, grads, {n: p.detach() for n, p in model.named_parameters()}


MODELS = ("qwen3-30b-a3b", "qwen3-next-80b-a3b")  # an MoE family and a hybrid (gated delta net) family
LAYOUTS = {  # world size: {layout: plan degrees}
    2: {"fsdp": {"dp_shard": 2}, "ep": {"dp_replicate": 2, "ep": 2}, "fsdp_ep": {"dp_shard": 2, "ep": 2}},
    4: {"fsdp": {"dp_shard": 4}, "ep": {"dp_replicate": 4, "ep": 4}, "fsdp_ep": {"dp_shard": 4, "ep": 2},
        "hsdp_ep": {"dp_replicate": 2, "dp_shard": 2, "ep": 2},
        "tp_fsdp": {"dp_shard": 2, "tp": 2}, "tp_fsdp_ep": {"dp_shard": 2, "tp": 2, "ep": 2},
        "pp_fsdp": {"pp": 2, "dp_shard": 2, "grad_accum": 2}, "pp_tp": {"pp": 2, "tp": 2, "grad_accum": 2}},
}
DEEPER = 4  # pipeline layouts train the twin's first 4 layers: two stages of two
# save / load checked where both FSDP2 shards and expert slices exist, and tp-split tensors with them
ROUND_TRIP = ("fsdp_ep", "hsdp_ep", "tp_fsdp_ep", "pp_tp")
# Every layout of every world size runs both models, and runs full and LoRA training: pairwise, one model full and
# the other with LoRA (which one alternates from layout to layout and between world sizes), so a layout is two
# cases, not four. The plain EP layout keeps all four: the overlap test reads both models' full runs.
CASES = [(world, name, layout, lora) for k, world in enumerate(LAYOUTS) for i, layout in enumerate(LAYOUTS[world])
         for j, name in enumerate(MODELS) for lora in (False, True)
         if layout == "ep" or lora == bool((i + j + k) % 2)]
# The gate runs one of a layout's two (the model alternating every other layout, so both models and both modes run
# at each world size) and EP's two full runs; the rest is the discovery lane's (pytest --discovery).
GATE = {(world, name, layout, lora) for k, world in enumerate(LAYOUTS) for i, layout in enumerate(LAYOUTS[world])
        for j, name in enumerate(MODELS) for lora in (False, True)
        if (layout == "ep" and not lora) or (layout != "ep" and j == (i // 2 + k) % 2
                                              and lora == bool((i + j + k) % 2))}


def lanes(cases: list, gate: set, ids) -> list:
    """`cases` as parameters: those in `gate` run in the gate, the others in the discovery lane."""
    return [pytest.param(*case, id=ids(*case), marks=() if case in gate else pytest.mark.discovery)
            for case in cases]


def launched(config, cases: list, gate: set) -> list:
    """The cases a launch runs: the gate's, or every one with --discovery."""
    return [case for case in cases if case in gate or config.getoption("--discovery")]


def plan_for(world: int, layout: str, lora: bool, **extra) -> Plan:
    return Plan(**LAYOUTS[world][layout], seq_len=SEQ, dtype="fp32",
                lora=LoRA(rank=4, alpha=8.0) if lora else None, **extra)


def model_key(name: str, layout: str) -> str:
    return f"{name}@{DEEPER}" if layout.startswith("pp") else name


def case_id(world, name, layout, lora, suffix="") -> str:
    return f"w{world}-{name}-{layout}-{'lora' if lora else 'full'}{suffix}"


def batch_for(world: int, folder: Path) -> Path:
    path = folder / f"batch{world}.pt"
    if not path.exists():
        torch.save(torch.randint(3, 512, (world, SEQ), generator=torch.Generator().manual_seed(world)), path)
    return path


@pytest.fixture(scope="module")
def results(models, tmp_path_factory, request):
    """Every case of one world size, run in a single launch of `world` processes; rank 0's results by id."""
    cache = {}

    def get(world: int) -> dict:
        if world not in cache:
            folder = tmp_path_factory.mktemp(f"world{world}")
            cases = [{"id": case_id(w, name, layout, lora), "model": str(models[model_key(name, layout)]),
                      "plan": plan_for(w, layout, lora).to_dict(), "batch": str(batch_for(w, folder)),
                      "lora_seed": 3, "steps": STEPS, "lr": LR, "round_trip": layout in ROUND_TRIP}
                     for w, name, layout, lora in launched(request.config, CASES, GATE) if w == world]
            # the same EP run without overlap: the trace must show the exchange waited on before local compute
            cases.append({**cases[0], "id": "no-overlap",
                          "plan": plan_for(world, "ep", False, overlap=False).to_dict()})
            # FSDP2 with EP, parameters gathered and computed in bf16, master weights and reductions in fp32
            cases.append({**cases[0], "id": "bf16-compute", "precision": "bf16", "round_trip": False,
                          "plan": plan_for(world, "fsdp_ep", False).to_dict()})
            launch(world, {"cases": cases, "out": str(folder / "out.pt")}, folder, timeout=900)
            cache[world] = {"out": torch.load(folder / "out.pt", weights_only=False), "folder": folder}
        return cache[world]

    return get


def assert_trains_as_reference(got: dict, want_losses: list, want_grads: dict) -> None:
    """A worker's losses (1e-5 relative), first-step gradients and their norm against one process's."""
    assert got["losses"] == pytest.approx(want_losses, rel=1e-5, abs=1e-6)
    assert sorted(got["grads"]) == sorted(want_grads)
    for key, want in want_grads.items():
        torch.testing.assert_close(got["grads"][key], want, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, key=key: f"grad {key}: {m}")
    want_norm = sum(g.double().pow(2).sum() for g in want_grads.values()).sqrt().item()
    assert got["grad_norm"] == pytest.approx(want_norm, rel=1e-5)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("world", "name", "layout", "lora"), lanes(CASES, GATE, case_id))
def test_matches_single_process(results, models, world, name, layout, lora):
    run = results(world)
    got = run["out"][case_id(world, name, layout, lora)]
    plan = plan_for(world, layout, lora)
    batch = torch.load(batch_for(world, run["folder"]))[:plan.global_batch]  # a tp group reads one slice
    want_losses, want_grads, want_params = reference(models[model_key(name, layout)], plan, batch, 3)
    if plan.tp > 1:  # softmax and Gated DeltaNet heads and shared experts split; routed experts whole
        split = got["tp_split"]
        assert any(".self_attn.o_proj." in n for n in split)
        assert any(".linear_attn.in_proj_qkvz." in n for n in split) == (name == "qwen3-next-80b-a3b")
        assert not any(".linear_attn.conv1d." in n or ".linear_attn.A_log" in n for n in split)  # read per head
        assert any(".shared.0." in n for n in split) == (name == "qwen3-next-80b-a3b")
        assert not any(".experts." in n for n in split)
        assert any(".lora_" in n for n in split) == lora
        assert got["norm_tokens"] == {SEQ // plan.tp}  # sequence parallelism: each rank's norms see its tokens
    assert_trains_as_reference(got, want_losses, want_grads)
    assert got.get("state_reloaded", layout not in ROUND_TRIP)
    if plan.ep > 1:
        assert got["comm_seconds"] > 0
    # saved state: full tensors after the steps (FSDP2 shards gathered, expert slices concatenated)
    assert sorted(got["params"]) == sorted(want_params)
    for key, want in want_params.items():
        torch.testing.assert_close(got["params"][key], want, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, key=key: f"param {key}: {m}")
    if lora:
        adapters = {k: v for k, v in want_params.items() if ".lora_" in k}
        assert sorted(got["adapters"]) == sorted(adapters)
        for key, want in adapters.items():  # saved adapters: full tensors, expert stacks whole
            torch.testing.assert_close(got["adapters"][key], want, rtol=1e-4, atol=1e-6)
        assert got.get("reloaded", layout not in ROUND_TRIP)
        assert all(".lora_" in k for k in want_grads)  # the base is frozen: only adapters train


@pytest.mark.multiprocess
def test_bf16_mixed_precision_computes_in_bf16_and_keeps_fp32_master_weights(results, models):
    """FSDP2's mixed-precision policy, as `runtime.parallel.api.mixed_precision` picks it for a bf16 plan on an
    accelerator (forced here on CPU): the losses follow the fp32 run to bf16's precision without equalling it, and
    the weights the optimizer updates stay fp32."""
    from runtime.parallel.api import mixed_precision

    run = results(2)
    got = run["out"]["bf16-compute"]
    plan = plan_for(2, "fsdp_ep", False)
    want_losses, _, _ = reference(models[MODELS[0]], plan, torch.load(batch_for(2, run["folder"])), 3)
    assert got["losses"] == pytest.approx(want_losses, rel=3e-2)
    assert got["losses"] != pytest.approx(want_losses, rel=1e-6, abs=1e-7)
    assert all(p.dtype == torch.float32 for p in got["params"].values())
    policy = mixed_precision(Plan(dtype="bf16"), "cuda")
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mixed_precision(Plan(dtype="bf16"), "cpu") is None and mixed_precision(Plan(dtype="fp32"), "cuda") is None


def _positions(trace: list, event: str) -> list[int]:
    return [i for i, e in enumerate(trace) if e == event]


def _issued_between(trace: list, first: str, middle: str, last: str) -> int:
    """How many times `middle` came after `first` and before `last` (each occurrence of each, in order)."""
    a, b, c = (_positions(trace, e) for e in (first, middle, last))
    assert len(a) == len(b) == len(c) >= STEPS, (first, middle, last, trace[:12])
    return sum(x < y < z for x, y, z in zip(a, b, c))


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_local_experts_overlap_the_exchanges(results, world):
    """Local expert compute is issued after each All-to-All starts and before it is waited on: half of the
    own tokens under the dispatch, half under the combine, in forward and (reverse exchanges) in backward.
    With overlap off, the dispatch is waited on before any local compute."""
    out = results(world)["out"]
    for name in MODELS:
        trace = out[case_id(world, name, "ep", False)]["trace"]
        for exchange, local in (("dispatch", "local_experts"), ("combine", "local_experts_combine")):
            n = len(_positions(trace, f"{exchange}:start"))
            assert _issued_between(trace, f"{exchange}:start", local, f"{exchange}:wait") == n
            assert _issued_between(trace, f"{exchange}:backward_start", f"{local}_backward",
                                   f"{exchange}:backward_wait") == n
    trace = out["no-overlap"]["trace"]
    waits, locals_ = _positions(trace, "dispatch:wait"), _positions(trace, "local_experts")
    assert len(waits) == len(locals_) > 0 and all(w < c for w, c in zip(waits, locals_))


# ---- single process: LoRA and plan checks (no process group) ------------------------------------------


@pytest.fixture(scope="module")
def qwen3(models):
    sys.path.insert(0, str(WORKER.parent))
    from worker import load_model

    return lambda: load_model(str(models["qwen3-30b-a3b"]))


def test_lora_starts_as_the_base_model_and_trains_only_adapters(qwen3):
    from runtime.lora import lora_state_dict

    model, base = qwen3(), qwen3()
    names = set(dict(model.named_parameters()))
    adapted = list(apply_lora(model, LoRA(rank=4, alpha=8.0)).parts)
    assert any("self_attn.q_proj" in n for n in adapted) and any(n.endswith("mlp.experts") for n in adapted)
    assert names <= set(dict(model.named_parameters()))  # base parameters keep their names
    ids = torch.randint(3, 512, (2, SEQ), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    torch.testing.assert_close(loss, base(input_ids=ids, labels=ids, use_cache=False).loss)
    loss.backward()
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    assert trained and all(".lora_" in n for n in trained)
    assert any(model.get_parameter(n).grad.abs().sum() > 0 for n in trained if n.endswith("_b"))
    assert set(lora_state_dict(model)) == {n for n, p in model.named_parameters() if p.requires_grad}


def test_grouped_lora_equals_merged_expert_weights(qwen3):
    """Each expert's update is its own B_e A_e: the adapted experts compute what the base experts compute
    with W_e + (alpha / r) B_e A_e, token by token."""
    from runtime.lora import LoRAGroupedExperts
    from runtime.moe.dispatch import permute, sort_by_expert

    model = qwen3()
    block = model.model.layers[0].mlp
    torch.manual_seed(0)  # A's initialisation draws from the global generator: the same whatever ran before
    LoRAGroupedExperts.convert(block.experts, rank=3, alpha=6.0)
    experts = block.experts
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name in ("gate_up", "down"):
            getattr(experts, f"lora_{name}_b").copy_(torch.randn(getattr(experts, f"lora_{name}_b").shape,
                                                                 generator=gen))
    x = torch.randn(20, 64, generator=gen)
    d = sort_by_expert(torch.randint(0, 8, (20, 2), generator=gen), 8)
    tokens = permute(x, d)
    got = experts(tokens, d)
    merged = {name: getattr(experts, name) + 2.0 * getattr(experts, f"lora_{name}_b") @ getattr(experts, f"lora_{name}_a")
              for name in ("gate_up", "down")}
    plain = qwen3().model.layers[0].mlp.experts
    with torch.no_grad():
        plain.gate_up.copy_(merged["gate_up"])
        plain.down.copy_(merged["down"])
    # two fp32 paths (low-rank update beside the base vs merged weights) over outputs of size ~10: rounding ~1e-5
    torch.testing.assert_close(got, plain(tokens, d), rtol=1e-5, atol=5e-5)


def test_plan_problems_are_clear_errors():
    from runtime.parallel import build_mesh

    with pytest.raises(ValueError, match=r"context parallelism with pipeline parallelism and recompute is not built"):
        build_mesh(Plan(cp=2, pp=2, grad_accum=2, recompute="full"))
    with pytest.raises(ValueError, match=r"2\*cp=4 segments: it must divide seq_len=4098"):
        build_mesh(Plan(cp=2, seq_len=4098))
    with pytest.raises(ValueError, match="needs 4 processes"):
        build_mesh(Plan(dp_shard=4))
    with pytest.raises(ValueError, match="ep=3"):
        build_mesh(Plan(dp_shard=4, ep=3))
    with pytest.raises(ValueError, match="match no module"):
        apply_lora(torch.nn.Sequential(torch.nn.Linear(2, 2)), LoRA(targets=["attention"]))


def test_single_process_parallelize_applies_lora_only(qwen3):
    from runtime.parallel import build_mesh, parallelize

    model = qwen3()
    plan = Plan(lora=LoRA(rank=2))
    parallelize(model, plan, build_mesh(plan))
    assert all(".lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    assert all(b.expert_parallel is None for b in model.modules() if hasattr(b, "expert_parallel"))


def test_expert_parallelism_refuses_experts_it_cannot_split():
    """An experts-only swap (runtime experts inside a HuggingFace block) is not split by EP: refused, not
    silently run unsplit."""
    import torch.nn.functional as F

    from runtime.moe import MoEBlock, RouterSpec
    from runtime.moe.block import GroupedExperts
    from runtime.moe.routed_experts import RoutedExperts
    from runtime.parallel import parallelize

    def stacks():
        return GroupedExperts(torch.nn.Parameter(torch.randn(4, 8, 4)), torch.nn.Parameter(torch.randn(4, 4, 4)),
                              activation=F.silu)

    model = torch.nn.ModuleDict({"moe": MoEBlock(torch.nn.Parameter(torch.randn(4, 4)), RouterSpec(4, 2), stacks()),
                                 "hf_block": torch.nn.ModuleDict({"experts": RoutedExperts(stacks())})})
    with pytest.raises(ValueError, match="hf_block.experts.experts"):
        parallelize(model, Plan(dp_replicate=2, ep=2), None)


CRASHING_RANK = """
import os, signal, sys
from pathlib import Path
marker = Path(sys.argv[1]).with_name("crashed-" + os.environ["RANK"])
if os.environ["RANK"] == "0" and (os.environ.get("CRASH") == "always" or not marker.exists()):
    marker.touch()
    os.kill(os.getpid(), signal.SIGSEGV)
"""


@pytest.mark.parametrize("crash", ["once", "always"])
def test_a_rank_killed_by_a_signal_is_launched_again_once(tmp_path, monkeypatch, crash):
    script = tmp_path / "rank.py"
    script.write_text(CRASHING_RANK)
    monkeypatch.setenv("CRASH", crash)
    if crash == "once":
        launch(2, {}, tmp_path, script, timeout=60)
    else:
        with pytest.raises(AssertionError, match="-11"):
            launch(2, {}, tmp_path, script, timeout=60)
