"""DSA in the runtime: chunked lightning-indexer top-k, sparse attention over the picked keys (reference and the
rendered Triton kernel under TRITON_INTERPRET=1), and HuggingFace DeepSeek-V3.2 / GLM-MoE-DSA models swapped onto
them, forward and backward against HuggingFace's own code."""

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV32Config, GlmMoeDsaConfig
from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer

from runtime.attention import dsa
from runtime.attention.dsa import swap_sparse_attention
from runtime.attention.indexer import LightningIndexer
import runtime.attention.indexer as indexer_mod
from runtime.attention.sparse import sparse_attention
import runtime.attention.sparse_chunks as chunks_mod
from tests.helpers import rel, run_kernel_check, stored_kernel, swap_all_sparse

HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def one_thread():
    """Shapes here are tiny: a second thread only adds contention on the shared CI cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def dense_reference(q, k, v, indices, scale):
    """Plain masked softmax attention over all keys, the picks scattered into a mask (what HF eager does)."""
    batch, heads, seq, _ = q.shape
    keys_len = k.shape[2]
    keep = torch.zeros(batch, seq, keys_len + 1, dtype=torch.bool)
    keep.scatter_(2, torch.where(indices < 0, keys_len, indices).long(), True)
    keep = keep[..., :keys_len]
    groups = heads // k.shape[1]
    scores = q @ k.repeat_interleave(groups, 1).transpose(-1, -2) * scale
    probs = torch.softmax(scores.masked_fill(~keep[:, None], float("-inf")), -1).nan_to_num(0.0)
    return probs @ v.repeat_interleave(groups, 1)


def random_picks(batch, seq, keys_len, top_k, gen):
    idx = torch.stack([torch.randperm(keys_len, generator=gen)[:top_k] for _ in range(batch * seq)])
    idx = idx.view(batch, seq, top_k)
    idx = idx.masked_fill(idx > torch.arange(seq)[:, None] + keys_len - seq, -1)
    idx[0, 0] = -1  # a query that sees no key at all
    return idx.to(torch.int32)


PLANS = {"picked keys": 0, "masked GEMM": 10**6}  # DENSE_RATIO that selects each way of walking the chunks


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("heads,kv_heads,dk,dv,top_k", [(3, 3, 12, 7, 6), (4, 2, 8, 8, 9), (4, 1, 6, 10, 3)])
def test_sparse_attention_matches_masked_dense_attention(heads, kv_heads, dk, dv, top_k, plan, monkeypatch):
    """MLA-style per-head keys with Dk != Dv, GQA and MQA; -1 picks; one query per chunk, both chunk walkers."""
    gen = torch.Generator().manual_seed(0)
    batch, seq, keys_len = 2, 9, 12
    q = torch.randn(batch, heads, seq, dk, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(batch, kv_heads, keys_len, dk, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(batch, kv_heads, keys_len, dv, generator=gen, dtype=torch.float64, requires_grad=True)
    idx = random_picks(batch, seq, keys_len, top_k, gen)
    monkeypatch.setattr(chunks_mod, "CHUNK_BYTES", 1)
    monkeypatch.setattr(chunks_mod, "DENSE_RATIO", PLANS[plan])
    out = sparse_attention(q, k, v, idx, 0.4)
    ref = dense_reference(q, k, v, idx, 0.4)
    assert out.shape == (batch, heads, seq, dv)
    assert rel(out, ref) < 1e-12
    assert out[0, :, 0].abs().max() == 0
    grad = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(got, want):
        assert rel(a, b) < 1e-12


@pytest.mark.parametrize("plan", PLANS)
def test_sparse_attention_gradcheck_and_fp32(plan, monkeypatch):
    monkeypatch.setattr(chunks_mod, "DENSE_RATIO", PLANS[plan])
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 7, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 7, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    idx = random_picks(1, 5, 7, 3, gen)
    assert torch.autograd.gradcheck(lambda *x: sparse_attention(*x, idx, 0.5), (q, k, v))
    # fp32 in, fp32 out, softmax accumulated in fp32
    q32, k32, v32 = (t.detach().float() for t in (q, k, v))
    out = sparse_attention(q32, k32, v32, idx, 0.5)
    assert out.dtype == torch.float32 and rel(out, dense_reference(q32, k32, v32, idx, 0.5)) < 1e-6


def test_sparse_attention_rejects_mismatched_shapes():
    q, k, v = torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="heads"):
        sparse_attention(q, k, v, torch.zeros(1, 4, 2, dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="indices"):
        sparse_attention(q[:, :2], k, v, torch.zeros(1, 5, 2, dtype=torch.int32), 1.0)


def hf_indexer(cls, config_cls, **overrides):
    cfg = config_cls(hidden_size=32, q_lora_rank=24, qk_rope_head_dim=8, index_n_heads=3, index_head_dim=16,
                     index_topk=6, **overrides)
    torch.manual_seed(0)
    hf = cls(cfg, 0)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    return hf


@pytest.mark.parametrize("cls,config_cls,rotary", [(DeepseekV32Indexer, DeepseekV32Config, "half"),
                                                   (GlmMoeDsaIndexer, GlmMoeDsaConfig, "interleaved")])
def test_chunked_indexer_picks_what_hf_picks(cls, config_cls, rotary, monkeypatch):
    hf = hf_indexer(cls, config_cls)
    ours = LightningIndexer.adopt(hf)
    assert ours.rotary == rotary
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in hf.named_parameters()]
    assert all(a is b for a, b in zip(ours.parameters(), hf.parameters()))  # adopted, not copied
    batch, seq = 2, 30
    gen = torch.Generator().manual_seed(0)
    hidden, q_resid = torch.randn(batch, seq, 32, generator=gen), torch.randn(batch, seq, 24, generator=gen)
    angles = torch.arange(seq)[None, :, None] * torch.tensor([1.0, 0.3, 0.1, 0.03]).repeat(2)
    rope = (angles.cos().expand(batch, -1, -1), angles.sin().expand(batch, -1, -1))
    causal = torch.ones(seq, seq, dtype=torch.bool).tril().expand(batch, seq, seq).clone()
    causal[1, :, 25:] = False  # right padding
    additive = torch.zeros(batch, seq, seq).masked_fill(~causal, torch.finfo(torch.float32).min)
    monkeypatch.setattr(indexer_mod, "CHUNK_BYTES", 1)  # one query per chunk
    for mask in (causal, additive):
        want = hf(hidden, q_resid, rope, mask, None)
        got = ours(hidden, q_resid, rope, mask, None)
        assert got.dtype == torch.int32 and got.shape == (batch, seq, 6)
        assert torch.equal(got, want)  # the same picks in the same order, ties included


def test_adopt_refuses_an_indexer_it_does_not_reproduce():
    class NoRotary(DeepseekV32Indexer):
        """Same projections, but the queries and keys skip the rotary embedding."""

        def forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids, cache=None):
            b, s, _ = hidden_states.shape
            q = self.wq_b(q_resid).view(b, s, self.n_heads, self.head_dim)
            k = self.k_norm(self.wk(hidden_states))
            scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1))
            return scores.sum(2).topk(min(self.index_topk, s), dim=-1).indices.int()

    with pytest.raises(ValueError, match="rotary"):
        LightningIndexer.adopt(hf_indexer(NoRotary, DeepseekV32Config))


COMMON = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
          "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4,
          "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "kv_lora_rank": 32, "q_lora_rank": 48,
          "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 12, "index_topk": 8, "index_n_heads": 2,
          "index_head_dim": 16, "first_k_dense_replace": 1}
FAMILIES = {
    "deepseek_v32": (DeepseekV32Config, {}),
    # the middle layer has no indexer of its own: it reuses layer 0's picks
    "glm_moe_dsa": (GlmMoeDsaConfig, {"indexer_types": ["full", "shared", "full"],
                                      "mlp_layer_types": ["dense", "sparse", "sparse"]}),
}


def tiny_model(family: str, implementation: str = "eager"):
    config_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_cls(**COMMON, **extra, attn_implementation=implementation))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)  # large enough that picking other keys moves the output
    return model


def batch(left_padding: bool = False):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (2, 32), generator=gen)
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[1, :5] = 0 if left_padding else 1
    mask[1, -5:] = 1 if left_padding else 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def compare(reference, adapted, inputs) -> dict[str, float]:
    """Worst relative differences of logits (real tokens), loss and parameter gradients."""
    ref = reference(**inputs)
    ref.loss.backward()
    out = adapted(**inputs)
    out.loss.backward()
    real = inputs["attention_mask"].bool()
    grads = 0.0
    for (name, a), (_, b) in zip(adapted.named_parameters(), reference.named_parameters()):
        assert (a.grad is None) == (b.grad is None), name  # the indexer gets no gradient in either
        if b.grad is not None:
            grads = max(grads, rel(a.grad, b.grad))
    return {"logits": rel(out.logits[real], ref.logits[real]), "loss": rel(out.loss, ref.loss), "grads": grads}


@pytest.mark.parametrize("family", FAMILIES)
def test_swapped_hf_model_matches_eager(family):
    reference = tiny_model(family)
    adapted = copy.deepcopy(reference)
    before = dict(adapted.named_parameters())
    swaps = swap_all_sparse(adapted)
    assert [s.path for s in swaps] == [f"model.layers.{i}.self_attn" for i in range(3)]
    indexers = [s for s in swaps if s.parts.get("indexer") == "runtime"]
    shared = family == "glm_moe_dsa"
    assert len(indexers) == (2 if shared else 3) and all(s.parts.get("indexer", "runtime") == "runtime" for s in swaps)
    after = dict(adapted.named_parameters())
    assert list(after) == list(before) and all(after[n] is p for n, p in before.items())
    # only the swapped modules changed implementation: the model's own config did not
    assert reference.config._attn_implementation == adapted.config._attn_implementation == "eager"
    worst = compare(reference, adapted, batch())
    assert (swaps.calls("indexer"), swaps.calls("sparse"), swaps.calls("dense")) == (len(indexers), 3, 0)
    assert max(worst.values()) < 1e-5, worst


@pytest.mark.slow  # building the remote-code model takes most of it
def test_swapped_flagship_dsa_layer_matches_eager():
    """The remote-code flagship: its DSA layer runs on the runtime, its KDA layers (left alone) keep their config."""
    from transformers import AutoConfig

    from tests.onboard.test_flagship_model import MODEL_DIR, build_tiny

    reference = build_tiny(AutoConfig.from_pretrained(MODEL_DIR, trust_remote_code=True), "eager")
    with torch.no_grad():
        for p in reference.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    adapted = copy.deepcopy(reference)
    swaps = swap_all_sparse(adapted)
    assert [s.path for s in swaps] == ["model.layers.3.self_attn"]
    worst = compare(reference, adapted, batch())
    assert (swaps.calls("indexer"), swaps.calls("sparse"), swaps.calls("dense")) == (1, 1, 0)
    assert max(worst.values()) < 1e-5, worst


def test_left_padding_matches_hf_sdpa():
    """A left-padding query sees no key: sdpa (HF's default) and the runtime give it zeros; eager (finfo.min
    mask) averages every value instead, so this case is compared with sdpa."""
    reference = tiny_model("deepseek_v32", "sdpa")
    adapted = copy.deepcopy(reference)
    swap_all_sparse(adapted)
    inputs = batch(left_padding=True)
    assert rel(adapted(**inputs).logits, reference(**inputs).logits) < 1e-5
    assert max(compare(reference, adapted, inputs).values()) < 1e-5


_visible_picks = dsa.visible_picks


def _no_causal_mask(indices, mask, keys_len):
    return indices.to(torch.int32)


def _no_topk_mask(indices, mask, keys_len):
    every_key = torch.arange(keys_len, dtype=torch.int32).expand(*indices.shape[:2], keys_len)
    return _visible_picks(every_key, mask, keys_len)


@pytest.mark.parametrize("bug", [_no_causal_mask, _no_topk_mask])
def test_planted_masking_bugs_fail_the_comparison(bug, monkeypatch):
    reference = tiny_model("deepseek_v32")
    adapted = copy.deepcopy(reference)
    swap_all_sparse(adapted)
    monkeypatch.setattr(dsa, "visible_picks", bug)
    assert compare(reference, adapted, batch())["logits"] > 1e-3


def test_dense_fallback_without_indices_is_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups, module.training = True, 2, False
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 6, 8, generator=gen), torch.randn(1, 2, 6, 8, generator=gen), torch.randn(1, 2, 6, 8)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    out, _ = dsa.dsa_attention(module, q, k, v, mask, scaling=0.3)
    assert torch.equal(out, sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)[0])


def test_visible_picks_reads_bool_additive_and_missing_masks():
    idx = torch.tensor([[[0, 1], [2, 0], [1, 2]]], dtype=torch.int32)
    causal = torch.ones(3, 3, dtype=torch.bool).tril()[None, None]
    want = torch.tensor([[[0, -1], [-1, 0], [1, 2]]], dtype=torch.int32)
    assert torch.equal(dsa.visible_picks(idx, causal, 3), want)
    additive = torch.zeros(1, 1, 3, 3).masked_fill(~causal, float("-inf"))
    assert torch.equal(dsa.visible_picks(idx, additive, 3), want)
    assert torch.equal(dsa.visible_picks(idx, None, 3), want)
    with pytest.raises(ValueError, match="bias"):
        dsa.visible_picks(idx, additive + 0.5, 3)


def test_swap_refuses_a_module_without_an_indexer():
    with pytest.raises(ValueError, match="not a DSA attention module"):
        swap_sparse_attention(torch.nn.Linear(2, 2), path="0")


def test_undo_gives_the_module_back_and_other_models_never_run_the_runtime():
    """Two models built from one config object: swapping one leaves the other HuggingFace code; undoing the swap
    restores the module's config, its indexer and its outputs exactly."""
    from transformers import DeepseekV32ForCausalLM

    reference = tiny_model("deepseek_v32")
    other = DeepseekV32ForCausalLM(reference.config)  # the same config object
    other.load_state_dict(reference.state_dict())
    inputs = batch()
    with torch.no_grad():
        want = other(**inputs).logits
    attention = reference.get_submodule("model.layers.0.self_attn")
    config, indexer = attention.config, attention.indexer
    swaps = swap_all_sparse(reference)
    assert attention.config is not config and attention.indexer is not indexer
    assert other.model.layers[0].self_attn.config is config
    with torch.no_grad():
        assert torch.equal(other(**inputs).logits, want)  # still HuggingFace code, bit for bit
        reference(**inputs)
    assert swaps.calls("sparse") == 3
    swaps.undo()
    assert attention.config is config and attention.indexer is indexer
    with torch.no_grad():
        assert torch.equal(reference(**inputs).logits, want)
    assert swaps.calls("sparse") == 3  # undone: nothing counted since


@pytest.mark.interpreter
def test_rendered_triton_kernel_matches_reference_under_interpreter():
    pytest.importorskip("triton")
    from onboard.adapt.codegen import render_kernel

    params = dict(name="tiny", qk_head_dim=24, v_head_dim=12, top_k=8, dtype="fp32")
    source = render_kernel("kernels/sparse_attention_triton.py.j2", **params).text
    assert "TOP_K = 8" in source and 'input_precision="ieee"' in source
    result = run_kernel_check("check_sparse_attention_triton.py",
                              stored_kernel("kernels/sparse_attention_triton.py.j2", **params))
    assert result.returncode == 0, result.stdout + result.stderr
    for line in ("loaded and registered", "dv H=4 Hkv=1", "dsinks H=4 Hkv=1 Dk=8 Dv=20 K=5 sinks: ok",
                 "dispatch: sinks to the triton kernel", "HF DeepSeek-V3.2 logits, triton kernel: ok",
                 "HF HunYuan-V4 logits, triton kernel: ok", "grad model.layers.1.self_attn.sinks: ok"):
        assert line in result.stdout
