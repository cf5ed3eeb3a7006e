"""Issue 38 item 6: whole models under context parallelism match one process.

Each rank holds the zig-zag segments of its sequences (`runtime.parallel.context_split`); softmax attention
(Qwen3-30B-A3B; Kimi-Linear's MLA; gpt-oss's sinks and windows; Llama 4's chunks), the gated delta rule with its
short convolutions (Qwen3-Next's Gated DeltaNet, Kimi-Linear's KDA), scalar decay (NemotronH's Mamba2 SSD,
MiniMax's lightning attention) and DSA (DeepSeek-V3.2) compute across the segments. Two SGD steps on gloo ranks
(one thread each) at cp 2 (world 2), cp 2 x FSDP2 (dp_shard 2) x EP 2, cp 2 x tp 2 and cp 2 x pp 2 (world 4), full
training and LoRA, plain and packed sequences (documents crossing segment boundaries), against the adapted twin
trained in this process on every sequence whole: losses to 1e-5 relative, every gradient (gathered to full tensors)
and the parameters after the steps to 1e-4.
"""

import sys

import pytest
import torch

from runtime.lora import apply_lora
from runtime.plan import LoRA, Plan

from tests.runtime.test_parallel import (  # noqa: F401,F811 (models: a fixture)
    ROOT,
    WORKER,
    assert_trains_as_reference,
    batch_for,
    launch,
    launched,
    lanes,
    models,
)

sys.path.insert(0, str(WORKER.parent))

SEQ = 12  # 2 cp = 4 segments of 3 tokens
LR = 0.5
STEPS = 2
PACKED = [0, 5, 9]  # document starts: the second crosses segment 1 / 2, the third starts inside segment 3
MODELS = ("qwen3-30b-a3b", "qwen3-next-80b-a3b", "kimi-linear-48b-a3b", "deepseek-v3.2")
# HuggingFace's load-balancing loss joins the training loss (output_router_logits): its statistics span the cp ranks.
# Not under pp: a stage's loss sums the router logits of its own layers only (runtime.parallel.pipeline)
ROUTER_LOSS = {"qwen3-30b-a3b", "qwen3-next-80b-a3b"}


def router_loss(name: str, layout: str) -> bool:
    return name in ROUTER_LOSS and "pp" not in layout
LAYOUTS = {2: {"cp": {"cp": 2}}, 4: {"cp_fsdp_ep": {"cp": 2, "dp_shard": 2, "ep": 2}, "cp_tp": {"cp": 2, "tp": 2},
                                     "cp_pp": {"cp": 2, "pp": 2, "grad_accum": 2}}}
DEEPER = 4  # pipeline layouts train the twin's first 4 layers: two stages of two
# (world, model, layout, LoRA, packed): at cp 2 every model runs full and LoRA, plain and packed; at cp 2 x FSDP2 x EP 2
# each model once, the two options alternating. Packed documents here are shorter than DSA's top_k = 8, so DSA's
# plain sequences are where its indexer chooses among the keys a query sees.
CASES = [(2, "qwen3-30b-a3b", "cp", False, False), (2, "qwen3-30b-a3b", "cp", True, True),
         (2, "qwen3-next-80b-a3b", "cp", True, False), (2, "qwen3-next-80b-a3b", "cp", False, True),
         (2, "kimi-linear-48b-a3b", "cp", False, False), (2, "kimi-linear-48b-a3b", "cp", True, True),
         (2, "deepseek-v3.2", "cp", True, False), (2, "deepseek-v3.2", "cp", False, True),
         # Mamba2's SSD (NemotronH) and MiniMax's lightning attention: scalar-decay states carried across segments
         (2, "family:nemotron_h", "cp", False, True), (2, "family:minimax", "cp", True, False),
         # attention sinks (one logit per head every query's softmax sees) and sliding windows; plain sequences:
         # gpt-oss runs eager attention, whose mask in transformers 5.24 ignores packed documents (cp keeps them apart)
         (2, "gpt-oss-120b", "cp", False, False),
         # Llama 4's chunked attention (chunks of 8 in the twin: the chunk boundary at 8 falls inside segment 2) and
         # its global NoPE layers
         (2, "llama-4-scout", "cp", False, True), (2, "llama-4-scout", "cp", True, False),
         (4, "qwen3-30b-a3b", "cp_fsdp_ep", False, True), (4, "qwen3-next-80b-a3b", "cp_fsdp_ep", True, False),
         (4, "kimi-linear-48b-a3b", "cp_fsdp_ep", True, True), (4, "deepseek-v3.2", "cp_fsdp_ep", False, False),
         # tensor parallelism inside each cp rank: softmax and Gated DeltaNet heads split, sequence parallelism over
         # the rank's half
         (4, "qwen3-30b-a3b", "cp_tp", True, True), (4, "qwen3-next-80b-a3b", "cp_tp", False, False),
         # two pipeline stages, each micro-batch's forward under its own split (1F1B over two micro-batches)
         (4, "qwen3-30b-a3b", "cp_pp", False, False), (4, "qwen3-next-80b-a3b", "cp_pp", True, True)]

