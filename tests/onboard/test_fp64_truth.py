"""`onboard.adapt.fp64.Fp64Everywhere`: the casts model code writes for half precision stay fp64 under it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from onboard.adapt.fp64 import Fp64Everywhere


def _upcasting_code(x: torch.Tensor, a_log: torch.Tensor) -> list[torch.Tensor]:
    """The casts transformers' modeling files write (RMSNorm, softmax, loss, gated-delta decay, rotary)."""
    return [
        x.to(torch.float32),
        x.float(),
        F.softmax(x, dim=-1, dtype=torch.float32),
        -a_log.float().exp() * F.softplus(x.float()),
        torch.arange(0, 4, 2, dtype=torch.float) / 4,
        torch.arange(3)[..., None].float(),
        x.to(torch.empty(1, dtype=torch.float32)),
        x.to("cpu", torch.float16),
        x.type(torch.float32),
        torch.zeros(2),
        torch.tensor(0.5),
    ]


def test_casts_stay_fp64_under_the_mode_and_only_there():
    x, a_log = torch.randn(2, 3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    with Fp64Everywhere():
        inside = _upcasting_code(x, a_log)
    assert [t.dtype for t in inside] == [torch.float64] * len(inside)
    outside = _upcasting_code(x, a_log)
    assert sum(t.dtype == torch.float32 for t in outside) >= 9  # as written: fp32 (x.to("cpu", fp16): fp16)
    assert torch.get_default_dtype() == torch.float32


def test_integers_and_bools_are_left_alone():
    with Fp64Everywhere():
        assert torch.arange(3).dtype == torch.int64
        assert torch.ones(2, dtype=torch.bool).dtype == torch.bool
        assert torch.arange(3).to(torch.int32).dtype == torch.int32


def test_gradients_flow_in_fp64():
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    with Fp64Everywhere():
        loss = F.cross_entropy(w.float()[None], torch.tensor([1]))
        loss.backward()
    assert loss.dtype == torch.float64 and w.grad.dtype == torch.float64
