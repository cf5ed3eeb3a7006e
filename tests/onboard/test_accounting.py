"""Full-scale cost formulas: the one FLOP model (runtime.dims) and the spec-based accounting built on it."""

import dataclasses

import pytest

from onboard.inspect.accounting import costs, dims_of, memory_bytes
from onboard.inspect.spec import MLP, Attention, Layer, ModelSpec
from runtime.dims import Dims, Mixer, avg_context, mixers_of
from runtime.plan import Plan
from runtime.runlog import RunLogWriter, model_record, read_runs


def spec_of(*attentions: Attention, hidden: int = 1024) -> ModelSpec:
    """A hand-built dense model, one layer per attention given."""
    layers = [Layer(index=i, attention=a, mlp=MLP(kind="dense", ffn=4 * hidden)) for i, a in enumerate(attentions)]
    return ModelSpec(name="hand-built", model_type="test", vocab_size=1000, hidden_size=hidden,
                     num_layers=len(layers), tie_embeddings=False, layers=layers,
                     params_total=10_000_000, params_active=10_000_000)


def test_average_context():
    assert avg_context(4, None) == pytest.approx(2.5)  # 1+2+3+4 over 4
    assert avg_context(6, 2) == pytest.approx((1 + 2 + 2 + 2 + 2 + 2) / 6)
    assert avg_context(8, 100) == avg_context(8, None)


def test_windowed_and_sparse_attention_cost_less_than_full():
    full = Mixer(kind="softmax", layers=1, heads=8, head_dim=64)
    window = Mixer(kind="sliding", layers=1, heads=8, head_dim=64, window=512)
    dsa = Mixer(kind="sparse:dsa", layers=1, heads=8, head_dim=64, index_topk=512, index_heads=4, index_head_dim=32)
    seq = 32768
    assert window.flops(seq) < dsa.flops(seq) < full.flops(seq)
    assert full.flops(seq) == pytest.approx(2 * 8 * 128 * (seq + 1) / 2)
    assert dataclasses.replace(full, layers=3).flops(seq) == pytest.approx(3 * full.flops(seq))
    linear = Mixer(kind="linear:kda", layers=1, heads=8, head_dim=64)
    assert linear.flops(1024) == linear.flops(1_000_000)  # constant per token
    ssm = Mixer(kind="ssm:mamba", layers=1, heads=8, head_dim=64, state_size=16)
    assert ssm.flops(1024) == 2 * 8 * (2 * 16 * 64 + 64 * (16 + 64))  # a 16 x 64 state per head
    assert Mixer(kind="conv", layers=4, heads=8, head_dim=64).flops(4096) == 0


def test_dsa_cost_grows_with_its_top_k_until_it_selects_every_key():
    seq = 4096

    def dsa(topk):
        return Mixer(kind="sparse:dsa", layers=1, heads=16, head_dim=192, v_head_dim=128, index_topk=topk,
                     index_heads=64, index_head_dim=128).flops(seq)

    assert dsa(256) < dsa(1024) < dsa(2048) < dsa(4096)
    assert dsa(4096) == dsa(8192) == dsa(1_000_000)  # past the sequence every earlier key is selected
    indexer = 2 * 64 * 128 * (seq + 1) / 2
    full = Mixer(kind="mla", layers=1, heads=16, head_dim=192, v_head_dim=128).flops(seq)
    assert dsa(4096) == pytest.approx(full + indexer)


def test_chunked_attention_sees_only_its_chunk():
    chunked = Mixer(kind="chunked", layers=1, heads=8, head_dim=128, window=8192)
    full = Mixer(kind="softmax", layers=1, heads=8, head_dim=128)
    assert chunked.flops(4096) == full.flops(4096)  # the sequence fits in one chunk
    assert chunked.flops(65536) == chunked.flops(131072) < full.flops(65536)


def test_sliding_window_model_costs_less_than_its_full_attention_twin():
    full = spec_of(*[Attention(kind="softmax", num_heads=16, head_dim=64)] * 4)
    sliding = spec_of(*[Attention(kind="sliding", num_heads=16, head_dim=64, window=1024)] * 2,
                      *[Attention(kind="softmax", num_heads=16, head_dim=64)] * 2)
    assert dims_of(sliding).mixing_flops(512) == dims_of(full).mixing_flops(512)  # window longer than the sequence
    for seq in (4096, 32768):
        assert dims_of(sliding).mixing_flops(seq) < dims_of(full).mixing_flops(seq)
        assert costs(sliding, seq).flops_per_token_training < costs(full, seq).flops_per_token_training
        assert costs(sliding, seq).attention_share < costs(full, seq).attention_share


