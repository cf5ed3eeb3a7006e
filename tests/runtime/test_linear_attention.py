"""Chunked gated delta rule, causal conv and the swap into HuggingFace linear-attention modules.

The chunked core is checked against the token-by-token recurrence (fp64, so any algebra slip shows), the
swapped modules against transformers' own modeling code on tiny random-weight models, forward and backward.
"""

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from runtime.attention import (
    causal_conv1d,
    chunk_gated_delta_rule,
    find_linear_cores,
    recurrent_gated_delta_rule,
    swap_linear_core,
)
from runtime.attention.decay_pairs import decay_pairs, decay_pairs_backward
from runtime.attention.gated_delta import chunk_core
from runtime.attention.triangular import unit_lower_inverse
from runtime.kernels import registry
from tests.helpers import rel, run_kernel_check, stored_kernel

OP = "linear_attention.chunk_gated_delta"


def _problem(per_channel, *, batch=2, length=37, key_heads=2, heads=4, kd=8, vd=6, decay=0.5, state=True,
             dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, key_heads, kd, generator=gen, dtype=dtype)
    k = torch.randn(batch, length, key_heads, kd, generator=gen, dtype=dtype)
    v = torch.randn(batch, length, heads, vd, generator=gen, dtype=dtype)
    gate = (batch, length, heads, kd) if per_channel else (batch, length, heads)
    g = -F.softplus(torch.randn(gate, generator=gen, dtype=dtype)) * decay
    beta = torch.rand(batch, length, heads, generator=gen, dtype=dtype)
    s0 = torch.randn(batch, heads, kd, vd, generator=gen, dtype=dtype) if state else None
    return q, k, v, g, beta, s0


def _outputs_and_grads(fn, problem, **kw):
    inputs = [x.clone().requires_grad_() for x in problem if x is not None]
    s0 = inputs[5] if len(inputs) == 6 else None
    o, final = fn(*inputs[:5], initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)
    weights = torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)
    loss = (o * weights).sum() + (final * final).sum()
    return [o, final, *torch.autograd.grad(loss, inputs)]


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-head gate", "per-channel gate"])
@pytest.mark.parametrize("case", ["padded", "grouped-values", "no-state", "strong-decay"])
def test_chunked_core_equals_the_recurrence(per_channel, case):
    """Output, final state and the gradient of every input, fp64: the chunk algebra is exact."""
    kw = {"padded": {}, "grouped-values": {"key_heads": 1, "heads": 3}, "no-state": {"state": False, "length": 32},
          "strong-decay": {"decay": 40.0}}[case]
    problem = _problem(per_channel, **kw)
    got = _outputs_and_grads(chunk_gated_delta_rule, problem, chunk_size=8)
    ref = _outputs_and_grads(recurrent_gated_delta_rule, problem)
    for a, b in zip(got, ref):
        assert torch.isfinite(a).all()
        assert rel(a, b) < 1e-10


@pytest.mark.parametrize("per_channel", [False, True])
def test_fp32_and_chunk_size_do_not_change_the_result(per_channel):
    problem = _problem(per_channel, dtype=torch.float32, length=45)
    ref = _outputs_and_grads(recurrent_gated_delta_rule, tuple(x.double() if x is not None else None for x in problem))
    for chunk in (1, 6, 16, 64):
        got = _outputs_and_grads(chunk_gated_delta_rule, problem, chunk_size=chunk)
        assert got[0].dtype == torch.float32
        for a, b in zip(got, ref):
            assert rel(a.double(), b) < 2e-5, chunk


def test_scale_option_and_packed_sequences():
    q, k, v, g, beta, _ = _problem(True, batch=1, length=30)
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, scale=0.3, chunk_size=8)
    ref, _ = recurrent_gated_delta_rule(q, k, v, g, beta, scale=0.3)
    assert rel(o, ref) < 1e-10
    cu = torch.tensor([0, 7, 19, 30])
    packed, finals = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=4, cu_seqlens=cu, output_final_state=True)
    for i in range(3):
        s, e = cu[i], cu[i + 1]
        alone, final = recurrent_gated_delta_rule(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e],
                                                  output_final_state=True)
        assert rel(packed[:, s:e], alone) < 1e-10 and rel(finals[i:i + 1], final) < 1e-10


