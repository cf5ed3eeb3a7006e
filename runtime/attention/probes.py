"""Probes: does a function found by its signature compute what the runtime's core computes?

Each probe runs the candidate and the runtime's core on one small random problem (fp32, a fixed seed, a
length that crosses chunk boundaries) and compares outputs and final states. A candidate that raises on
these inputs is not the core it looks like. Verdicts are kept per function: every layer of a model shares
its family's functions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.attention.conv import causal_conv1d
from runtime.attention.gated_delta import chunk_gated_delta_rule


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-4) -> bool:
    """|a - b| <= tol (1 + max |b|) everywhere, same shapes."""
    return a.shape == b.shape and bool(((a - b).abs().max() <= tol * (1 + b.abs().max())).item())


def call_quietly(fn, *args, **kwargs):
    """fn's result, or None when these inputs are not of the shape it expects."""
    try:
        with torch.no_grad():
            return fn(*args, **kwargs)
    except (RuntimeError, ValueError, TypeError, IndexError):
        return None


def probe_chunk(fn) -> bool:
    """Same outputs as the runtime's core on a small random problem, with either gate kind."""
    gen = torch.Generator().manual_seed(0)
    b, t, h, d = 1, 11, 2, 4
    q, k, v = (torch.randn(b, t, h, d, generator=gen) for _ in range(3))
    beta = torch.rand(b, t, h, generator=gen)
    kw = {"initial_state": torch.randn(b, h, d, d, generator=gen), "output_final_state": True,
          "use_qk_l2norm_in_kernel": True}
    for gate_shape in ((b, t, h), (b, t, h, d)):
        g = -F.softplus(torch.randn(gate_shape, generator=gen))
        if same_pair(call_quietly(fn, q, k, v, g=g, beta=beta, chunk_size=8, **kw),
                      chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=4, **kw)):
            return True
    return False


def probe_conv(fn) -> bool:
    gen = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(2, 3, 9, generator=gen), torch.randn(3, 4, generator=gen), torch.randn(3, generator=gen)
    theirs = call_quietly(fn, x, w, bias, activation="silu")
    return theirs is not None and close(theirs, causal_conv1d(x, w, bias, activation="silu"))


def probe_ssd(fn) -> bool:
    """Mamba2's chunked scan: same output and final state as the runtime's, grouped B/C, D, dt bias and softplus."""
    from runtime.attention.ssd import ssd_chunk_scan

    gen = torch.Generator().manual_seed(0)
    b, t, h, p, g, n = 2, 11, 4, 3, 2, 5
    x, dt = torch.randn(b, t, h, p, generator=gen), torch.randn(b, t, h, generator=gen)
    bc = [torch.randn(b, t, g, n, generator=gen) for _ in range(2)]
    kw = {"D": torch.randn(h, generator=gen), "dt_bias": torch.randn(h, generator=gen), "dt_softplus": True,
          "initial_states": torch.randn(b, h, p, n, generator=gen), "return_final_states": True}
    a = -torch.rand(h, generator=gen) * 2
    return same_pair(call_quietly(fn, x, dt, a, *bc, chunk_size=8, **kw),
                      ssd_chunk_scan(x, dt, a, *bc, chunk_size=4, **kw))


def probe_selective(fn) -> bool:
    """Mamba1's selective scan: same output and last state as the runtime's, with D, z and a softplus dt bias."""
    from runtime.attention.selective_scan import selective_scan

    gen = torch.Generator().manual_seed(0)
    b, d, t, n = 2, 6, 11, 4
    x, dt, z = (torch.randn(b, d, t, generator=gen) for _ in range(3))
    bc = [torch.randn(b, n, t, generator=gen) for _ in range(2)]
    kw = {"D": torch.randn(d, generator=gen), "z": z, "delta_bias": torch.randn(d, generator=gen),
          "delta_softplus": True, "return_last_state": True}
    a = -torch.rand(d, n, generator=gen) * 2
    return same_pair(call_quietly(fn, x, dt, a, *bc, **kw), selective_scan(x, dt, a, *bc, **kw))


def same_pair(theirs, ours: tuple) -> bool:
    """Whether a probed function returned the runtime's (output, final state)."""
    return (isinstance(theirs, tuple) and len(theirs) == 2 and theirs[1] is not None
            and close(theirs[0], ours[0]) and close(theirs[1], ours[1]))


PROBES = {"chunk_gated_delta": probe_chunk, "causal_conv1d": probe_conv, "ssd_chunk_scan": probe_ssd,
          "selective_scan": probe_selective}
_VERDICTS: dict = {}


def agrees(kind: str, fn) -> bool:
    """Whether `fn`, found as a `kind` core, computes the runtime's result on the probe (cached per function)."""
    if fn not in _VERDICTS:
        _VERDICTS[fn] = PROBES[kind](fn)
    return _VERDICTS[fn]
