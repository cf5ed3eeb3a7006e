"""Rendered Triton MoE kernels against the PyTorch reference, forward and backward.

Run in its own process with TRITON_INTERPRET=1 (Triton reads it at import): tests/onboard/test_kernels.py does.
Exits non-zero with the failing check on stderr.
"""

import sys

import torch

from runtime.kernels import registry, store
from runtime.moe.dispatch import permute, sort_by_expert, unpermute
from runtime.moe.grouped import grouped_mm
from tests.helpers import check_close


def main(key: str) -> None:
    k = store.load(key)
    torch.manual_seed(0)
    tokens, experts, hidden, ffn, top_k = 37, 6, k.HIDDEN, 24, k.TOP_K
    indices = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    indices[:, 0] = torch.where(indices[:, 0] == 5, 0, indices[:, 0])  # leave an expert empty sometimes
    for capacity in (None, 0.6):
        d = sort_by_expert(indices, experts, capacity)
        x = torch.randn(tokens, hidden, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        got, ref = k.permute(x, d), permute(x2, d)
        check_close(got, ref, f"permute (capacity {capacity})", 1e-5)
        g = torch.randn_like(ref)
        got.backward(g)
        ref.backward(g)
        check_close(x.grad, x2.grad, f"permute backward (capacity {capacity})", 1e-5)
        y = torch.randn(d.order.numel(), hidden, requires_grad=True)
        y2 = y.detach().clone().requires_grad_()
        got, ref = k.unpermute(y, d, tokens), unpermute(y2, d, tokens)
        check_close(got, ref, f"unpermute (capacity {capacity})", 1e-5)
        g = torch.randn_like(ref)
        got.backward(g)
        ref.backward(g)
        check_close(y.grad, y2.grad, f"unpermute backward (capacity {capacity})", 1e-5)
    d = sort_by_expert(indices, experts)
    for out_in in (False, True):
        shape = (experts, ffn, hidden) if out_in else (experts, hidden, ffn)
        w = (torch.randn(shape) * 0.2).requires_grad_()
        w2 = w.detach().clone().requires_grad_()
        x = torch.randn(d.order.numel(), hidden, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        got = k.grouped_mm(x, w, d.counts, out_in=out_in)
        ref = grouped_mm(x2, w2, d.counts, out_in=out_in)
        check_close(got, ref, f"grouped GEMM (out_in={out_in})", 1e-4)
        g = torch.randn_like(ref)
        got.backward(g)
        ref.backward(g)
        check_close(x.grad, x2.grad, f"grouped GEMM dx (out_in={out_in})", 1e-4)
        check_close(w.grad, w2.grad, f"grouped GEMM dw (out_in={out_in})", 1e-4)
    k.register()
    registry.use("triton")
    assert registry.lookup("moe.grouped_mm", grouped_mm) is k.grouped_mm
    print("registered under the triton backend: ok")


if __name__ == "__main__":
    main(sys.argv[1])
