"""The torch_npu wrappers, driven through a stand-in `torch_npu` module.

This machine has no Ascend NPU, so `torch_npu` cannot be imported here. The stand-in implements the
operators' documented formulas (CANN aclnnMoeTokenPermute / aclnnMoeTokenUnpermute, npu_grouped_matmul)
in plain PyTorch, which exercises our wrappers' index bookkeeping and registration; it says nothing about
the real operators' speed or numerics on hardware.
"""

import sys
import types

import pytest
import torch

from runtime.kernels import registry
from runtime.moe.dispatch import permute, sort_by_expert, unpermute
from runtime.moe.grouped import grouped_mm


def _stand_in() -> types.ModuleType:
    module = types.ModuleType("torch_npu")

    def npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False):
        top_k = indices.shape[1] if indices.dim() == 2 else 1
        first = torch.argsort(indices.flatten(), stable=True)
        sorted_indices = torch.argsort(first, stable=True)
        out = torch.empty(indices.numel(), tokens.shape[1], dtype=tokens.dtype)
        out[sorted_indices] = tokens[torch.arange(indices.numel()) // top_k]
        return out, sorted_indices.to(torch.int32)

    def npu_moe_token_unpermute(permuted, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
        rows = permuted[sorted_indices.long()]
        top_k = sorted_indices.numel() // (probs.shape[0] if probs is not None else restore_shape[0])
        rows = rows.view(-1, top_k, rows.shape[1])
        return (rows * probs.unsqueeze(-1)).sum(1) if probs is not None else rows.sum(1)

    def npu_grouped_matmul(x, weight, group_list=None, split_item=2, group_type=0):
        counts = torch.diff(group_list, prepend=group_list.new_zeros(1))
        return [grouped_mm(x[0], weight[0], counts)]

    module.npu_moe_token_permute = npu_moe_token_permute
    module.npu_moe_token_unpermute = npu_moe_token_unpermute
    module.npu_grouped_matmul = npu_grouped_matmul
    return module


@pytest.fixture
def fake_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", _stand_in())
    yield
    for op in ("moe.permute", "moe.unpermute", "moe.grouped_mm"):
        registry.unregister(op, "npu")
    registry.use(None)


def test_npu_wrappers_match_the_reference(fake_npu):
    from runtime.kernels import npu

    assert npu.register()
    registry.use("npu")
    torch.manual_seed(0)
    indices = torch.stack([torch.randperm(5)[:2] for _ in range(9)])
    d = sort_by_expert(indices, 5)
    x = torch.randn(9, 4)
    assert registry.lookup("moe.permute", permute) is npu.permute
    assert torch.equal(npu.permute(x, d), permute(x, d))
    y = torch.randn(d.order.numel(), 4)
    assert torch.allclose(npu.unpermute(y, d, 9), unpermute(y, d, 9), atol=1e-6)
    w = torch.randn(5, 4, 3)
    assert torch.allclose(npu.grouped_mm(permute(x, d), w, d.counts), grouped_mm(permute(x, d), w, d.counts))


def test_npu_not_registered_without_torch_npu():
    from runtime.kernels import npu

    assert "torch_npu" not in sys.modules
    assert npu.register() is False
    assert "npu" not in registry.available_backends()
