"""Scalar-decay chunked linear attention and Mamba2's SSD chunk scan built on it.

The chunked core is checked against the token-by-token recurrence in fp64 (an algebra slip shows far above
1e-10); `ssd_chunk_scan` against transformers' own `mamba2_chunk_scan` (which computes in fp32) from the
nemotron_h and granitemoehybrid modeling modules: output, final state and the gradient of every input.
"""


import pytest
import torch
import torch.nn.functional as F
from transformers.models.granitemoehybrid import modeling_granitemoehybrid
from transformers.models.nemotron_h import modeling_nemotron_h

from runtime.attention.constant_decay import chunk_constant_decay
from runtime.attention.scalar_decay import chunk_scalar_decay, recurrent_scalar_decay
from runtime.attention.ssd import ssd_chunk_scan
from tests.helpers import rel

F64 = torch.float64
HF_SCANS = {"nemotron_h": modeling_nemotron_h.mamba2_chunk_scan,
            "granitemoehybrid": modeling_granitemoehybrid.mamba2_chunk_scan}


def _core_inputs(*, batch=2, length=37, key_heads=2, heads=6, kd=5, vd=3, decay=1.0, dtype=F64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, length, key_heads, kd, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(batch, length, heads, vd, generator=gen, dtype=dtype)
    g = -decay * torch.rand(batch, length, heads, generator=gen, dtype=dtype)
    s0 = torch.randn(batch, heads, kd, vd, generator=gen, dtype=dtype)
    return q, k, v, g, s0


def _max_err(a, b):
    return float((a - b).abs().max().detach())


@pytest.mark.parametrize("key_heads, heads", [(3, 3), (2, 6), (1, 4)])
@pytest.mark.parametrize("length, chunk", [(37, 16), (64, 16), (5, 64), (1, 8)])
def test_core_matches_recurrence(key_heads, heads, length, chunk):
    q, k, v, g, s0 = _core_inputs(length=length, key_heads=key_heads, heads=heads)
    for state in (None, s0):
        ref, ref_final = recurrent_scalar_decay(q, k, v, g, initial_state=state, output_final_state=True)
        out, final = chunk_scalar_decay(q, k, v, g, chunk_size=chunk, initial_state=state, output_final_state=True)
        assert out.shape == v.shape and final.shape == s0.shape and out.dtype == F64
        assert _max_err(out, ref) < 1e-10 and _max_err(final, ref_final) < 1e-10


def test_core_no_final_state_unless_asked():
    q, k, v, g, _ = _core_inputs()
    assert chunk_scalar_decay(q, k, v, g)[1] is None


def test_core_independent_of_chunk_size():
    q, k, v, g, s0 = _core_inputs(length=100)
    outs = [chunk_scalar_decay(q, k, v, g, chunk_size=c, initial_state=s0, output_final_state=True)
            for c in (1, 3, 16, 64, 128)]
    for out, final in outs[1:]:
        assert _max_err(out, outs[0][0]) < 1e-11 and _max_err(final, outs[0][1]) < 1e-11


def test_core_strong_decay_stays_finite():
    """Per-token log decays of -30 sum to ~-1900 over a 64-token chunk: exp(-G_j) alone would overflow fp32
    (and fp64); only differences j <= i are exponentiated, so the fp32 result is finite and right."""
    q, k, v, g, s0 = _core_inputs(length=70, decay=60.0)
    ref, ref_final = recurrent_scalar_decay(q, k, v, g, initial_state=s0, output_final_state=True)
    out, final = chunk_scalar_decay(*(x.float() for x in (q, k, v, g)), chunk_size=64,
                                    initial_state=s0.float(), output_final_state=True)
    assert torch.isfinite(out).all() and torch.isfinite(final).all()
    assert _max_err(out.double(), ref) < 1e-4 * ref.abs().max()
    assert _max_err(final.double(), ref_final) < 1e-4 * ref_final.abs().max()


def test_core_lightning_constant_decay():
    """MiniMax's lightning attention: g = -slope, one constant per head."""
    q, k, v, _, s0 = _core_inputs(length=40, key_heads=4, heads=4)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=F64)
    g = (-slopes).expand(2, 40, 4)
    ref, _ = recurrent_scalar_decay(q, k, v, g, initial_state=s0)
    out, _ = chunk_scalar_decay(q, k, v, g, chunk_size=16, initial_state=s0)
    assert _max_err(out, ref) < 1e-10