def test_bad_shapes_are_one_line_errors():
    q, k, v, g, beta, _ = _problem(True)
    with pytest.raises(ValueError, match="channels"):
        chunk_gated_delta_rule(q, k, v, g[..., :3], beta)
    with pytest.raises(ValueError, match="multiple of key heads"):
        chunk_gated_delta_rule(q[:, :, :1].expand(-1, -1, 3, -1), k[:, :, :1].expand(-1, -1, 3, -1), v, g, beta)


@pytest.mark.parametrize("per_channel", [False, True])
def test_decay_pairs_against_the_elementwise_definition(per_channel):
    """X[i, j] = sum_d a_i b_j exp(G_i - G_j) for j <= i, with decays far past fp32's exp range, on a chunk
    that is not a power of two; the backward gives the gradient of the per-token log decay g (G = cumsum g)."""
    gen = torch.Generator().manual_seed(3)
    c = 12
    a = torch.randn(2, 3, c, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, c, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    g = (-torch.rand(3, c, 5 if per_channel else 1, generator=gen, dtype=torch.float64) * 30).requires_grad_()
    G = g.cumsum(1)
    lower = torch.ones(c, c, dtype=torch.bool).tril()
    decay = (G[:, :, None] - G[:, None]).masked_fill(~lower[..., None], float("-inf")).exp()
    ref = (a[:, :, :, None] * b[None, :, None] * decay).sum(-1)
    lhs = list(a.detach())
    fp32 = decay_pairs([x.float() for x in lhs], b.detach().float(), G.detach().float())
    assert rel(torch.stack(fp32).double(), ref) < 1e-5
    assert rel(torch.stack(decay_pairs(lhs, b.detach(), G.detach())), ref) < 1e-12
    dx = torch.randn(ref.shape, generator=gen, dtype=torch.float64) * lower
    ref.backward(dx)
    das, db, dg = decay_pairs_backward(lhs, b.detach(), G.detach(), list(dx))
    for got, want in zip((torch.stack(das), db, dg), (a.grad, b.grad, g.grad)):
        assert rel(got, want) < 1e-12


@pytest.mark.parametrize("size", [1, 5, 16, 64])
def test_unit_lower_inverse(size):
    a = torch.randn(3, size, size, dtype=torch.float64) * 0.3
    expected = torch.linalg.inv(torch.eye(size, dtype=torch.float64) + a.tril(-1))
    assert rel(unit_lower_inverse(a), expected) < 1e-12


@pytest.mark.parametrize("activation", [None, "silu"])
def test_conv_matches_transformers(activation):
    from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_fn

    x = torch.randn(2, 6, 11, requires_grad=True)
    w, bias = torch.randn(6, 4, requires_grad=True), torch.randn(6, requires_grad=True)
    ours = causal_conv1d(x, w, bias, activation)
    theirs = causal_conv1d_fn(x, w, bias, activation)
    assert torch.allclose(ours, theirs, atol=1e-6)
    grads = torch.autograd.grad(ours.sum(), (x, w, bias))
    for a, b in zip(grads, torch.autograd.grad(theirs.sum(), (x, w, bias))):
        assert torch.allclose(a, b, atol=1e-5)


def test_conv_keeps_packed_sequences_apart():
    x, w = torch.randn(1, 3, 12), torch.randn(3, 4)
    cu = torch.tensor([0, 5, 12])
    packed = causal_conv1d(x, w, activation="silu", cu_seq_lens_q=cu)
    alone = torch.cat([causal_conv1d(x[..., :5], w, activation="silu"),
                       causal_conv1d(x[..., 5:], w, activation="silu")], -1)
    assert torch.allclose(packed, alone, atol=1e-6)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, w, activation="tanhshrink")


