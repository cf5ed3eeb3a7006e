"""How tensor parallelism reads a module's projections (runtime.parallel.tensor.find_splits), in one process:
the split it finds on HuggingFace's own attention and MLP modules, and the refusals, each planted on a module
that is otherwise splittable. The multi-process runs that train with the splits are in test_parallel.py."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from runtime.parallel.tensor import Heads, declare, find_splits, problems

HIDDEN, HEADS, KV, DIM, FFN, VOCAB = 16, 4, 2, 4, 24, 32


class Attention(nn.Module):
    """Grouped-query attention with a per-head query norm; `plant` breaks one thing tensor parallelism needs."""

    def __init__(self, plant: str | None = None):
        super().__init__()
        self.plant = plant
        self.q_proj = nn.Linear(HIDDEN, HEADS * DIM)
        self.k_proj = nn.Linear(HIDDEN, KV * DIM)
        self.v_proj = nn.Linear(HIDDEN, KV * DIM)
        self.o_proj = nn.Linear(HEADS * DIM, HIDDEN)
        self.q_norm = nn.RMSNorm(HEADS * DIM if plant == "norm over all heads" else DIM)
        if plant == "sinks":
            self.sinks = nn.Parameter(torch.zeros(HEADS))
        if plant in ("low rank", "latent reaches the heads"):
            self.q_a = nn.Linear(HIDDEN, 8)
            self.q_proj = nn.Linear(8, HEADS * DIM)

    def forward(self, hidden_states):
        b, s, _ = hidden_states.shape
        latent = self.q_a(hidden_states) if hasattr(self, "q_a") else None
        x = hidden_states if latent is None else latent
        if self.plant == "norm over all heads":
            q = self.q_norm(self.q_proj(x)).view(b, s, -1, DIM)
        else:
            q = self.q_norm(self.q_proj(x).view(b, s, -1, DIM))
        k = self.k_proj(hidden_states).view(b, s, -1, DIM)
        if self.plant == "latent reaches the heads":  # one latent feature added to every key, as MLA's k_pe is
            k = k + latent[..., :1, None]
        v = self.v_proj(hidden_states).view(b, s, -1, DIM)
        k, v = (t.repeat_interleave(q.shape[2] // t.shape[2], dim=2) for t in (k, v))
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        if self.plant == "sinks":
            out = out + self.sinks.view(1, -1, 1, 1)
        out = out.transpose(1, 2).reshape(b, s, -1)
        if self.plant == "heads mixed":  # the heads' outputs reversed across heads before the output projection
            out = out.flip(-1)
        return self.o_proj(out), None


class MLP(nn.Module):
    def __init__(self, fused: bool = False):
        super().__init__()
        self.fused = fused
        self.gate_up = nn.Linear(HIDDEN, 2 * FFN) if fused else None
        self.gate, self.up = (None, None) if fused else (nn.Linear(HIDDEN, FFN), nn.Linear(HIDDEN, FFN))
        self.down = nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, -1) if self.fused else (self.gate(x), self.up(x))
        return self.down(F.silu(gate) * up)


class TinyLM(nn.Module):
    def __init__(self, attention: Attention, mlp: MLP):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=VOCAB)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.attn, self.mlp = attention, mlp
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, labels=None, use_cache=False):
        h = self.embed(input_ids)
        h = h + self.attn(hidden_states=h)[0]
        return self.head(h + self.mlp(h))


def splits_of(model: nn.Module, tp: int | None = None):
    declare(model, attention={"attn": Heads(HEADS, KV)}, mlps=["mlp"])
    return {s.path: s for s in find_splits(model, tp=tp)}


def test_projections_split_by_what_they_read_and_write():
    found = splits_of(TinyLM(Attention(), MLP()))
    attn, mlp = found["attn"], found["mlp"]
    assert sorted(attn.colwise) == ["k_proj", "q_proj", "v_proj"] and attn.rowwise == "o_proj"
    assert attn.per_head == (("q_norm", 2),)  # (batch, tokens, heads, head dim): the heads are dimension 2
    assert sorted(mlp.colwise) == ["gate", "up"] and mlp.rowwise == "down" and mlp.heads is None
    assert problems(list(found.values()), 2) == []
    assert problems(list(found.values()), 4) == ["attn: 4 query and 2 key/value heads do not divide by tp=4"]


@pytest.mark.parametrize("plant", ["low rank", "latent reaches the heads"])
def test_a_latent_stays_whole_and_the_heads_it_feeds_split(plant):
    """A projection whose output feeds another (a low-rank latent, MLA's q_a) stays whole on every rank, also when
    the latent reaches the heads directly (MLA's shared rotary key); the projection it feeds splits, and the tp
    ranks' partial outputs, computed in one process, sum to the module's."""
    attn = splits_of(TinyLM(Attention(plant), MLP()), tp=2)["attn"]
    assert sorted(attn.colwise) == ["k_proj", "q_proj", "v_proj"] and attn.rowwise == "o_proj"
    assert attn.whole == ("q_a", "q_norm") and attn.per_head == ()  # partial-gradient form: per-head norms whole


def test_heads_mixed_after_attention_are_refused_by_the_probe():
    """Nothing in the projections tells that the heads' outputs are mixed before the output projection; the
    ranks' partial outputs on the probe do."""
    assert splits_of(TinyLM(Attention("heads mixed"), MLP()))["attn"].rowwise == "o_proj"  # the rules alone pass it
    with pytest.raises(ValueError, match="attn split over tp=2 does not compute the module's output"):
        splits_of(TinyLM(Attention("heads mixed"), MLP()), tp=2)


@pytest.mark.parametrize(("attention", "mlp", "why"), [
    ("norm over all heads", False, "attn split over tp=2 does not compute the module's output"),
    (None, True, r"mlp's input projections are \[48\] wide and its output projection reads 24"),
])
def test_what_a_split_would_get_wrong_is_refused(attention, mlp, why):
    """Each planted module computes something a contiguous split of its projections would change: refused,
    naming the module, where a split by name would have run and trained wrong numbers. (A norm over all heads
    has a weight each head reads its own part of, as a per-head parameter would; its statistic spans the heads,
    which the probe check sees.)"""
    with pytest.raises(ValueError, match=why):
        splits_of(TinyLM(Attention(attention), MLP(fused=mlp)), tp=2)


def test_per_head_sinks_are_read_at_each_ranks_heads():
    """A parameter of the attention itself with one entry per head (gpt-oss's sinks) belongs to its heads: each rank
    reads its own heads' entries (partial-gradient form), checked on the probe."""
    attn = splits_of(TinyLM(Attention("sinks"), MLP()), tp=2)["attn"]
    assert attn.local == (("sinks", 0, (0, 0, 1, 1)),)  # 4 heads in 2 key/value groups
    assert attn.indices(2, 1) == {"sinks": (0, (2, 3))}


def test_nothing_declared_and_meta_models_are_refused():
    with pytest.raises(ValueError, match="nothing declares which modules split"):
        find_splits(TinyLM(Attention(), MLP()))
    with torch.device("meta"):
        model = TinyLM(Attention(), MLP())
    declare(model, attention={}, mlps=["mlp"])
    with pytest.raises(ValueError, match="meta device"):
        find_splits(model)


def _tiny(model_type: str, **extra):
    config = AutoConfig.for_model(model_type, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64, **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float()


def test_huggingface_modules_split_or_are_refused_by_what_they_compute():
    """transformers' own Qwen3 attention (per-head q / k norms) and MLP split; OLMoE normalises q and k over all
    heads at once, which a head split would change: refused."""
    qwen = _tiny("qwen3")
    declare(qwen, attention={f"model.layers.{i}.self_attn": Heads(4, 2) for i in range(2)},
            mlps=[f"model.layers.{i}.mlp" for i in range(2)])
    found = {s.path: s for s in find_splits(qwen)}
    attn = found["model.layers.0.self_attn"]
    assert sorted(attn.colwise) == ["k_proj", "q_proj", "v_proj"] and attn.rowwise == "o_proj"
    assert sorted(attn.per_head) == [("k_norm", 2), ("q_norm", 2)]
    assert found["model.layers.1.mlp"].rowwise == "down_proj"
    olmoe = _tiny("olmoe", num_experts=4, num_experts_per_tok=2)
    declare(olmoe, attention={"model.layers.0.self_attn": Heads(4, 2)}, mlps=[])
    with pytest.raises(ValueError, match="self_attn split over tp=2 does not compute the module's output"):
        find_splits(olmoe, tp=2)


def test_mla_keeps_its_latents_whole_and_splits_its_heads():
    """transformers' DeepSeek-V3 MLA: q_a / kv_a and their norms whole (kv_a also gives the shared rotary key),
    q_b / kv_b split by head, o_proj by columns; checked on the probe at tp 2."""
    config = AutoConfig.for_model("deepseek_v3", hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=12,
                                  kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6,
                                  first_k_dense_replace=1, vocab_size=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    declare(model, attention={"model.layers.0.self_attn": Heads(4, 4)}, mlps=["model.layers.0.mlp"])
    attn = {s.path: s for s in find_splits(model, tp=2)}["model.layers.0.self_attn"]
    assert sorted(attn.colwise) == ["kv_b_proj", "q_b_proj"] and attn.rowwise == "o_proj"
    assert sorted(attn.whole) == ["kv_a_layernorm", "kv_a_proj_with_mqa", "q_a_layernorm", "q_a_proj"]


class ShortConvHeads(nn.Module):
    """Linear attention's layout, cut down: q | k | v through one depthwise short convolution and split back by a
    width the module holds, a decay rate per head, an output gate through a low-rank latent. `plant`: the
    convolution mixes channels (heads) instead of running per channel."""

    def __init__(self, plant: str | None = None):
        super().__init__()
        self.width = HEADS * DIM
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(HIDDEN, self.width) for _ in range(3))
        channels = 3 * self.width
        self.conv = nn.Conv1d(channels, channels, 3, groups=1 if plant else channels, padding=2, bias=False)
        self.rate = nn.Parameter(torch.rand(HEADS))
        self.g_a, self.g_b = nn.Linear(HIDDEN, 4), nn.Linear(4, self.width)
        self.o_proj = nn.Linear(self.width, HIDDEN)

    def forward(self, hidden_states):
        b, s, _ = hidden_states.shape
        x = torch.cat([self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)], -1)
        x = F.silu(self.conv(x.transpose(1, 2))[..., :s]).transpose(1, 2)
        q, k, v = (t.view(b, s, -1, DIM).transpose(1, 2) for t in torch.split(x, [self.width] * 3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True) * torch.sigmoid(self.rate).view(1, -1, 1, 1)
        out = out.transpose(1, 2).reshape(b, s, -1) * torch.sigmoid(self.g_b(self.g_a(hidden_states)))
        return self.o_proj(out), None


def test_a_short_convolution_and_per_head_rates_are_read_at_each_ranks_heads():
    """KDA's shape: the depthwise convolution's channels (q | k | v: three ranges per rank), the per-head rate and the
    width `torch.split` reads are found from the probe's graph and the probe check; the gate's latent stays whole.
    A convolution that mixes channels across heads cannot be cut that way: refused by the probe."""
    model = TinyLM(ShortConvHeads(), MLP())
    declare(model, attention={"attn": Heads(HEADS, HEADS)}, mlps=[])
    attn = {s.path: s for s in find_splits(model, tp=2)}["attn"]
    assert sorted(attn.colwise) == ["g_b", "k_proj", "q_proj", "v_proj"] and attn.whole == ("g_a", "conv")
    assert sorted((name, dim) for name, dim, _ in attn.local) == [("conv.weight", 0), ("rate", 0)]
    width = HEADS * DIM  # nn.Conv1d reads its groups in forward, the module its split sizes: each rank's own
    assert attn.scaled == (("conv.groups", 3 * width), ("width", width))
    rank1 = attn.indices(2, 1)  # the second half of each of q, k and v
    assert rank1["conv.weight"] == (0, tuple(i for r in range(3) for i in range(r * width + width // 2,
                                                                                (r + 1) * width)))
    assert rank1["rate"] == (0, (2, 3))
    mixed = TinyLM(ShortConvHeads("conv mixes channels"), MLP())
    declare(mixed, attention={"attn": Heads(HEADS, HEADS)}, mlps=[])
    with pytest.raises(ValueError, match="attn split over tp=2 does not compute the module's output"):
        find_splits(mixed, tp=2)


def test_kimi_delta_attention_splits_its_heads_and_keeps_its_gates_latents_whole():
    """transformers' own KDA (Kimi-Linear): q / k / v, beta, the forget gate's and the output gate's up projections
    split by head; their latents whole; the fused short convolution, dt_bias and A_log read at each rank's heads,
    `qkv_dim` (the convolution output's split sizes) each rank's own. Checked on the probe at tp 2."""
    config = AutoConfig.for_model("kimi_linear", hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, linear_num_heads=4,
                                  linear_head_dim=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
                                  v_head_dim=6, layer_types=["linear_attention"], mlp_layer_types=["dense"],
                                  pad_token_id=0, vocab_size=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    declare(model, attention={"model.layers.0.self_attn": Heads(4, 4)}, mlps=["model.layers.0.mlp"])
    attn = {s.path: s for s in find_splits(model, tp=2)}["model.layers.0.self_attn"]
    assert sorted(attn.colwise) == ["b_proj", "forget_gate.f_b_proj", "g_b_proj", "k_proj", "q_proj", "v_proj"]
    assert attn.rowwise == "o_proj" and {"forget_gate.f_a_proj", "g_a_proj", "o_norm"} <= set(attn.whole)
    assert sorted((name, dim) for name, dim, _ in attn.local) == [
        ("conv1d.weight", 0), ("forget_gate.A_log", 2), ("forget_gate.dt_bias", 0)]
    assert attn.scaled == (("qkv_dim", 32),)