@pytest.mark.parametrize("length, chunk", [(40, 16), (64, 16), (5, 64), (1, 8), (100, 64)])
def test_constant_decay_core_matches_recurrence_forward_and_backward(length, chunk):
    """The lightning core (one decay per head, made once per call): output, final state and the gradient of
    q, k, v and the initial state equal the token-by-token recurrence's in fp64, whole chunks and a tail alike."""
    q, k, v, _, s0 = _core_inputs(length=length, key_heads=4, heads=4, kd=6, vd=6)
    slopes = torch.tensor([3.0, 0.5, 0.125, 0.01], dtype=F64)
    gen = torch.Generator().manual_seed(5)
    w_out, w_final = torch.randn(2, length, 4, 6, generator=gen, dtype=F64), torch.randn(2, 4, 6, 6, dtype=F64)

    def run(fn):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, s0)]
        out, final = fn(*leaves)
        ((out * w_out).sum() + (final * w_final).sum()).backward()
        return [out, final] + [x.grad for x in leaves]

    ours = run(lambda q, k, v, s: chunk_constant_decay(torch.cat((q, k, v), -1), -slopes, chunk_size=chunk,
                                                       initial_state=s, output_final_state=True))
    ref = run(lambda q, k, v, s: recurrent_scalar_decay(q, k, v, (-slopes).expand(2, length, 4), initial_state=s,
                                                        output_final_state=True))
    for a, b in zip(ours, ref):
        assert a.dtype == F64 and _max_err(a, b) < 1e-10


def test_constant_decay_with_a_trained_decay_takes_the_general_core():
    """A decay that needs a gradient (a trained slope) runs `chunk_scalar_decay`, which writes it."""
    q, k, v, _, _ = _core_inputs(length=20, key_heads=2, heads=2, kd=4, vd=4)
    log_decay = torch.tensor([-0.5, -0.1], dtype=F64, requires_grad=True)
    out, _ = chunk_constant_decay(torch.cat((q, k, v), -1), log_decay, chunk_size=8)
    out.sum().backward()
    ref_decay = log_decay.detach().clone().requires_grad_()
    ref, _ = recurrent_scalar_decay(q, k, v, ref_decay.expand(2, 20, 2))
    ref.sum().backward()
    assert _max_err(out, ref) < 1e-10 and _max_err(log_decay.grad, ref_decay.grad) < 1e-9


def test_constant_decay_refuses_unpacked_or_misshapen_inputs():
    qkv = torch.zeros(1, 8, 2, 12)
    with pytest.raises(ValueError, match="one value per head"):
        chunk_constant_decay(qkv, torch.zeros(3))
    with pytest.raises(ValueError, match="3D"):
        chunk_constant_decay(qkv[..., :10], torch.zeros(2))


def _resets(batch, length, seed=3):
    reset = torch.rand(batch, length, generator=torch.Generator().manual_seed(seed)) < 0.15
    reset[0, 16] = True  # on a chunk boundary
    reset[:, 0] = False
    return reset


def test_core_reset_matches_recurrence_and_separate_sequences():
    q, k, v, g, s0 = _core_inputs(length=50)
    reset = _resets(2, 50)
    ref, ref_final = recurrent_scalar_decay(q, k, v, g, initial_state=s0, output_final_state=True, reset=reset)
    out, final = chunk_scalar_decay(q, k, v, g, chunk_size=16, initial_state=s0, output_final_state=True,
                                    reset=reset)
    assert _max_err(out, ref) < 1e-10 and _max_err(final, ref_final) < 1e-10
    # a sequence that starts at a reset owes nothing to what came before it
    start = int(reset[1].nonzero()[-1])
    alone, alone_final = chunk_scalar_decay(*(x[1:, start:] for x in (q, k, v, g)), chunk_size=16,
                                            output_final_state=True)
    assert _max_err(out[1:, start:], alone) < 1e-10 and _max_err(final[1:], alone_final) < 1e-10