@pytest.mark.interpreter
@pytest.mark.parametrize("gate", ["head", "channel"])
def test_rendered_triton_kernels_match_the_reference(gate):
    """templates/kernels/gated_delta_triton.py.j2 rendered small, run by Triton's CPU interpreter in its own
    process (Triton reads TRITON_INTERPRET at import), forward and the backward from what it saved."""
    pytest.importorskip("triton")
    key = stored_kernel("kernels/gated_delta_triton.py.j2", name="tiny", head_k=32, head_v=32, chunk=32, block=16,
                        block_v=16, block_k=16, gate=gate, dtype="fp32")
    result = run_kernel_check("check_gated_delta_triton.py", key, threads=2)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "dg: ok" in result.stdout and "registered under the triton backend: ok" in result.stdout


# --- swapping into transformers' modules -----------------------------------------------------------------

_MOE = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "layer_types": ["linear_attention", "full_attention"],
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16, "intermediate_size": 32, "linear_conv_kernel_dim": 4}
_GDN = {"linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4}
CONFIGS = {
    "qwen3_next": {**_MOE, **_GDN},
    "qwen3_5_moe_text": {**_MOE, **_GDN},
    "kimi_linear": {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                    "num_key_value_heads": 2, "layer_types": ["linear_attention", "full_attention"],
                    "mlp_layer_types": ["dense", "sparse"], "num_experts": 4, "num_experts_per_token": 2,
                    "moe_intermediate_size": 16, "intermediate_size": 32, "linear_num_heads": 2,
                    "linear_head_dim": 8, "kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
                    "v_head_dim": 8, "linear_conv_kernel_dim": 4, "pad_token_id": 0, "bos_token_id": 1,
                    "eos_token_id": 2},
}


def _tiny(model_type, **overrides):
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**CONFIGS[model_type], **overrides})
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()


def _run(model, ids):
    model.zero_grad()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _errors(got, ref):
    """(logits error, worst gradient error on the model's gradient scale, worst gradient error per tensor,
    against that tensor's largest value plus 1e-3 of the model's: a tensor with almost no gradient is not
    judged on its own rounding)."""
    scale = max(float(g.abs().max()) for g in ref[1].values())
    diffs = {name: float((got[1][name] - g).abs().max()) for name, g in ref[1].items()}
    per_tensor = max(d / (float(ref[1][name].abs().max()) + 1e-3 * scale) for name, d in diffs.items())
    return rel(got[0], ref[0]), max(diffs.values()) / scale, per_tensor


def _matches(got, ref) -> bool:
    logits, grads, per_tensor = _errors(got, ref)
    # transformers' core runs in fp32 whatever the input: measured against an fp64 run, its own gradients of
    # the gate parameters (small sums with cancellation) are off by up to 5e-5 on the per-tensor scale
    return logits < 1e-5 and grads < 1e-5 and per_tensor < 1e-4


def _linear_modules(model):
    return [m for m in model.modules() if any(k == "chunk_gated_delta" for k in find_linear_cores(m).values())]


@pytest.fixture(scope="module", params=list(CONFIGS))
def swapped(request):
    """A tiny model's logits and gradients through transformers, then the same model swapped."""
    model = _tiny(request.param)
    ids = torch.randint(0, 64, (2, 70), generator=torch.Generator().manual_seed(1))
    ref = _run(model, ids)
    modules = _linear_modules(model)
    tensors = {n: p for n, p in model.named_parameters()}
    swaps = [swap_linear_core(m, chunk_size=16) for m in modules]
    for swap in swaps:
        assert sorted(swap.parts.values()) == ["causal_conv1d", "chunk_gated_delta"]
    assert {n: p for n, p in model.named_parameters()} == tensors  # same names, same tensor objects
    return model, ids, ref, swaps


def test_swapped_model_matches_transformers(swapped):
    model, ids, ref, swaps = swapped
    assert swaps
    before = [dict(s.calls) for s in swaps]
    assert _matches(_run(model, ids), ref)
    for swap, calls in zip(swaps, before):  # one forward: each core once (the backward does not re-enter them)
        assert {k: swap.calls[k] - calls.get(k, 0) for k in swap.calls} == {"chunk_gated_delta": 1,
                                                                          "causal_conv1d": 1}


