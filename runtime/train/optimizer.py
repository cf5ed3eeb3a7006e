"""AdamW with its multi-tensor (foreach) kernels on a model whose parameters live on several meshes.

A parallelised model mixes plain tensors (a replicated norm, LoRA factors on one rank), FSDP2 DTensors on the
data-parallel mesh and expert stacks on the expert mesh. PyTorch's foreach AdamW batches every parameter of a group
that shares a device and dtype into one call, and DTensor refuses such a call when its list mixes plain tensors and
DTensors or spans meshes; so the training loop used to run the per-tensor loop (`foreach=False`), which on DTensor
parameters pays DTensor's dispatch for each of the ~12 operators of each tensor's update: most of the optimizer
step on a small model, about a second a step at DeepSeek-V3's ~1,200 parameter tensors.

`AdamW` keeps the user's param groups as they are (so checkpoints, schedulers and `rebalance`, which read
`param_groups` and the per-parameter state, see one group as before) and splits each group into runs of one
tensor kind and mesh only for the duration of `step`. The state is keyed by parameter, so the split shares it.
"""

from __future__ import annotations

import torch


def placement_key(p: torch.Tensor) -> tuple:
    """What a foreach call must not mix: plain tensors, and DTensors by mesh (device and dtype PyTorch groups by).
    A DeviceMesh hashes and compares by its ranks, layout, device type and dim names, the equality DTensor itself
    checks, and caches its hash: cheap to key on for every parameter at every step."""
    mesh = getattr(p, "device_mesh", None)
    return ("tensor",) if mesh is None else ("dtensor", mesh)


def split_by_placement(params: list) -> list[list]:
    """`params` in runs that share a `placement_key`, in first-seen order."""
    runs: dict = {}
    for p in params:
        runs.setdefault(placement_key(p), []).append(p)
    return list(runs.values())


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW, foreach by default, each foreach call over parameters of one kind and mesh."""

    def __init__(self, params, **kwargs):
        kwargs.setdefault("foreach", True)
        super().__init__(params, **kwargs)

    def step(self, closure=None):
        groups = self.param_groups
        self.param_groups = [{**group, "params": run} for group in groups for run in split_by_placement(group["params"])]
        try:
            return super().step(closure)
        finally:
            self.param_groups = groups