def test_mixers_group_layers_by_kind_and_shape():
    spec = spec_of(Attention(kind="linear:gated_deltanet", num_heads=32, head_dim=128),
                   Attention(kind="linear:gated_deltanet", num_heads=32, head_dim=128),
                   Attention(kind="softmax", num_heads=16, num_kv_heads=2, head_dim=256),
                   Attention(kind="linear:gated_deltanet", num_heads=32, head_dim=128),
                   Attention(kind="sliding", num_heads=16, head_dim=256, window=4096))
    mixers = mixers_of(dataclasses.asdict(layer.attention) for layer in spec.layers)
    assert [(m.kind, m.layers, m.heads, m.window) for m in mixers] == [
        ("linear:gated_deltanet", 3, 32, None), ("softmax", 1, 16, None), ("sliding", 1, 16, 4096)]
    d = dims_of(spec)
    assert d.mixers == mixers and (d.linear_layers, d.sparse_layers) == (3, 0)


def test_run_log_carries_the_mixers_and_prices_a_hybrid_like_the_accounting(tmp_path):
    """A Qwen3-Next-like hybrid with a DSA and a Mamba layer: the model written to a run log and read back
    gives the predictors the token-mixing FLOPs the spec-based accounting computes, layer by layer."""
    spec = spec_of(*[Attention(kind="linear:gated_deltanet", num_heads=32, head_dim=128)] * 3,
                   Attention(kind="softmax", num_heads=16, num_kv_heads=2, head_dim=256, v_head_dim=256),
                   Attention(kind="sparse:dsa", num_heads=16, head_dim=192, v_head_dim=128, index_topk=2048,
                             index_heads=64, index_head_dim=128),
                   Attention(kind="ssm:mamba2", num_heads=64, head_dim=64, state_size=128),
                   Attention(kind="sliding", num_heads=16, head_dim=128, window=4096))
    path = tmp_path / "run.jsonl"
    with RunLogWriter(path, model=model_record(spec.to_dict()), plan=Plan().to_dict(),
                      hardware={"name": "cpu", "devices": 1}, precision="fp32", run_id="r") as log:
        log.step(0, step_time_s=1.0, tokens_per_s=10.0)
    (run,), _ = read_runs(path)
    assert [(m["kind"], m["layers"]) for m in run.model["mixers"]] == [
        ("linear:gated_deltanet", 3), ("softmax", 1), ("sparse:dsa", 1), ("ssm:mamba2", 1), ("sliding", 1)]
    assert (run.model["linear_attention_layers"], run.model["sparse_attention_layers"]) == (4, 1)
    logged = Dims.from_record(run.model)
    for seq in (1024, 8192, 65536):
        per_layer = sum(Mixer(kind=a.kind, layers=1, heads=a.num_heads, head_dim=a.head_dim, v_head_dim=a.v_head_dim,
                              window=a.window, index_topk=a.index_topk, index_heads=a.index_heads,
                              index_head_dim=a.index_head_dim, state_size=a.state_size).flops(seq)
                        for a in (layer.attention for layer in spec.layers))
        assert logged.mixing_flops(seq) == pytest.approx(per_layer, rel=1e-12)
        assert logged.training_flops_per_token(seq) == costs(spec, seq).flops_per_token_training
    # the counts alone (what an older reader sees) would price every layer as the first softmax layer
    counts_only = Dims.from_record({k: v for k, v in run.model.items() if k != "mixers"})
    assert counts_only.mixing_flops(65536) != logged.mixing_flops(65536)


def test_record_without_mixers_is_priced_from_its_counts():
    """Older run logs and the published runs carry counts only: every layer at the first attention's shape."""
    record = model_record(spec_of(*[Attention(kind="softmax", num_heads=8, head_dim=64)] * 3,
                                  Attention(kind="linear:kda", num_heads=8, head_dim=64)).to_dict())
    with_mixers = Dims.from_record(record)
    counts_only = Dims.from_record({k: v for k, v in record.items() if k != "mixers"})
    assert (counts_only.linear_layers, counts_only.sparse_layers) == (1, 0)
    for seq in (1, 4096, 100_000):
        assert counts_only.mixing_flops(seq) == with_mixers.mixing_flops(seq)
    with pytest.raises(ValueError, match="layers must be positive"):
        Dims.from_record({**record, "mixers": [{"kind": "softmax", "layers": 0}]})
    with pytest.raises(ValueError, match="no kind"):
        Dims.from_record({**record, "mixers": [{"layers": 2}]})


def test_training_flops_are_about_six_per_active_parameter(inspected):
    spec, _ = inspected("qwen3-8b")
    c = costs(spec, seq_len=1)
    assert c.flops_per_token_training == pytest.approx(6 * spec.params_active, rel=1e-3)
    assert costs(spec, 8192).attention_share > costs(spec, 1024).attention_share
    assert c.flops_per_token_training == dims_of(spec).training_flops_per_token(1)


def test_memory_by_dtype():
    m = memory_bytes(1000)
    assert (m["weights"], m["gradients"], m["master_weights"], m["optimizer"]) == (2000, 4000, 4000, 8000)
    assert m["total"] == 18000
    assert memory_bytes(1000, weights="fp32", master=None)["total"] == 4000 + 4000 + 8000
