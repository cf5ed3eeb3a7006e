"""Rendered Triton gated-delta kernels against the token-by-token reference, forward and backward.

Run in its own process with TRITON_INTERPRET=1 (Triton reads it at import): tests/runtime/test_linear_attention.py
does. Argument: the kernel store key of the rendered module, loaded the way adapters load it
(runtime.kernels.store). Exits non-zero with the failing check on stderr.
"""

import sys

import torch
import torch.nn.functional as F

from runtime.attention import chunk_gated_delta_rule, recurrent_gated_delta_rule
from runtime.kernels import registry
from runtime.kernels.store import load_kernels
from tests.helpers import check_close

OP = "linear_attention.chunk_gated_delta"




def problem(k, seed):
    gen = torch.Generator().manual_seed(seed)
    batch, length, heads = 1, k.CHUNK + 19, 2  # two chunks, the second one padded
    q, key = (torch.randn(batch, length, heads, k.HEAD_K, generator=gen) for _ in range(2))
    v = torch.randn(batch, length, heads, k.HEAD_V, generator=gen)
    gate = (batch, length, heads, k.HEAD_K) if k.PER_CHANNEL else (batch, length, heads)
    # strong decay: the per-channel split must stay inside fp32's exp range
    g = -F.softplus(torch.randn(gate, generator=gen)) * 3
    beta = torch.rand(batch, length, heads, generator=gen)
    s0 = torch.randn(batch, heads, k.HEAD_K, k.HEAD_V, generator=gen)
    return [x.requires_grad_() for x in (q, key, v, g, beta, s0)]


def run(fn, inputs, **kw):
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    o, final = fn(*inputs[:5], initial_state=inputs[5], output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)
    weights = torch.linspace(-1, 1, o.numel()).view_as(o)
    loss = (o * weights).sum() + (final * final).sum()
    return [o, final, *torch.autograd.grad(loss, inputs)]


def main(key: str) -> None:
    loaded = load_kernels([key])
    if key not in loaded:
        sys.exit(f"the store did not load the rendered module: {loaded}")
    registry.use("triton")
    try:
        op = registry.lookup(OP, None)
        k = sys.modules[op.__module__]
        assert op is k.chunk_gated_delta
        kind = "per-channel" if k.PER_CHANNEL else "per-head"
        inputs = problem(k, 0)
        calls = []
        forward, backward = k.TritonChunkGatedDelta.forward, k._scan_backward
        k.TritonChunkGatedDelta.forward = staticmethod(lambda *a: calls.append("forward") or forward(*a))
        k._scan_backward = lambda *a: calls.append("backward scan") or backward(*a)
        got = run(chunk_gated_delta_rule, inputs, chunk_size=k.CHUNK)
        k.TritonChunkGatedDelta.forward, k._scan_backward = staticmethod(forward), backward
        if calls != ["forward", "backward scan"]:
            sys.exit(f"the Triton kernels did not all run: {calls}")
        ref = run(recurrent_gated_delta_rule, [x.double() for x in inputs])
        names = ["output", "final state", "dq", "dk", "dv", "dg", "dbeta", "d initial state"]
        for name, a, b in zip(names, got, ref):
            check_close(a, b, f"{kind} {name}", 1e-4)
        # a chunk size it was not rendered for falls through to the PyTorch path
        other = run(chunk_gated_delta_rule, inputs, chunk_size=k.CHUNK // 2)
        check_close(other[0], ref[0], f"{kind} fallback output", 1e-4)
    finally:
        registry.use(None)
    print("registered under the triton backend: ok")


if __name__ == "__main__":
    main(sys.argv[1])