def test_core_gradcheck():
    q, k, v, g, s0 = _core_inputs(batch=1, length=7, key_heads=1, heads=2, kd=3, vd=2)
    reset = torch.tensor([[False, False, False, False, True, False, False]])

    def run(q, k, v, g, s0):
        out, final = chunk_scalar_decay(q, k, v, g, chunk_size=3, initial_state=s0, output_final_state=True,
                                        reset=reset)
        return out, final

    inputs = [x.clone().requires_grad_() for x in (q, k, v, g, s0)]
    assert torch.autograd.gradcheck(run, inputs, fast_mode=True)
    assert torch.autograd.gradcheck(lambda *xs: run(*xs)[0], inputs, fast_mode=True)  # no final-state gradient


def test_core_gradients_match_recurrence():
    """12 chunks: more than one block of the hand-off's decay-gradient reduction."""
    q, k, v, g, s0 = _core_inputs(length=45)
    weights = torch.randn(*v.shape, generator=torch.Generator().manual_seed(7), dtype=F64)
    state_weights = torch.randn(*s0.shape, generator=torch.Generator().manual_seed(8), dtype=F64)
    grads = []
    for fn, kw in ((recurrent_scalar_decay, {}), (chunk_scalar_decay, {"chunk_size": 4})):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g, s0)]
        out, final = fn(*leaves[:4], initial_state=leaves[4], output_final_state=True, **kw)
        ((out * weights).sum() + (final * state_weights).sum()).backward()
        grads.append([x.grad for x in leaves])
    for ours, ref in zip(grads[1], grads[0]):
        assert _max_err(ours, ref) < 1e-10


def test_core_saved_memory_linear_in_length():
    """Autograd keeps O(T x C) per head: doubling T doubles what the backward holds (an O(T^2) form would
    quadruple it)."""
    def saved_elements(length):
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel()
            return t

        leaves = [x.requires_grad_() for x in _core_inputs(length=length, dtype=torch.float32)[:4]]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            chunk_scalar_decay(*leaves, chunk_size=16)
        return total

    assert saved_elements(512) <= 2.1 * saved_elements(256)


def test_core_rejects_bad_shapes():
    q, k, v, g, _ = _core_inputs(key_heads=4, heads=6)
    with pytest.raises(ValueError, match="multiple"):
        chunk_scalar_decay(q, k, v, g)
    q, k, v, g, _ = _core_inputs()
    with pytest.raises(ValueError, match="g"):
        chunk_scalar_decay(q, k, v, g[..., :1])


# ---- ssd_chunk_scan against transformers' mamba2_chunk_scan ----

def _ssd_inputs(*, batch=2, length=45, heads=4, head_dim=3, groups=2, state=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, heads, head_dim, generator=gen)
    dt = torch.randn(batch, length, heads, generator=gen) * 0.5 + 0.2
    A = -torch.empty(heads).uniform_(1, 16, generator=gen)  # Mamba2's A_log init: A ~ -U(1, 16)
    B, C = (torch.randn(batch, length, groups, state, generator=gen) for _ in range(2))
    D = torch.randn(heads, generator=gen)
    dt_bias = torch.randn(heads, generator=gen) * 0.5 - 2.0
    s0 = torch.randn(batch, heads, head_dim, state, generator=gen)
    return {"hidden_states": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "dt_bias": dt_bias, "initial_states": s0}


def _run_scan(fn, inputs, chunk, options, weights):
    """Forward + backward with weighted sums of the output and final state; returns (y, final, grads)."""
    leaves = {n: t.clone().requires_grad_() for n, t in inputs.items()}
    tensors = {n: leaves[n] for n in ("D", "dt_bias", "initial_states") if n in leaves}
    y, final = fn(leaves["hidden_states"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], chunk,
                  return_final_states=True, **tensors, **options)
    ((y * weights[0]).sum() + (final * weights[1]).sum()).backward()
    return y.detach(), final.detach(), {n: t.grad for n, t in leaves.items()}


