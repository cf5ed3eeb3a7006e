"""How many aten operators a piece of eager PyTorch dispatches: the host-side work a step pays per operator
(Python, the dispatcher, autograd recording, a kernel launch) whatever the tensors' size.

`predictors.costmodel` charges that work per decoder layer; `bench/dispatch.py` counts the runtime's layers with
`OpCounter` and times them, which is where the cost model's operator counts and per-operator time come from.
"""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts every aten operator dispatched inside the `with` block (views included: they cost host time too)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))
