"""Rendered Triton scalar-decay kernels against `chunk_scalar_decay`'s PyTorch path, forward and backward.

Run in its own process with TRITON_INTERPRET=1 (Triton reads it at import): tests/runtime/test_ssm.py does. Argument:
the kernel store key of the rendered module, loaded the way adapters load it (runtime.kernels.store). Exits
non-zero with the failing check on stderr.
"""

import sys

import torch
import torch.nn.functional as F

from runtime.attention.scalar_decay import OP, chunk_scalar_decay
from runtime.kernels import registry
from runtime.kernels.store import load_kernels
from tests.helpers import check_close


def problem(k, seed, decay=1.0, every_token=None):
    """Grouped heads (2 key heads, 4 value heads), two chunks and a padded third; `every_token` (low, high): every
    token's log decay uniform in [-high, -low] instead."""
    gen = torch.Generator().manual_seed(seed)
    batch, length, key_heads, heads = 2, 2 * k.CHUNK + 5, 2, 4
    q, key = (torch.randn(batch, length, key_heads, k.HEAD_K, generator=gen) for _ in range(2))
    v = torch.randn(batch, length, heads, k.HEAD_V, generator=gen)
    g = -F.softplus(torch.randn(batch, length, heads, generator=gen)) * decay
    if every_token is not None:
        low, high = every_token
        g = -(low + torch.rand(batch, length, heads, generator=gen) * (high - low))
    s0 = torch.randn(batch, heads, k.HEAD_K, k.HEAD_V, generator=gen)
    return [q, key, v, g, s0]


def run(backend, inputs, with_state=True, **kw):
    """Output, final state and the gradients of q, k, v, g (and the initial state) of a weighted loss."""
    registry.use(backend)
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    s0 = inputs[4] if with_state else None
    o, final = chunk_scalar_decay(*inputs[:4], initial_state=s0, output_final_state=with_state, **kw)
    weights = torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)
    loss = (o * weights).sum() + ((final * final).sum() if with_state else 0)
    leaves = inputs if with_state else inputs[:4]
    return [o, final, *torch.autograd.grad(loss, leaves)]


def compare(k, inputs, kind, with_state=True, grad_tol=1e-4):
    got = run("triton", inputs, with_state, chunk_size=k.CHUNK)
    ref = run("cpu", [x.double() for x in inputs], with_state, chunk_size=k.CHUNK)
    names = ["output", "final state", "dq", "dk", "dv", "dg", "d initial state"]
    for name, a, b in zip(names, got, ref):
        if b is None:
            if a is not None:
                sys.exit(f"{kind} {name}: returned where none was asked for")
            continue
        if not torch.isfinite(a).all():
            sys.exit(f"{kind} {name}: not finite")
        check_close(a, b, f"{kind} {name}", 1e-4 if name in ("output", "final state") else grad_tol)


def main(key: str) -> None:
    loaded = load_kernels([key])
    if key not in loaded:
        sys.exit(f"the store did not load the rendered module: {loaded}")
    try:
        registry.use("triton")
        op = registry.lookup(OP, None)
        k = sys.modules[op.__module__]
        assert op is k.chunk_scalar_decay
        calls = []
        forward, backward = k.TritonChunkScalarDecay.forward, k.TritonChunkScalarDecay.backward
        k.TritonChunkScalarDecay.forward = staticmethod(lambda *a: calls.append("forward") or forward(*a))
        k.TritonChunkScalarDecay.backward = staticmethod(lambda *a: calls.append("backward") or backward(*a))
        try:
            compare(k, problem(k, 0), "grouped heads")
            # strong decay: cumulative log decays far below fp32's exp range inside a chunk
            compare(k, problem(k, 1, decay=40.0), "strong decay")
            compare(k, problem(k, 2), "no initial or final state", with_state=False)
            # every token decayed past e^-24: each term of a decay gradient is then below fp32's exp range, and
            # only the factor exp(g_t) taken out of all of them keeps the gradient (judged against its own scale)
            compare(k, problem(k, 5, every_token=(24.0, 40.0)), "every token strongly decayed")
            cases = 4
            if k.DTYPE != "fp32":  # inputs in the rendered dtype: computed in fp32, gradients rounded to it
                low = {"bf16": torch.bfloat16, "fp16": torch.float16}[k.DTYPE]
                compare(k, [x.to(low) for x in problem(k, 4)], k.DTYPE, grad_tol=1e-2)
                cases += 1
        finally:
            k.TritonChunkScalarDecay.forward = staticmethod(forward)
            k.TritonChunkScalarDecay.backward = staticmethod(backward)
        if calls != ["forward", "backward"] * cases:
            sys.exit(f"the Triton kernels did not all run: {calls}")

        # what it was not rendered for falls through to the PyTorch path: another chunk, fp64, packed sequences
        inputs = problem(k, 3)
        ref = run("cpu", inputs, chunk_size=k.CHUNK)
        reset = torch.zeros(inputs[3].shape[:2], dtype=torch.bool)
        reset[:, 7] = True
        for what, kw, dtype in (("other chunk", {"chunk_size": k.CHUNK // 2}, torch.float32),
                                ("fp64", {"chunk_size": k.CHUNK}, torch.float64),
                                ("reset", {"chunk_size": k.CHUNK, "reset": reset}, torch.float32)):
            calls.clear()
            k.TritonChunkScalarDecay.forward = staticmethod(lambda *a: calls.append("forward") or forward(*a))
            try:
                got = run("triton", [x.to(dtype) for x in inputs], **kw)
            finally:
                k.TritonChunkScalarDecay.forward = staticmethod(forward)
            if calls:
                sys.exit(f"{what}: the Triton kernels ran on inputs they were not rendered for")
            if what != "reset":
                check_close(got[0], ref[0], f"{what} fallback output", 1e-4)
                check_close(got[5], ref[5], f"{what} fallback dg", 1e-4)
        print("fallbacks: ok")
    finally:
        registry.use(None)
    print("registered under the triton backend: ok")


if __name__ == "__main__":
    main(sys.argv[1])