def _compare(ours, ref, tol=1e-4):
    """Largest error of output, final state and each gradient relative to the reference's largest value, where
    above `tol` (transformers computes in fp32; dA, dD and ddt_bias sum over every token and land near 2e-5)."""
    errors = {"y": rel(ours[0], ref[0]), "final": rel(ours[1], ref[1])}
    errors.update({f"d{n}": rel(ours[2][n], g) for n, g in ref[2].items() if g is not None})
    return {n: e for n, e in errors.items() if not e < tol}


def _weights(inputs):
    gen = torch.Generator().manual_seed(11)
    x, s0 = inputs["hidden_states"], inputs["initial_states"]
    return torch.randn(*x.shape, generator=gen), torch.randn(*s0.shape, generator=gen)


CASES = {  # name: (length, groups, chunk, inputs kept, options)
    "plain": (64, 1, 16, ("hidden_states", "dt", "A", "B", "C", "initial_states"), {}),
    "all_options": (45, 2, 16, None, {"dt_softplus": True, "dt_limit": (0.05, 1.5)}),
    "softplus_default_limit": (45, 4, 32, None, {"dt_softplus": True}),
    "short_one_group": (7, 1, 256, None, {"dt_softplus": True, "dt_limit": (0.0, 0.5)}),
    "chunk_256_multi": (300, 2, 256, None, {"dt_softplus": True}),
}