def late_gate(q, k, v, g, beta, s0, chunk, block=None):
    """Planted bug: the decay applied one token late."""
    return chunk_core(q, k, v, g.roll(1, dims=1), beta, s0, chunk)


def early_boundary(q, k, v, g, beta, s0, chunk, block=None):
    """Planted bug: each chunk's outputs are right, but the state handed to the next chunk stops one token
    short."""
    outs, s = [], s0
    for c0 in range(0, q.shape[1], chunk):
        part = [x[:, c0:c0 + chunk] for x in (q, k, v, g, beta)]
        outs.append(chunk_core(*part, s, chunk)[0])
        s = chunk_core(*[x[:, :-1] for x in part], s, 1)[1]
    return torch.cat(outs, 1), s


@pytest.mark.parametrize("bug", ["gate one token late", "state crosses chunks one token early"])
def test_planted_bugs_fail_the_comparison(swapped, bug):
    model, ids, ref, _ = swapped
    registry.register(OP, "cpu", late_gate if bug.startswith("gate") else early_boundary)
    try:
        got = _run(model, ids)
    finally:
        registry.unregister(OP, "cpu")
    assert not _matches(got, ref)
    assert max(_errors(got, ref)) > 1e-3  # not a near miss


def _prefill_then_decode(model, ids):
    """Logits of a cached prefill and of one decode step after it (the step runs transformers' recurrent
    update from the state the chunk core left in the cache)."""
    with torch.no_grad():
        first = model(input_ids=ids[:, :-1], use_cache=True)
        step = model(input_ids=ids[:, -1:], cache=first.past_key_values, use_cache=True)
    return first.logits, step.logits


def test_swapped_core_fills_the_cache_like_transformers():
    model = _tiny("qwen3_next")
    ids = torch.randint(0, 64, (2, 70), generator=torch.Generator().manual_seed(1))
    ref = _prefill_then_decode(model, ids)
    swaps = [swap_linear_core(m, chunk_size=16) for m in _linear_modules(model)]
    got = _prefill_then_decode(model, ids)
    assert all(s.calls["chunk_gated_delta"] == 1 for s in swaps)  # the prefill ran the runtime's core
    for a, b in zip(got, ref):
        assert rel(a, b) < 1e-5


def test_a_swap_changes_one_instance_and_undo_restores_it():
    """The swap gives this one module a forward of its own: its class, its modeling module's globals and every
    other instance (in this model and in another model) stay HuggingFace code; undo restores it exactly."""

    two_linear = {"num_hidden_layers": 3, "layer_types": ["linear_attention", "linear_attention", "full_attention"]}
    model, other = _tiny("qwen3_next", **two_linear), _tiny("qwen3_next", **two_linear)
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    first, second = _linear_modules(model)[:2]
    cls = type(first)
    namespace = dict(vars(sys.modules[cls.__module__]))
    swap = swap_linear_core(first, chunk_size=8)
    assert type(first) is cls and "forward" in vars(first) and "forward" not in vars(second)
    assert dict(vars(sys.modules[cls.__module__])) == namespace  # the modeling module is untouched
    others = [swap_linear_core(m, chunk_size=8) for m in _linear_modules(other)]
    with torch.no_grad():
        model(input_ids=ids)
    assert swap.calls["chunk_gated_delta"] == 1 and not any(s.calls for s in others)  # no leak across models
    with pytest.raises(ValueError, match="already runs a forward of its own"):
        swap_linear_core(first)
    swap.undo()
    assert "forward" not in vars(first)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, want)
    assert swap.calls["chunk_gated_delta"] == 1


