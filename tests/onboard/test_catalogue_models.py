"""Every bundled model inspects, and full-scale totals agree with the published figures."""

import math

import pytest

from onboard.source import catalogue_index

CATALOGUE = catalogue_index()


@pytest.mark.parametrize("slug", sorted(CATALOGUE))
def test_totals_match_published(slug, inspected):
    spec, _ = inspected(slug)
    published = CATALOGUE[slug].get("published", {})
    total = published.get("params_total")
    assert total, f"{slug}: catalogue entry without a published total"
    if published.get("total_is_label"):
        assert math.floor(spec.params_total / 1e9) >= total / 1e9
        total = published["params_total_checkpoint"]  # the precise count the authors give
    assert spec.params_total == pytest.approx(total, rel=0.02)
    active = published.get("params_active")
    if active is None:
        return
    if published.get("active_is_label"):
        # "A3B"-style names: the figure is a label in whole billions
        assert math.floor(spec.params_active / 1e9) == round(active / 1e9)
        return
    # model cards count "active" differently; the catalogue records which way each one does
    convention = published.get("active_convention", "without_embedding")
    ours = {
        "with_embedding": spec.params_active_with_embedding,
        "without_embedding": spec.params_active,
        "without_embedding_and_head": spec.params_active - spec.params_head,
    }[convention]
    assert ours == pytest.approx(active, rel=0.02)


def _kinds(spec):
    return [(layer.attention.kind, layer.mlp.kind) for layer in spec.layers]


def test_deepseek_v3_structure(inspected):
    spec, _ = inspected("deepseek-v3")
    assert _kinds(spec) == [("mla", "dense")] * 3 + [("mla", "moe")] * 58
    moe = spec.layers[3].mlp
    assert (moe.num_experts, moe.top_k, moe.expert_ffn, moe.num_shared_experts) == (256, 8, 2048, 1)
    r = moe.router
    assert (r.score, r.group_limited, r.n_group, r.topk_group) == ("sigmoid", True, 8, 4)
    assert r.bias_correction and r.renormalize and r.scaling == pytest.approx(2.5)
    attn = spec.layers[0].attention
    assert (attn.num_heads, attn.q_lora_rank, attn.kv_lora_rank, attn.rope_head_dim) == (128, 1536, 512, 64)


def test_qwen3_next_hybrid_pattern(inspected):
    spec, _ = inspected("qwen3-next-80b-a3b")
    kinds = [layer.attention.kind for layer in spec.layers]
    assert kinds == (["linear:gated_deltanet"] * 3 + ["softmax"]) * 12
    full = spec.layers[3].attention
    assert full.output_gate and full.qk_norm and (full.num_heads, full.num_kv_heads, full.head_dim) == (16, 2, 256)
    linear = spec.layers[0].attention
    assert linear.gate == "scalar" and linear.conv_kernel == 4
    moe = spec.layers[0].mlp
    assert (moe.num_experts, moe.top_k, moe.num_shared_experts, moe.shared_expert_gated) == (512, 10, 1, True)
    assert moe.router.score == "softmax" and moe.router.renormalize


def test_kimi_linear_kda_and_mla(inspected):
    spec, _ = inspected("kimi-linear-48b-a3b")
    kinds = [layer.attention.kind for layer in spec.layers]
    assert kinds.count("linear:kda") == 20 and kinds.count("mla") == 7
    assert spec.layers[0].attention.gate == "channel"
    assert spec.layers[0].mlp.kind == "dense" and spec.layers[1].mlp.kind == "moe"


def test_gpt_oss_sinks_and_alternating_windows(inspected):
    spec, _ = inspected("gpt-oss-120b")
    kinds = [layer.attention.kind for layer in spec.layers]
    assert kinds == ["sliding", "softmax"] * 18
    assert spec.layers[0].attention.window == 128
    assert all(layer.attention.sinks for layer in spec.layers)
    moe = spec.layers[0].mlp
    assert (moe.num_experts, moe.top_k) == (128, 4)
    assert moe.router.order == "topk_then_score" and moe.router.renormalize


def test_flagship(inspected):
    spec, _ = inspected("onboard-flagship-2.8t")
    kinds = [layer.attention.kind for layer in spec.layers]
    assert kinds.count("linear:kda") == 54 and kinds.count("sparse:dsa") == 18
    assert kinds[:4] == ["linear:kda"] * 3 + ["sparse:dsa"]
    moe = spec.layers[-1].mlp
    assert (moe.num_experts, moe.top_k, moe.num_shared_experts) == (896, 16, 1)
    assert spec.layers[3].attention.index_topk == 2048
    assert spec.params_total == pytest.approx(2.8e12, rel=0.02)


@pytest.mark.parametrize("slug", ["llama-3.1-8b", "qwen3-8b"])
def test_dense_models_are_all_dense(slug, inspected):
    spec, _ = inspected(slug)
    assert all(layer.mlp.kind == "dense" for layer in spec.layers)
    assert all(layer.attention.kind == "softmax" for layer in spec.layers)
    assert spec.params_active == spec.params_total - spec.params_embedding
    assert not spec.unmatched
