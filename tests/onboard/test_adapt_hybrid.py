"""Hybrid models adapt end to end (attention, MoE and loss in the runtime), and verification catches
bugs planted in the runtime's attention: a wrong gate, an off-by-one chunk boundary, a missing top-k mask."""

import pytest
import torch

from onboard.adapt.verify import verify
from runtime.attention import dsa
from runtime.attention.gated_delta import chunk_core
from runtime.kernels import registry

LINEAR_OP = "linear_attention.chunk_gated_delta"


@pytest.fixture(scope="module", params=["qwen3-next-80b-a3b", "kimi-linear-48b-a3b", "deepseek-v3.2"])
def hybrid(request, tmp_path_factory, twin_adapter):
    return (request.param, *twin_adapter(tmp_path_factory.mktemp(request.param), ref=request.param))


def test_attention_moe_and_loss_all_run_in_the_runtime(hybrid):
    name, spec, twin, decision, adapt = hybrid
    assert {e.takes for e in decision.swapped_attention()} == ({"sparse"} if name == "deepseek-v3.2" else {"linear"})
    result = verify(spec, twin, adapt, decision.taken())
    assert result.passed, result.note or [r.grad_failures for r in result.seeds]
    assert result.replaced == result.expected >= 1
    for r in result.seeds:
        assert r.runtime_attention_calls > 0 and r.runtime_loss_calls == 1 and r.original_calls == 0


def _late_gate(q, k, v, g, beta, s0, chunk, block=None):
    return chunk_core(q, k, v, g.roll(1, dims=1), beta, s0, chunk, block)


def _early_boundary(q, k, v, g, beta, s0, chunk, block=None):
    # each chunk's outputs are right, but the state handed to the next chunk stops one token short
    outs, s = [], s0
    for c0 in range(0, q.shape[1], chunk):
        part = [x[:, c0:c0 + chunk] for x in (q, k, v, g, beta)]
        outs.append(chunk_core(*part, s, chunk, block)[0])
        s = chunk_core(*[x[:, :-1] for x in part], s, 1, block)[1]
    return torch.cat(outs, 1), s


def _no_topk_mask(indices, mask, keys_len):
    every_key = torch.arange(keys_len, dtype=torch.int32).expand(*indices.shape[:2], keys_len)
    return _visible_picks(every_key, mask, keys_len)


_visible_picks = dsa.visible_picks


@pytest.mark.parametrize("bug", ["wrong gate", "off-by-one chunk boundary", "missing top-k mask"])
def test_planted_attention_bugs_fail_verification(hybrid, bug, monkeypatch):
    name, spec, twin, decision, adapt = hybrid
    if (bug == "missing top-k mask") != (name == "deepseek-v3.2"):
        pytest.skip("the bug lives in the other kind of attention")
    if bug == "missing top-k mask":
        monkeypatch.setattr(dsa, "visible_picks", _no_topk_mask)
    else:
        registry.register(LINEAR_OP, "cpu", _late_gate if bug == "wrong gate" else _early_boundary)
    try:
        result = verify(spec, twin, adapt, decision.taken(), seeds=(0,))
    finally:
        registry.unregister(LINEAR_OP, "cpu") if bug != "missing top-k mask" else None
    assert not result.passed
    assert result.seeds and result.seeds[0].logits_max_rel > 1e-4
