"""Fused gated activation, silu(gate) * up (times a per-row routing weight), forward and backward.

One autograd node instead of chunk / silu / mul / mul: the backward writes the gate and up gradients
straight into one (N, 2F) buffer, so no concatenation or intermediate products are kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, scale: torch.Tensor | None):
        gate, up = h.chunk(2, dim=-1)
        act = F.silu(gate)
        out = act * up
        if scale is not None:
            out.mul_(scale.unsqueeze(-1))
        ctx.save_for_backward(h, scale)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        h, scale = ctx.saved_tensors
        gate, up = h.chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        act = gate * sig
        dscale = None
        if scale is not None:
            if ctx.needs_input_grad[1]:
                dscale = (dout * act * up).sum(-1)
            dout = dout * scale.unsqueeze(-1)
        dh = torch.empty_like(h)
        dgate, dup = dh.chunk(2, dim=-1)
        torch.mul(dout, act, out=dup)
        # d silu(g) / dg = sig(g) * (1 + g * (1 - sig(g)))
        torch.mul(dout * up, sig * (1 + gate * (1 - sig)), out=dgate)
        return dh, dscale


def is_silu(fn) -> bool:
    """Does this activation compute SiLU? Checked on numbers, not by its name."""
    if fn is None:
        return False
    probe = torch.tensor([-3.0, -0.5, 0.0, 0.7, 4.0])
    try:
        return bool(torch.allclose(fn(probe), F.silu(probe), atol=1e-6))
    except Exception:  # an activation that does not take a plain tensor
        return False


def swiglu(h: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    return SwiGLU.apply(h, scale)
