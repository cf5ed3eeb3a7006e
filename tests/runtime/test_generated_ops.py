"""The runtime ops the agent's generated modules call, and the Generated base they build on.

`hyper_connection_weights` against DeepSeek-V4's own `DeepseekV4HyperConnection` (which computes in fp32 whatever
it is given) and `affine_sum` against ZAYA's own `ZayaResidualScaling` (fp64), transformers' modeling code with
random weights, forward and backward;
`Generated` keeps the original's tensors and state_dict keys and no way back to the original module."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection
from transformers.models.zaya.modeling_zaya import ZayaResidualScaling

from onboard.review.families import default_config
from runtime.generated import Generated, load_generated, settings
from runtime.hyper_connection import hyper_connection_weights
from runtime.residual import affine_sum
from tests.agent.common import RIGHT_PHIMOE_ROUTER

F64 = torch.float64


def _randomised(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    return module


def _fwd_bwd(fn, inputs, params):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    for p in params:
        p.grad = None
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator().manual_seed(9)
    sum((o * torch.randn(o.shape, generator=gen, dtype=F64).to(o.dtype)).sum() for o in outs).backward()
    return [o.detach() for o in outs] + [x.grad for x in leaves] + [p.grad.clone() for p in params]


def _max_rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_hyper_connection_weights_match_deepseek_v4():
    config = default_config("deepseek_v4")
    config.hidden_size = 32
    hc = _randomised(DeepseekV4HyperConnection(config).double())
    x = torch.randn(2, 7, config.hc_mult, 32, dtype=F64, generator=torch.Generator().manual_seed(1))
    theirs = _fwd_bwd(hc, [x], list(hc.parameters()))

    def ours(streams):
        return hyper_connection_weights(streams, hc.fn, hc.base, hc.scale, sinkhorn_iters=hc.hc_sinkhorn_iters,
                                        eps=hc.hc_eps, norm_eps=hc.input_norm.eps)

    mine = _fwd_bwd(ours, [x], list(hc.parameters()))
    assert len(mine) == len(theirs) == 7
    for a, b in zip(mine, theirs):  # both compute the mixes in fp32 (transformers' module casts fp64 down too)
        assert _max_rel(a.double(), b.double()) < 1e-5


def test_hyper_connection_weights_refuse_parameters_of_another_stream_count():
    x = torch.randn(1, 3, 4, 8)
    with pytest.raises(ValueError, match="4 streams of width 8"):
        hyper_connection_weights(x, torch.zeros(15, 32), torch.zeros(15), torch.zeros(3), sinkhorn_iters=2,
                                 eps=1e-6, norm_eps=1e-6)


@pytest.mark.parametrize("dtype", [F64, torch.bfloat16, "mixed"])
def test_affine_sum_matches_zaya_residual_scaling(dtype):
    """In fp64 to rounding; with bf16 activations and fp32 parameters, the same dtypes as the module's; with a bf16
    block output beside an fp32 residual stream (ZAYA's residual_in_fp32, what a bf16 ZAYA calls it with)."""
    module = _randomised(ZayaResidualScaling(16)).to(F64 if dtype == F64 else torch.float32)
    gen = torch.Generator().manual_seed(2)
    dtypes = (torch.bfloat16, torch.float32) if dtype == "mixed" else (dtype, dtype)
    a, b = (torch.randn(2, 5, 16, generator=gen, dtype=F64).to(d) for d in dtypes)
    params = [module.hidden_states_scale, module.hidden_states_bias, module.residual_scale, module.residual_bias]
    theirs = _fwd_bwd(module, [a, b], params)
    mine = _fwd_bwd(lambda x, y: affine_sum(x, y, *params), [a, b], params)
    for m, t in zip(mine, theirs):
        assert m.dtype == t.dtype
        assert _max_rel(m.double(), t.double()) < (1e-12 if dtype == F64 else 1e-2)


def test_affine_sum_refuses_mismatched_inputs():
    with pytest.raises(ValueError, match="one shape"):
        affine_sum(torch.zeros(2, 4), torch.zeros(3, 4), *[torch.zeros(4)] * 4)
    with pytest.raises(ValueError, match=r"\(4,\)"):
        affine_sum(torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(3), *[torch.zeros(4)] * 3)


class _Original(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(3, 4))
        self.norm = torch.nn.Module()
        self.norm.eps = 1e-5
        self.norm.scale = torch.nn.Parameter(torch.ones(4))
        self.register_buffer("table", torch.arange(4.0))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)
        self.heads, self.name, self.sizes = 2, "x", (1, 2)
        self.helper = lambda x: x  # not plain: not copied


