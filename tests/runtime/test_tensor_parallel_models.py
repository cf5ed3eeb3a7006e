"""Tensor parallelism over MLA, DeepSeek sparse attention, KDA, Gated DeltaNet and attention sinks, and MoE
parallel folding: whole models against one process.

MLA's low-rank latents (q_a, kv_a with the shared rotary key, their norms) and DSA's indexer stay whole on every tp
rank; the heads (q_b, kv_b, o_proj) split; inside the attention the backward runs in partial-gradient form
(`runtime.parallel.tensor`). KDA's and Gated DeltaNet's projections split by head (KDA's gate latents whole), their
fused short convolution and per-head decay parameters, and gpt-oss's sinks, are read at each rank's heads. Two SGD
steps on gloo ranks (one thread each): tp 2 (world 2) on DeepSeek-V3.2 (DSA), DeepSeek-V3 (MLA), Kimi-Linear (MLA
and KDA), Qwen3-Next (Gated DeltaNet, two value heads per key head) and gpt-oss, full training and LoRA, plain and
packed sequences; tp 2 x cp 2 and tp 2 x FSDP2 2 x EP 2 (world 4) on DeepSeek-V3.2, tp 2 x cp 2 on Kimi-Linear.
Losses to 1e-5 relative, every gradient (gathered to full tensors) and the parameters after the steps to 1e-4, as
the other layouts are checked.

MoE parallel folding (etp 1): each tp rank's MoE blocks route their own part of the sequence over an EP group that
spans the tp ranks; router and shared experts whole, their gradients summed over the tp ranks. tp 2 x ep 2 (world
2) and tp 2 x FSDP2 2 x ep 4, tp 2 x cp 2 x ep 4 (world 4) on Qwen3-30B-A3B and DeepSeek-V3.2.
"""

import pytest

from runtime.plan import LoRA, Plan

from tests.runtime.test_context_model import LR, PACKED, SEQ, STEPS, assert_case_trains_as_reference, launches
from tests.runtime.test_parallel import batch_for, launched, lanes, models  # noqa: F401

LAYOUTS = {2: {"tp": {"tp": 2}, "tp_fold": {"tp": 2, "ep": 2, "etp": 1}},
           4: {"tp_cp": {"tp": 2, "cp": 2}, "tp_fsdp_ep": {"tp": 2, "dp_shard": 2, "ep": 2},
               "tp_fsdp_fold": {"tp": 2, "dp_shard": 2, "ep": 4, "etp": 1},
               "tp_cp_fold": {"tp": 2, "cp": 2, "ep": 4, "etp": 1}}}
# (world, model, layout, LoRA, packed)
CASES = [(2, "deepseek-v3.2", "tp", False, False), (2, "deepseek-v3.2", "tp", True, True),
         (2, "deepseek-v3", "tp", True, False), (2, "deepseek-v3", "tp", False, True),
         (2, "kimi-linear-48b-a3b", "tp", False, True), (2, "kimi-linear-48b-a3b", "tp", True, False),
         (2, "gpt-oss-120b", "tp", False, False),  # per-head sinks, read at each rank's heads
         (2, "qwen3-next-80b-a3b", "tp", True, True),  # Gated DeltaNet: two value heads per key head
         (4, "deepseek-v3.2", "tp_cp", True, False), (4, "deepseek-v3.2", "tp_fsdp_ep", False, True),
         (4, "kimi-linear-48b-a3b", "tp_cp", False, True),
         # MoE parallel folding: the EP group spans the tp ranks (and the FSDP2 or cp ranks at world 4)
         (2, "qwen3-30b-a3b", "tp_fold", False, True), (2, "deepseek-v3.2", "tp_fold", True, False),
         (4, "qwen3-30b-a3b", "tp_fsdp_fold", True, False), (4, "deepseek-v3.2", "tp_cp_fold", False, True)]

# The gate runs every attention kind once at tp 2 and every other layout once; the other cases are the discovery
# lane's (pytest --discovery)
GATE = {(2, "deepseek-v3.2", "tp", True, True), (2, "deepseek-v3", "tp", False, True),
        (2, "kimi-linear-48b-a3b", "tp", True, False), (2, "gpt-oss-120b", "tp", False, False),
        (2, "qwen3-next-80b-a3b", "tp", True, True), (2, "qwen3-30b-a3b", "tp_fold", False, True),
        (4, "kimi-linear-48b-a3b", "tp_cp", False, True), (4, "deepseek-v3.2", "tp_fsdp_ep", False, True),
        (4, "qwen3-30b-a3b", "tp_fsdp_fold", True, False), (4, "deepseek-v3.2", "tp_cp_fold", False, True)}


def plan_for(world: int, layout: str, lora: bool) -> Plan:
    return Plan(**LAYOUTS[world][layout], seq_len=SEQ, dtype="fp32", lora=LoRA(rank=4, alpha=8.0) if lora else None)


def case_id(world, name, layout, lora, packed) -> str:
    return f"w{world}-{name}-{layout}-{'lora' if lora else 'full'}{'-packed' if packed else ''}"


@pytest.fixture(scope="module")
def results(models, tmp_path_factory, request):  # noqa: F811
    return launches(tmp_path_factory, lambda world, folder: [
        {"id": case_id(w, name, layout, lora, packed), "model": str(models[name]),
         "plan": plan_for(w, layout, lora).to_dict(), "batch": str(batch_for(w, folder)), "lora_seed": 3,
         "steps": STEPS, "lr": LR, "packed": PACKED if packed else None}
        for w, name, layout, lora, packed in launched(request.config, CASES, GATE) if w == world])


@pytest.mark.multiprocess
@pytest.mark.parametrize(("world", "name", "layout", "lora", "packed"), lanes(CASES, GATE, case_id))
def test_tensor_parallel_models_match_one_process(results, models, world, name, layout, lora, packed):  # noqa: F811
    run = results(world)
    got = run["out"][case_id(world, name, layout, lora, packed)]
    plan = plan_for(world, layout, lora)
    split = got["tp_split"]  # the heads split, the latents whole
    assert any(".self_attn.o_proj." in n for n in split)
    assert any(".self_attn.kv_b_proj." in n for n in split) == name.startswith(("deepseek", "kimi"))
    assert not any(key in n for n in split for key in ("q_a_proj", "kv_a_proj", "indexer", "f_a_proj", "g_a_proj",
                                                      "conv1d", "dt_bias", "A_log"))
    # KDA: its heads' projections and gates split, the gates' latents whole, the short convolution and per-head
    # decay whole on every rank (each reads its own heads' part)
    assert any(".forget_gate.f_b_proj." in n for n in split) == name.startswith("kimi")
    assert any(".linear_attn.in_proj_qkvz." in n for n in split) == name.startswith("qwen3-next")  # Gated DeltaNet
    assert got["norm_tokens"] == {SEQ // (plan.cp * plan.tp)}
    if plan.folded:  # the MoE blocks are not split: shared experts whole, the experts exchanged across tp ranks
        assert not any(".shared." in n or ".experts." in n for n in split) and got["comm_seconds"] > 0
    assert_case_trains_as_reference(got, run, models[name], plan, packed, False)
