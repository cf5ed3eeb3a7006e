"""HunYuan-V4 (transformers' hy_v4) DSA on the runtime: its indexer puts the rotary on the trailing rope dims and
the softmax scale on the head weights, and its attention adds a learned sink per head. The runtime reads both off
what the modules compute (a probe, the `s_aux` argument), picks the keys HYV4Indexer picks, and the swapped model
and a generated bundle match HuggingFace's eager attention in outputs and gradients."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV32Config, HYV4Config
from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer
from transformers.models.hy_v4.modeling_hy_v4 import (
    HYV4Attention,
    HYV4Indexer,
    eager_attention_forward,
)

from runtime.attention import dsa
from runtime.attention.dsa import dsa_attention, swap_sparse_attention
from runtime.attention.indexer import ROPE_AT, ROTARY, SCALE_AT, LightningIndexer
import runtime.attention.indexer as indexer_mod
from runtime.attention.sparse import sparse_attention
import runtime.attention.sparse_chunks as chunks_mod
from tests.helpers import rel, swap_all_sparse
from tests.runtime import test_sparse_attention as base
from tests.runtime.test_sparse_attention import (  # noqa: F401 (one_thread: autouse)
    batch,
    compare,
    hf_indexer,
    one_thread,
)


def test_runtime_indexer_picks_what_hyv4_picks(monkeypatch):
    """DeepSeek-V3.2's check (same picks in the same order, ties included, over bool and additive masks, one query
    per chunk) on HYV4Indexer, whose variant the probe reads as half-split rotary on the trailing dims, scale on
    the weights."""
    base.test_chunked_indexer_picks_what_hf_picks(HYV4Indexer, HYV4Config, "half", monkeypatch)
    ours = LightningIndexer.adopt(hf_indexer(HYV4Indexer, HYV4Config))
    assert (ours.rotary, ours.rope_at, ours.scale_at) == ("half", "trailing", "weights")


@pytest.mark.parametrize("cls,config_cls,variant", [(HYV4Indexer, HYV4Config, ("half", "trailing", "weights")),
                                                    (DeepseekV32Indexer, DeepseekV32Config,
                                                     ("half", "leading", "scores"))])
def test_the_probe_tells_every_variant_apart(cls, config_cls, variant):
    """Of the eight (rotary, rope dims, scale placement) variants exactly one multiplies the operands HF does."""
    hf = hf_indexer(cls, config_cls)
    inputs = indexer_mod._probe_inputs(hf)
    want = indexer_mod._products(hf, inputs)
    matching = [v for v in ((r, p, s) for r in ROTARY for p in ROPE_AT for s in SCALE_AT)
                if indexer_mod._same(indexer_mod._products(LightningIndexer(hf, *v), inputs), want)]
    assert matching == [variant]


def dense_with_sinks(q, k, v, indices, scale, sinks):
    """What HYV4's eager attention does: the picks scattered into a mask, the sink a last column dropped after
    the softmax."""
    batch, heads, seq, _ = q.shape
    keys_len = k.shape[2]
    keep = torch.zeros(batch, seq, keys_len + 1, dtype=torch.bool)
    keep.scatter_(2, torch.where(indices < 0, keys_len, indices).long(), True)
    groups = heads // k.shape[1]
    scores = q @ k.repeat_interleave(groups, 1).transpose(-1, -2) * scale
    scores = scores.masked_fill(~keep[:, None, :, :keys_len], float("-inf"))
    sink = sinks.view(1, heads, 1, 1).expand(batch, heads, seq, 1).to(scores.dtype)
    probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    return probs @ v.repeat_interleave(groups, 1)


def _picks(batch, seq, keys_len, top_k, gen):
    idx = torch.stack([torch.randperm(keys_len, generator=gen)[:top_k] for _ in range(batch * seq)])
    idx = idx.view(batch, seq, top_k).masked_fill(idx.view(batch, seq, top_k) > torch.arange(seq)[:, None], -1)
    idx[0, 0] = -1  # a query that sees no key: only the sink, so zeros
    return idx.to(torch.int32)


@pytest.mark.parametrize("plan", ["MaskedKeys", "PickedKeys"])
def test_sparse_attention_with_sinks_matches_dense_and_gradchecks(plan, monkeypatch):
    monkeypatch.setattr(chunks_mod, "DENSE_RATIO", 10**6 if plan == "MaskedKeys" else 0)
    monkeypatch.setattr(chunks_mod, "CHUNK_BYTES", 1)  # one query per chunk
    gen = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, seq, dk, dv, top_k = 1, 4, 2, 6, 4, 3, 3
    q = torch.randn(batch, heads, seq, dk, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, seq, dk, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, seq, dv, generator=gen, dtype=torch.float64)
    sinks = torch.randn(heads, generator=gen, dtype=torch.float64)
    indices = _picks(batch, seq, seq, top_k, gen)
    out = sparse_attention(q, k, v, indices, 0.4, sinks)
    want = dense_with_sinks(q, k, v, indices, 0.4, sinks)
    assert rel(out, want) < 1e-12 and out[0, :, 0].abs().max() == 0
    assert rel(out, sparse_attention(q, k, v, indices, 0.4)) > 1e-2  # the sinks take mass
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    assert torch.autograd.gradcheck(lambda a, b, c, s: sparse_attention(a, b, c, indices, 0.4, s), leaves)
    with pytest.raises(ValueError, match="sinks"):
        sparse_attention(q, k, v, indices, 0.4, sinks[:2])


def _attention_module():
    cfg = HYV4Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, learnable_sink_init=0.0)
    module = HYV4Attention(cfg, 0)
    with torch.no_grad():
        module.sinks.normal_(0, 1.0, generator=torch.Generator().manual_seed(2))
    return module


def test_dense_fallback_with_sinks_is_hyv4_eager():
    """Without picks but with sinks (sdpa has no sink term) every visible key is attended, as eager does."""
    module = _attention_module()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 7, 5, generator=gen) for _ in range(3))
    causal = torch.ones(7, 7, dtype=torch.bool).tril().expand(2, 1, 7, 7).clone()
    causal[1, :, :, 5:] = False
    additive = torch.zeros(causal.shape).masked_fill(~causal, torch.finfo(torch.float32).min)
    swap = swap_sparse_attention(module)
    got, _ = dsa_attention(module, q, k, v, causal, scaling=0.5, s_aux=module.sinks)
    want, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.5)
    assert dict(swap.calls) == {"dense": 1}
    assert rel(got, want) < 1e-6


COMMON = {"vocab_size": 96, "pad_token_id": 0, "hidden_size": 64, "intermediate_size": 96,
          "moe_intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
          "n_routed_experts": 4, "num_experts_per_tok": 2, "kv_lora_rank": 32, "q_lora_rank": 48,
          "qk_rope_head_dim": 8, "head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 12, "index_topk": 8,
          "index_n_heads": 2, "index_head_dim": 16,
          # layers 1 and 3 reuse the picks of layers 0 and 2
          "indexer_types": ["full", "shared", "full", "shared"],
          "mlp_layer_types": ["dense", "sparse", "sparse", "dense"]}


def tiny_model():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(HYV4Config(**COMMON, attn_implementation="eager"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)  # large enough that picking other keys moves the output
            elif name.endswith("sinks"):
                p.normal_(0, 1.0)  # sinks that matter (HF starts them at 0)
    return model


def test_swapped_hyv4_model_matches_eager():
    reference = tiny_model()
    adapted = copy.deepcopy(reference)
    before = dict(adapted.named_parameters())
    swaps = swap_all_sparse(adapted)
    assert [s.path for s in swaps] == [f"model.layers.{i}.self_attn" for i in range(4)]
    assert [s.path for s in swaps if s.parts.get("indexer") == "runtime"] == ["model.layers.0.self_attn",
                                                                               "model.layers.2.self_attn"]
    after = dict(adapted.named_parameters())
    assert list(after) == list(before) and all(after[n] is p for n, p in before.items())
    assert reference.config._attn_implementation == adapted.config._attn_implementation == "eager"
    worst = compare(reference, adapted, batch())
    assert (swaps.calls("indexer"), swaps.calls("sparse"), swaps.calls("dense")) == (2, 4, 0)
    assert max(worst.values()) < 1e-4, worst


def test_dropping_the_sinks_fails_the_comparison(monkeypatch):
    """The sinks are what the DeepSeek-V3.2 path lacked: attention without them is measurably wrong."""
    reference = tiny_model()
    adapted = copy.deepcopy(reference)
    swap_all_sparse(adapted)
    plain = dsa.sparse_attention
    monkeypatch.setattr(dsa, "sparse_attention", lambda q, k, v, indices, scale, sinks=None: plain(q, k, v, indices,
                                                                                                 scale))
    inputs = batch()
    real = inputs["attention_mask"].bool()
    with torch.no_grad():
        assert rel(adapted(**inputs).logits[real], reference(**inputs).logits[real]) > 1e-3


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, twin_adapter):
    """hy_v4's tiny twin adapted as `onboard adapt` does it: spec, rendered adapter, loaded from a directory."""
    return twin_adapter(tmp_path_factory.mktemp("hy_v4"), family="hy_v4")