# The gate runs every attention kind once at cp 2 (full and LoRA, plain and packed each among them) and every world-4
# layout once; the other cases are the discovery lane's (pytest --discovery).
GATE = {(2, "qwen3-30b-a3b", "cp", True, True), (2, "qwen3-next-80b-a3b", "cp", False, True),
        (2, "kimi-linear-48b-a3b", "cp", False, False), (2, "deepseek-v3.2", "cp", True, False),
        (2, "family:nemotron_h", "cp", False, True), (2, "family:minimax", "cp", True, False),
        (2, "gpt-oss-120b", "cp", False, False), (2, "llama-4-scout", "cp", False, True),
        (4, "deepseek-v3.2", "cp_fsdp_ep", False, False), (4, "qwen3-next-80b-a3b", "cp_tp", False, False),
        (4, "qwen3-30b-a3b", "cp_pp", False, False)}


def plan_for(world: int, layout: str, lora: bool) -> Plan:
    return Plan(**LAYOUTS[world][layout], seq_len=SEQ, dtype="fp32", lora=LoRA(rank=4, alpha=8.0) if lora else None)


def model_key(name: str, layout: str) -> str:
    return f"{name}@{DEEPER}" if "pp" in layout else name


def case_id(world, name, layout, lora, packed) -> str:
    return f"w{world}-{name}-{layout}-{'lora' if lora else 'full'}{'-packed' if packed else ''}"


def reference(folder, plan: Plan, batch: torch.Tensor, packed: bool, router_loss: bool):
    """One process, every sequence whole: the mean of the sequences' losses per step, the first step's gradients,
    the final parameters."""
    from worker import init_lora, load_model, rows_of

    model = load_model(str(folder))
    model.config.output_router_logits = router_loss
    if plan.lora is not None:
        apply_lora(model, plan.lora)
        init_lora(model, 3)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses, grads = [], None
    case = {"packed": PACKED if packed else None}
    for step in range(STEPS):
        rows = [r for row in batch.split(1) for r in rows_of(row, case)]
        total = 0.0
        for inputs in rows:
            loss = model(**inputs, use_cache=False).loss / len(rows)
            loss.backward()
            total += loss.item()
        losses.append(total)
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    return losses, grads, {n: p.detach() for n, p in model.named_parameters()}


def assert_case_trains_as_reference(got: dict, run: dict, folder, plan: Plan, packed: bool, router_loss: bool):
    """A worker's case (losses, first-step gradients, parameters after the steps) against `reference` on the
    launch's batch."""
    batch = torch.load(batch_for(plan.world_size, run["folder"]))[:plan.global_batch, :SEQ]
    want_losses, want_grads, want_params = reference(folder, plan, batch, packed, router_loss)
    assert_trains_as_reference(got, want_losses, want_grads)
    for key, want in want_params.items():
        torch.testing.assert_close(got["params"][key], want, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, key=key: f"param {key}: {m}")


def launches(tmp_path_factory, cases_of) -> callable:
    """get(world): the launch of every case `cases_of(world, folder)` lists, run once per world size (rank 0's
    results by id, and the launch's folder)."""
    cache = {}

    def get(world: int) -> dict:
        if world not in cache:
            folder = tmp_path_factory.mktemp(f"w{world}")
            launch(world, {"cases": cases_of(world, folder), "out": str(folder / "out.pt")}, folder, timeout=900)
            cache[world] = {"out": torch.load(folder / "out.pt", weights_only=False), "folder": folder}
        return cache[world]

    return get