@pytest.mark.parametrize("model", sorted(HF_SCANS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_ssd_matches_transformers(model, case):
    length, groups, chunk, kept, options = CASES[case]
    inputs = _ssd_inputs(length=length, groups=groups)
    if kept is not None:
        inputs = {n: inputs[n] for n in kept}
    weights = _weights(_ssd_inputs(length=length, groups=groups))
    ref = _run_scan(HF_SCANS[model], inputs, chunk, options, weights)
    ours = _run_scan(ssd_chunk_scan, inputs, chunk, options, weights)
    assert ours[0].shape == ref[0].shape and ours[1].shape == ref[1].shape
    assert ours[0].dtype == ref[0].dtype == torch.float32
    assert _compare(ours, ref) == {}


def test_ssd_return_convention_and_dtypes():
    inputs = _ssd_inputs(length=20)
    half = {n: t.bfloat16() if n != "A" else t for n, t in inputs.items()}
    args = [half[n] for n in ("hidden_states", "dt", "A", "B", "C")]
    kw = {"D": inputs["D"], "dt_bias": half["dt_bias"], "dt_softplus": True}
    ref = HF_SCANS["nemotron_h"](*args, 8, **kw)
    ours = ssd_chunk_scan(*args, 8, **kw)
    assert isinstance(ours, torch.Tensor) and ours.dtype == ref.dtype == torch.float32
    assert rel(ours, ref) < 1e-5
    ours, final = ssd_chunk_scan(*args, 8, z=None, return_final_states=True, **kw)
    assert final.shape == (2, 4, 3, 5) and final.dtype == torch.float32 and final.is_contiguous()


def test_planted_late_decay_is_detected():
    """The comparison above would catch a decay applied one token late (the kind of off-by-one a chunked
    form makes): build the scan from the same core with g shifted by one token and compare it the same way."""
    inputs = _ssd_inputs(length=45, groups=2)
    options = {"dt_softplus": True}
    weights = _weights(inputs)

    def late_decay_scan(x, dt, A, B, C, chunk, D, dt_bias, initial_states, dt_softplus, return_final_states):
        dt = F.softplus(dt + dt_bias)
        g = F.pad((A * dt)[:, :-1], (0, 0, 1, 0))  # token t decays with token t-1's gate
        y, final = chunk_scalar_decay(C, B, x * dt[..., None], g, chunk_size=16,
                                      initial_state=initial_states.transpose(-1, -2), output_final_state=True)
        return y + D[..., None] * x, final.transpose(-1, -2)

    ref = _run_scan(HF_SCANS["nemotron_h"], inputs, 16, options, weights)
    assert _compare(_run_scan(ssd_chunk_scan, inputs, 16, options, weights), ref) == {}
    assert {"y", "final", "dA", "ddt"} <= set(_compare(_run_scan(late_decay_scan, inputs, 16, options, weights), ref))


def _packed_inputs(lengths, seed=0):
    inputs = _ssd_inputs(batch=1, length=sum(lengths), seed=seed)
    inputs.pop("initial_states")
    return inputs


@pytest.mark.parametrize("packing", ["seq_idx", "cu_seqlens"])
def test_ssd_packed_sequences_match_separate_runs(packing):
    lengths = [10, 16, 1, 21]
    inputs = _packed_inputs(lengths)
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    packing_kw = {"seq_idx": seq_idx} if packing == "seq_idx" else {"cu_seqlens": offsets.int()}
    args = [inputs[n] for n in ("hidden_states", "dt", "A", "B", "C")]
    kw = {"D": inputs["D"], "dt_bias": inputs["dt_bias"], "dt_softplus": True}
    y, final = ssd_chunk_scan(*args, 8, return_final_states=True, **kw, **packing_kw)
    per_seq = []
    for lo, hi in zip(offsets[:-1], offsets[1:]):
        part = [t if t.dim() == 1 else t[:, lo:hi] for t in args]
        per_seq.append(HF_SCANS["nemotron_h"](*part, 8, return_final_states=True, **kw))
    assert rel(y, torch.cat([p[0] for p in per_seq], 1)) < 2e-5
    assert rel(final, per_seq[-1][1]) < 2e-5


def test_ssd_rejects_what_it_cannot_do():
    inputs = _ssd_inputs(length=12)
    args = [inputs[n] for n in ("hidden_states", "dt", "A", "B", "C")]
    with pytest.raises(ValueError, match="batch 1"):
        ssd_chunk_scan(*args, 8, cu_seqlens=torch.tensor([0, 5, 12]))
    with pytest.raises(ValueError, match="z"):
        ssd_chunk_scan(*args, 8, z=torch.randn_like(inputs["hidden_states"]))
    with pytest.raises(ValueError, match="seq_idx"):
        ssd_chunk_scan(*args, 8, seq_idx=torch.zeros(1, 12, dtype=torch.long))


@pytest.mark.interpreter
def test_rendered_triton_kernels_match_the_pytorch_path():
    """templates/kernels/scalar_decay_triton.py.j2 rendered small (two key and two value tiles of the state),
    run by Triton's CPU interpreter in its own process (Triton reads TRITON_INTERPRET at import): output, final
    state and every gradient against `chunk_scalar_decay`'s PyTorch path, grouped heads, a padded last chunk."""
    pytest.importorskip("triton")
    from tests.helpers import run_kernel_check, stored_kernel

    key = stored_kernel("kernels/scalar_decay_triton.py.j2", name="tiny", head_k=32, head_v=32, chunk=16, block_k=16,
                        block_v=16, dtype="bf16")
    result = run_kernel_check("check_scalar_decay_triton.py", key)
    assert result.returncode == 0, result.stdout + result.stderr
    for line in ("grouped heads dg: ok", "strong decay dg: ok", "every token strongly decayed dg: ok", "bf16 dq: ok",
                 "fallbacks: ok", "registered under the triton backend: ok"):
        assert line in result.stdout, result.stdout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swapped_lightning_layer_matches_transformers_in_the_model_dtype(dtype):
    """MiniMax's lightning block swapped onto the scalar-decay scan: same output, final state and dtypes as its
    own forward, across several of its blocks (the scan computes in fp32; the projections after it run in the
    model's dtype, as in transformers)."""
    import copy

    from transformers import AutoConfig
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    from runtime.attention import swap_lightning_attention

    config = AutoConfig.for_model("minimax", hidden_size=64, num_attention_heads=4, head_dim=16,
                                  num_hidden_layers=4, block_size=8)
    torch.manual_seed(0)
    reference = MiniMaxLightningAttention(config, layer_idx=1).to(dtype)
    swapped = copy.deepcopy(reference)
    swap = swap_lightning_attention(swapped, chunk_size=4)
    x = torch.randn(2, 27, 64).to(dtype)
    (out, state), (ref_out, ref_state) = swapped(x, None, None), reference(x, None, None)
    assert out.dtype == ref_out.dtype == dtype and state.dtype == ref_state.dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (out.float() - ref_out.float()).abs().max() <= tol * ref_out.float().abs().max()
    assert (state.float() - ref_state.float()).abs().max() <= tol * ref_state.float().abs().max()
    assert dict(swap.calls) == {"lightning": 1}


@pytest.mark.parametrize("strength", [1, 10, 100])
def test_core_decay_gradients_stay_exact_under_strong_decay(strength):
    """Log decays down to -strength a token over two chunks, fp32 against the fp64 recurrence: the chunked
    core's gradients of q, k, v and the log decays, and what a decay rate receives (sum over tokens of dg * g),
    within a small multiple of the fp32 recurrence's own error (issue 14: pair decays summed over the tokens
    they span, decay gradients over the tokens they depend on, never as differences of running sums)."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 128, 2, 16, generator=gen, dtype=F64) for _ in range(3))
    g = -torch.rand(1, 128, 2, generator=gen, dtype=F64) * strength

    def grads(fn, xs, **kw):
        xs = [x.clone().requires_grad_() for x in xs]
        o, s = fn(*xs, output_final_state=True, **kw)
        ((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum() + 0.01 * (s * s).sum()).backward()
        return [x.grad.double() for x in xs]

    truth = grads(recurrent_scalar_decay, [q, k, v, g])
    fp32 = [x.float() for x in (q, k, v, g)]
    chunked, recurrent = grads(chunk_scalar_decay, fp32, chunk_size=64), grads(recurrent_scalar_decay, fp32)
    for ours, theirs, want in [*zip(chunked, recurrent, truth), ((chunked[3] * g).sum(1), (recurrent[3] * g).sum(1),
                                                                 (truth[3] * g).sum(1))]:
        assert rel(ours, want) <= 4 * rel(theirs, want) + 1e-7


@pytest.mark.parametrize("weakest, strongest", [(0.0, 1e-3), (1.0, 10.0), (10.0, 24.0), (24.0, 40.0), (40.0, 58.0)])
@pytest.mark.parametrize("packed", [False, True])
def test_core_decay_gradients_exact_in_every_regime(weakest, strongest, packed):
    """Every token decayed by at least e^-weakest (issue 36), fp32 against the fp64 recurrence, each tensor
    relative to its own largest true value: the log decays' gradient and what a decay rate receives stay exact
    to 1e-5 in every regime, packed sequences too. Formed from the decayed terms, every term of a token decayed
    past e^-24 is an exact zero, and so was its gradient (Mamba2's A_log and dt learned nothing from it)."""
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, 128, 1, 16, generator=gen, dtype=F64) for _ in range(2))
    v = torch.randn(1, 128, 2, 16, generator=gen, dtype=F64)
    g = -(weakest + torch.rand(1, 128, 2, generator=gen, dtype=F64) * (strongest - weakest))
    reset = None
    if packed:
        reset = torch.zeros(1, 128, dtype=torch.bool)
        reset[0, [0, 37, 64, 100]] = True

    def grads(fn, xs, **kw):
        xs = [x.clone().requires_grad_() for x in xs]
        o, s = fn(*xs, output_final_state=True, reset=reset, **kw)
        ((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum() + 0.01 * (s * s).sum()).backward()
        return [x.grad.double() for x in xs]

    truth = grads(recurrent_scalar_decay, [q, k, v, g])
    ours = grads(chunk_scalar_decay, [x.float() for x in (q, k, v, g)], chunk_size=64)
    for name, a, t in zip(("dq", "dk", "dv", "dg"), ours, truth):
        assert t.abs().max() > 0 and rel(a, t) < 1e-5, (name, rel(a, t))
    assert rel((ours[3] * g).sum(1), (truth[3] * g).sum(1)) < 1e-5