# an unseen family: its own names, the same contract
def novel_delta(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **kwargs):
    return recurrent_gated_delta_rule(query, key, value, g, beta, initial_state=initial_state,
                                      output_final_state=output_final_state,
                                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def ungated_delta(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, **kwargs):
    return novel_delta(query, key, value, g * 0, beta, chunk_size, initial_state, output_final_state,
                       use_qk_l2norm_in_kernel)


class NovelMixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 4 * 8 + 4, bias=False)

    def inputs(self, x):
        q, k, v, rest = self.proj(x).split([8, 8, 16, 4], -1)
        b, t = x.shape[:2]
        return (q.view(b, t, 1, 8), k.view(b, t, 1, 8), v.view(b, t, 2, 8), -F.softplus(rest[..., :2]),
                rest[..., 2:].sigmoid())

    def forward(self, x):
        return novel_delta(*self.inputs(x), use_qk_l2norm_in_kernel=True)[0].flatten(2)


class LookAlikeMixer(NovelMixer):
    def forward(self, x):
        return ungated_delta(*self.inputs(x), use_qk_l2norm_in_kernel=True)[0].flatten(2)


def test_unseen_family_is_swapped_by_signature_and_probe():
    torch.manual_seed(0)
    mixer, x = NovelMixer(), torch.randn(2, 21, 16)
    ref = mixer(x)
    swap = swap_linear_core(mixer, chunk_size=8)
    assert swap.parts == {"novel_delta": "chunk_gated_delta"}
    assert torch.allclose(mixer(x), ref, atol=1e-5) and swap.calls["chunk_gated_delta"] == 1


def test_look_alike_with_another_meaning_is_refused():
    mixer = LookAlikeMixer()
    assert find_linear_cores(mixer) == {"ungated_delta": "chunk_gated_delta"}  # the signature alone says yes
    with pytest.raises(ValueError, match="does not compute"):
        swap_linear_core(mixer)
    assert type(mixer) is LookAlikeMixer and "forward" not in vars(mixer)


def test_module_without_a_linear_core_is_refused():
    with pytest.raises(ValueError, match="no chunked sequence core"):
        swap_linear_core(nn.Linear(3, 3))


# --- decay gradients under strong decay ---------------------------------------------------------------------

def _strong_problem(per_channel, strength, seed=1, weakest=0.0):
    """Log decays uniform over [-strength, -weakest] a token, over two 64-token chunks."""
    gen = torch.Generator().manual_seed(seed)
    b, t, h, d = 1, 128, 2, 16
    q, k, v = (torch.randn(b, t, h, d, generator=gen, dtype=torch.float64) for _ in range(3))
    g = -(weakest + torch.rand((b, t, h, d) if per_channel else (b, t, h), generator=gen, dtype=torch.float64)
          * (strength - weakest))
    beta = torch.rand(b, t, h, generator=gen, dtype=torch.float64)
    return [q, k, v, g, beta]


def _grads(fn, xs, **kw):
    xs = [x.clone().requires_grad_() for x in xs]
    o, s = fn(*xs, output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)
    weights = torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)
    ((o * weights).sum() + 0.01 * (s * s).sum()).backward()
    return [x.grad for x in xs]


def _decay_rate_gradient(dg, g):
    """What reaches a decay-rate parameter such as A_log (g = -exp(A_log) * ...): sum over tokens of dg * g, per
    head. Strongly decayed tokens weigh in with large |g|, so an error at tokens whose true dg is tiny shows."""
    return (dg.double() * g).sum(1)


@pytest.mark.parametrize("strength", [1, 10, 100])
@pytest.mark.parametrize("per_channel", [False, True])
def test_decay_gradients_stay_exact_under_strong_decay(per_channel, strength):
    """Log decays down to -100 a token over two chunks: the runtime's fp32 gradients, against the fp64
    recurrence, are within a small multiple of transformers' own fp32 ones (torch_chunk_gated_delta_rule,
    chunk_kimi_delta_attention), tensor by tensor and for what a decay-rate parameter receives."""
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    problem = _strong_problem(per_channel, strength)
    truth = _grads(recurrent_gated_delta_rule, problem)
    fp32 = [x.float() for x in problem]
    ours = _grads(chunk_gated_delta_rule, fp32, chunk_size=64)
    theirs = _grads(chunk_kimi_delta_attention if per_channel else torch_chunk_gated_delta_rule, fp32, chunk_size=64)
    for name, a, b, t in zip(("dq", "dk", "dv", "dg", "dbeta"), ours, theirs, truth):
        assert rel(a, t) <= 3 * rel(b, t) + 1e-6, (name, rel(a, t), rel(b, t))
    g = problem[3]
    rate = _decay_rate_gradient(truth[3], g)
    assert rel(_decay_rate_gradient(ours[3], g), rate) <= 3 * rel(_decay_rate_gradient(theirs[3], g), rate) + 1e-6