def test_generated_holds_the_original_tensors_settings_and_names_only():
    original = _Original()
    generated = Generated(original)
    assert generated.weight is original.weight and generated.norm.scale is original.norm.scale
    assert generated.table is original.table
    assert list(generated.state_dict()) == list(original.state_dict())  # checkpoints keep their keys
    assert "scratch" not in generated.state_dict()
    assert (generated.heads, generated.name, generated.sizes, generated.norm.eps) == (2, "x", (1, 2), 1e-5)
    assert settings(original) == {"heads": 2, "name": "x", "sizes": (1, 2), "norm.eps": 1e-5}
    # nothing reachable from the generated module is the original module or its class
    reachable = [generated, *generated.modules()]
    for holder in reachable:
        for value in vars(holder).values():
            assert value is not original and value is not type(original) and value is not original.helper


def test_load_generated_takes_the_replacement_class_from_a_file(tmp_path):
    path = tmp_path / "thing.py"
    path.write_text("from runtime.generated import Generated\n\n\nclass Replacement(Generated):\n"
                    "    def forward(self, x):\n        return x @ self.weight.T\n")
    cls = load_generated(path)
    original = _Original()
    x = torch.randn(2, 4)
    assert torch.equal(cls(copy.deepcopy(original))(x), x @ original.weight.T)
    (tmp_path / "none.py").write_text("X = 1\n")
    with pytest.raises(ValueError, match="no Replacement"):
        load_generated(tmp_path / "none.py")


def test_hyper_connection_weights_without_comb_match_hy_v4():
    from transformers.models.hy_v4.modeling_hy_v4 import HYV4HyperConnection

    config = default_config("hy_v4")
    config.hidden_size = 32
    hc = _randomised(HYV4HyperConnection(config))
    x = torch.randn(2, 7, config.hc_mult, 32, generator=torch.Generator().manual_seed(3))
    theirs = _fwd_bwd(hc, [x], list(hc.parameters()))

    def ours(streams):
        return hyper_connection_weights(streams, hc.fn, hc.base, hc.scale, eps=hc.hc_eps, norm_eps=hc.input_norm.eps,
                                        post_magnitude=hc.hc_post_magnitude, post_eps=hc.hc_eps)

    mine = _fwd_bwd(ours, [x], list(hc.parameters()))
    assert len(mine) == len(theirs) == 6
    for a, b in zip(mine, theirs):
        assert _max_rel(a, b) < 1e-5


@pytest.mark.parametrize("family", ["inkling_text", "inkling2_text"])
def test_short_conv_residual_matches_inkling_short_convolutions(family):
    """Inkling scales nothing, Inkling2 by 1 / sqrt(W + 1); with a padding mask. Packed sequences (which
    transformers' fallback refuses without the causal_conv1d package) are kept apart."""
    import math

    from transformers.models.inkling.modeling_inkling import InklingShortConvolution
    from transformers.models.inkling2.modeling_inkling2 import Inkling2ShortConvolution

    from runtime.residual import short_conv_residual

    cls, scale = ((InklingShortConvolution, 1.0) if family == "inkling_text"
                  else (Inkling2ShortConvolution, 1 / math.sqrt(5)))
    conv = _randomised(cls(16, 4, layer_idx=0, conv_idx=0)).double()
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 9, 16, generator=gen, dtype=F64)
    mask = torch.ones(2, 9)
    mask[1, :3] = 0
    theirs = _fwd_bwd(lambda h: conv(h, conv_mask=mask), [x], [conv.conv1d.weight])
    mine = _fwd_bwd(lambda h: short_conv_residual(h, conv.conv1d.weight, None, scale, mask=mask), [x],
                    [conv.conv1d.weight])
    for a, b in zip(mine, theirs):  # both compute in fp32
        assert a.dtype == b.dtype and _max_rel(a, b) < 1e-5
    seq_idx = torch.tensor([[0] * 5 + [1] * 4, [0] * 9], dtype=torch.int32)
    packed = short_conv_residual(x, conv.conv1d.weight, None, scale, seq_idx=seq_idx)
    alone = short_conv_residual(x[:1, 5:], conv.conv1d.weight, None, scale)
    assert _max_rel(packed[:1, 5:], alone) < 1e-6