@pytest.fixture(scope="module")
def results(models, tmp_path_factory, request):  # noqa: F811
    return launches(tmp_path_factory, lambda world, folder: [
        {"id": case_id(w, name, layout, lora, packed), "model": str(models[model_key(name, layout)]),
         "plan": plan_for(w, layout, lora).to_dict(), "batch": str(batch_for(w, folder)), "lora_seed": 3,
         "steps": STEPS, "lr": LR, "packed": PACKED if packed else None, "router_loss": router_loss(name, layout)}
        for w, name, layout, lora, packed in launched(request.config, CASES, GATE) if w == world])


@pytest.mark.multiprocess
@pytest.mark.parametrize(("world", "name", "layout", "lora", "packed"), lanes(CASES, GATE, case_id))
def test_context_parallel_model_matches_one_process(results, models, world, name, layout, lora, packed):  # noqa: F811
    run = results(world)
    got = run["out"][case_id(world, name, layout, lora, packed)]
    plan = plan_for(world, layout, lora)
    if plan.tp > 1:  # the softmax heads split, and the norms see a tp part of this rank's segments
        assert any(".self_attn.o_proj." in n for n in got["tp_split"])
        assert got["norm_tokens"] == {SEQ // (plan.cp * plan.tp)}
    assert_case_trains_as_reference(got, run, models[model_key(name, layout)], plan, packed, router_loss(name, layout))


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [{"cp": 2, "ep": 2}, {"tp": 2, "cp": 2, "ep": 4, "etp": 1}],
                         ids=["cp2-ep2", "tp2-cp2-ep4-folded"])
def test_the_flagship_trains_through_onboard_train_under_cp_as_in_one_process(forked_torchrun, tmp_path, layout):
    """The flagship's twin (KDA and DSA layers, remote code from the catalogue) with LoRA: `onboard train` over
    torchrun ranks logs the losses `runtime.train` logs in this process for the same model on whole sequences. At
    cp 2 x ep 2 each rank holds half of every sequence and half of the experts; at the shape of the plan `onboard
    plan` writes for it on 128 Ascend 910C (tp 2 x cp 8, EP folded over the tp and cp ranks), cut to four ranks,
    KDA and DSA heads split over tp 2, each sequence over cp 2, the experts over all four ranks."""
    import json

    from cli import main
    from onboard.train.model import build_model, train_config
    from runtime.runlog import read_runs
    from runtime.train import TrainJob, train

    bundle = ROOT / "bundles" / "onboard-flagship-2.8t"
    lora = LoRA(rank=4, alpha=8.0)
    plan = tmp_path / "plan.json"
    plan.write_text(Plan(**layout, seq_len=32, dtype="fp32", lora=lora).to_json())
    log = tmp_path / "cp.jsonl"
    assert main(["train", str(bundle), "--trust-remote-code", "--plan", str(plan), "--steps", "3",
                 "--runlog", str(log), "--checkpoint-dir", str(tmp_path / "ck")]) == 0
    runs, _ = read_runs(log)
    got = [s["loss"] for s in runs[0].steps]
    config = tmp_path / "config.json"  # the twin's config, as onboard train hands it to every rank
    config.write_text(json.dumps(train_config(bundle, trust_remote_code=True), sort_keys=True))
    one = train(lambda: build_model(bundle, config=str(config), trust_remote_code=True),
                Plan(seq_len=32, dtype="fp32", lora=lora), TrainJob(steps=3, progress=False))
    assert got == pytest.approx([s.loss for s in one.steps], rel=1e-5)


def test_llama4_trains_as_its_text_model_with_its_chunks_declared():
    """`onboard train`'s model factory on Llama 4 (a multimodal config whose causal LM is its text part): the twin's
    text model (read as the outer config it would take the full-scale text defaults), its chunked layers declared
    with the trained chunk for context parallelism, the global NoPE layers not. Its attention temperature tuning
    counts positions on the tokens a module is given: cp refuses it where the factor would differ (seq_len at or
    past floor_scale), and runs shorter sequences, where it is 1 on every rank."""
    from onboard.train.model import build_model
    from runtime.parallel.context_split import prepare

    model, _ = build_model(ROOT / "bundles" / "llama-4-scout")
    assert type(model.config).__name__ == "Llama4TextConfig" and model.config.hidden_size <= 64
    chunks = [getattr(layer.self_attn, "context_parallel_chunk", None) for layer in model.model.layers]
    assert chunks == [8 if kind == "chunked_attention" else None for kind in model.config.layer_types]
    assert chunks[:4] == [8, 8, 8, None]
    prepare(model, 64)
    with pytest.raises(ValueError, match="attention temperature tuning, floor_scale 8192"):
        prepare(model, 8192)