# every token decayed by at least `weakest` (log): from nearly none to past where a decay of e^-24 a token ends
# what the forward keeps (runtime.attention.decay_pairs.LOG_DECAY_ZERO) and transformers' chunked scans lose it all
REGIMES = [(0.0, 1e-3), (0.0, 1.0), (1.0, 10.0), (10.0, 24.0), (24.0, 40.0), (40.0, 58.0)]


@pytest.mark.parametrize("weakest, strongest", REGIMES)
@pytest.mark.parametrize("per_channel", [False, True])
def test_decay_gradients_per_tensor_across_regimes(per_channel, weakest, strongest):
    """Every tensor of the runtime's fp32 gradients, relative to its own largest fp64 value (the recurrence), within
    10x transformers' own fp32 error on it plus 1e-6; and what reaches a decay rate. With one decay per head
    the runtime's decay gradient stays exact (1e-5) in every regime, where transformers' is wholly lost from
    e^-24 a token on (its error 1.0); with one per key channel (KDA) the runtime's is lost there too, while
    transformers' own diverges."""
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    problem = _strong_problem(per_channel, strongest, weakest=weakest)
    truth = _grads(recurrent_gated_delta_rule, problem)
    fp32 = [x.float() for x in problem]
    ours = _grads(chunk_gated_delta_rule, fp32, chunk_size=64)
    theirs = _grads(chunk_kimi_delta_attention if per_channel else torch_chunk_gated_delta_rule, fp32, chunk_size=64)
    g = problem[3]
    rate = _decay_rate_gradient(truth[3], g)
    ours.append(_decay_rate_gradient(ours[3], g))
    theirs.append(_decay_rate_gradient(theirs[3], g))
    truth.append(rate)
    for name, a, b, t in zip(("dq", "dk", "dv", "dg", "dbeta", "rate"), ours, theirs, truth):
        assert t.abs().max() > 0
        assert rel(a, t) <= 10 * rel(b, t) + 1e-6, (name, rel(a, t), rel(b, t))
    if not per_channel:
        assert rel(ours[3], truth[3]) < 1e-5 and rel(ours[5], rate) < 1e-5


def test_the_decayed_terms_form_loses_strong_decay_gradients(monkeypatch):
    """Planted: one decay per head, the decay gradient formed from the terms as the forward decays them (the
    runtime's backward before issue 36). With every token decayed by more than e^-24 each term is an exact zero,
    so the whole gradient is; the form the runtime uses keeps it to 1e-6."""
    import runtime.attention.decay_pairs as pairs

    def decayed_terms(g, G, weights, decay, after, before, carried):
        eg, last = pairs.decay_exp(G), G[:, -1:]
        return (pairs.straddling(weights * decay).unsqueeze(-1) + pairs.from_here(after * eg)
                + pairs.before(before * pairs.decay_exp(last - G)) + (carried * pairs.decay_exp(last[:, 0]))[:, None])

    problem = _strong_problem(False, 40, weakest=24)
    truth = _grads(recurrent_gated_delta_rule, problem)[3]
    fp32 = [x.float() for x in problem]
    assert rel(_grads(chunk_gated_delta_rule, fp32, chunk_size=64)[3], truth) < 1e-5
    monkeypatch.setattr(pairs, "scalar_decay_gradient", decayed_terms)
    assert rel(_grads(chunk_gated_delta_rule, fp32, chunk_size=64)[3], truth) > 0.5