@pytest.mark.parametrize("training", [False, True])
def test_sparse_mixer_matches_phimoe(training):
    """PhiMoE's own `sparsemixer` (fp64): the same experts, weights and score gradients; in training, under one
    seed, the same Gumbel draws and Heun midpoints and the same estimated gradient. Scores are drawn at several
    scales, so some tokens have several experts inside the band and some one."""
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    from runtime.moe.sparse_mixer import sparse_mixer

    for seed in range(3):
        scores = torch.randn(64, 8, dtype=F64, generator=torch.Generator().manual_seed(seed)) * (0.01 + seed)
        outs = []
        for fn in (sparsemixer, lambda s, eps, training: sparse_mixer(s, eps, training)):
            leaf = scores.clone().requires_grad_()
            torch.manual_seed(seed)
            weights, experts = fn(leaf, 0.01, training)
            (weights * torch.linspace(-1, 2, 128, dtype=F64).view(64, 2)).sum().backward()
            outs.append((weights.detach(), experts, leaf.grad))
        (w_theirs, e_theirs, g_theirs), (w_mine, e_mine, g_mine) = outs
        assert torch.equal(e_mine, e_theirs)
        assert torch.allclose(w_mine, w_theirs, rtol=1e-12, atol=0)
        assert torch.allclose(g_mine, g_theirs, rtol=1e-12, atol=1e-15)
        assert training or len(set(e_mine[:, 1].tolist())) > 1  # the second round chose more than one expert


def test_a_replacement_swapped_in_before_the_first_forward_still_feeds_the_auxiliary_loss(tmp_path):
    """transformers records router logits (for the auxiliary loss) through hooks it attaches by class on the
    first forward that asks for them: `replace_module` attaches them first and moves them onto the replacement,
    so a generated router swapped into a fresh model gives the same auxiliary loss, and PhiMoE's own router never
    runs."""
    from transformers import PhimoeForCausalLM
    from transformers.models.phimoe.modeling_phimoe import PhimoeTopKRouter

    from runtime.swap import GENERATED, replace_module

    config = default_config("phimoe")
    config.update({"hidden_size": 32, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "vocab_size": 64, "num_local_experts": 6})
    torch.manual_seed(0)
    model = PhimoeForCausalLM(config).eval()
    adapted = copy.deepcopy(model)
    (tmp_path / "router.py").write_text(RIGHT_PHIMOE_ROUTER)
    replacement = load_generated(tmp_path / "router.py")
    for i in range(2):
        path = f"model.layers.{i}.mlp.router"
        replace_module(adapted, path, replacement(adapted.get_submodule(path)), kind=GENERATED)
    ran = []
    for module in adapted.modules():
        if isinstance(module, PhimoeTopKRouter):
            module.register_forward_pre_hook(lambda *_: ran.append(1))
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    theirs = model(input_ids=ids, labels=ids, output_router_logits=True)
    mine = adapted(input_ids=ids, labels=ids, output_router_logits=True)
    assert theirs.aux_loss is not None and mine.aux_loss is not None
    assert float(mine.aux_loss.detach()) == pytest.approx(float(theirs.aux_loss.detach()), rel=1e-6)
    assert float(mine.loss.detach()) == pytest.approx(float(theirs.loss.detach()), rel=1e-6)
    assert not ran
