"""Ascend NPU implementations of the runtime's MoE ops, through torch_npu's fused operators.

Registered under the "npu" backend when torch_npu imports (`register()`, called by the adapter's kernel
loading). Operator semantics follow the CANN documentation of
aclnnMoeTokenPermute / aclnnMoeTokenUnpermute (MindSpeed exposes the same Python signatures):

    permuted, sorted_indices = npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False)
        sorted_indices = argsort(argsort(flatten(indices))); permuted[sorted_indices[i]] = tokens[i // top_k]
    out = npu_moe_token_unpermute(permuted, sorted_indices, probs=None, padded_mode=False, restore_shape=None)
        out[t] = sum_j permuted[sorted_indices[t * top_k + j]] (* probs[t, j])

and npu_grouped_matmul([x], [w], group_list=cumulative rows per expert, split_item=2, group_type=0).
Not run on hardware here (this machine has no NPU): tests drive these wrappers through a stand-in module
that implements the documented formulas.
"""

from __future__ import annotations

import importlib

import torch

from runtime.kernels import registry
from runtime.moe import dispatch as reference


def _npu():
    return importlib.import_module("torch_npu")


def permute(x: torch.Tensor, d) -> torch.Tensor:
    if d.keep is not None:  # capacity dropping: the fused op's padded mode has another layout
        return reference.permute(x, d)
    indices = torch.empty(d.order.numel(), dtype=torch.int32, device=x.device)
    # the fused op sorts the flattened expert ids itself (stably, as the reference does)
    indices[d.order] = d.expert_ids.to(torch.int32)
    permuted, _ = _npu().npu_moe_token_permute(x, indices.view(-1, d.top_k))
    return permuted


def unpermute(y: torch.Tensor, d, tokens: int) -> torch.Tensor:
    if d.keep is not None:
        return reference.unpermute(y, d, tokens)
    sorted_indices = torch.empty_like(d.order)
    sorted_indices[d.order] = torch.arange(d.order.numel(), device=d.order.device)
    # without routing probabilities the op learns top-k from the restored shape
    return _npu().npu_moe_token_unpermute(y, sorted_indices.to(torch.int32),
                                          restore_shape=torch.Size([tokens, y.shape[1]]))


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, *, out_in: bool = False) -> torch.Tensor:
    weight = w.transpose(-2, -1) if out_in else w
    group_list = torch.cumsum(counts, 0).to(torch.int64)
    return _npu().npu_grouped_matmul([x], [weight], group_list=group_list, split_item=2, group_type=0)[0]


def register() -> bool:
    """Register the NPU ops when torch_npu is importable; returns whether it did."""
    try:
        _npu()
    except ImportError:
        return False
    registry.register("moe.permute", "npu", permute)
    registry.register("moe.unpermute", "npu", unpermute)
    registry.register("moe.grouped_mm", "npu", grouped_mm)
    return True