def _verify(bundle):
    from onboard.adapt.verify import verify

    spec, twin, decision, adapt = bundle
    return verify(spec, twin, adapt, decision.taken(), seeds=(0,))


def test_hyv4_bundle_swaps_its_dsa_layers_and_verifies(bundle):
    spec, twin, decision, _ = bundle
    dsa_layers = [layer.index for layer in spec.layers if layer.attention.kind == "sparse:dsa"]
    assert not decision.kept_attention()
    assert [(e.takes, e.layers) for e in decision.swapped_attention()] == [("sparse", dsa_layers)]
    assert "shared" in twin.model.config.indexer_types  # the twin keeps a layer that reuses another's picks
    result = _verify(bundle)
    assert result.passed, result.note or [r.grad_failures for r in result.seeds]
    assert result.replaced == result.expected >= 1
    for r in result.seeds:
        assert r.runtime_attention_calls == len(twin.model.config.indexer_types)
        assert r.runtime_loss_calls == 1 and r.original_calls == 0


@pytest.mark.parametrize("bug", ["sinks dropped", "rotary on the leading dims"])
def test_planted_hyv4_bugs_fail_verification(bundle, bug, monkeypatch):
    if bug == "sinks dropped":
        plain = dsa.sparse_attention
        monkeypatch.setattr(dsa, "sparse_attention",
                            lambda q, k, v, indices, scale, sinks=None: plain(q, k, v, indices, scale))
    else:  # skip the probe and take the DeepSeek-V3.2 layout's rope dims
        monkeypatch.setattr(LightningIndexer, "adopt", classmethod(lambda cls, hf: cls(hf, "half", "leading",
                                                                                         "weights")))
    result = _verify(bundle)
    assert not result.passed
    assert result.seeds and result.seeds[0].logits_max_rel > 1e-4
