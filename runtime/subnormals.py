"""Subnormal floats: count them in the tensors a computation makes, and run code with flush-to-zero on or off.

A float below the smallest normal value of its type (fp32: 2^-126, about 1.2e-38) is subnormal. x86 CPUs compute
with such values in microcode, several times slower than with normal ones, unless the process sets
flush-to-zero, which changes the numbers of every library in the process and which users do not set. The
runtime's cores keep subnormals out at the source instead (decays too small to matter become exact zeros);
`SubnormalCensus` is how tests and benches see that they do.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# Softmax probabilities below e^-50 (~2e-22) are exact zeros (the losses, sparse attention): a million of them
# move a row's total by 2e-16, and the gradient entries that stay, scaled by 1/tokens and multiplied by head
# weights, stay normal floats. Left in, exp(y - max) underflows to subnormals for logits ~87 below the row's peak (sharp
# distributions), and every matmul of the backward slows on them.
LOG_PROB_ZERO = -50.0


def floor_for(dtype: torch.dtype, log_floor: float) -> float:
    """A log floor stated for fp32, for `dtype`: fp64's exponent range is 8x wider (2^-1022 against 2^-126) and
    its resolution finer, so its floor is 8x lower (e^-192 for decays: far below fp64's resolution, and fp64
    gradient checks stay exact)."""
    return log_floor * 8 if dtype == torch.float64 else log_floor


def exp_or_zero(x: torch.Tensor, log_floor: float) -> torch.Tensor:
    """exp(x), exactly 0 where x < the floor (`log_floor` for fp32, see `floor_for`; differentiable: zero
    gradient there). With the floor well above -87 (fp32's smallest normal is e^-87.3) no result is subnormal,
    nor are its products with moderate operands; the caller picks a floor below which values cannot matter."""
    log_floor = floor_for(x.dtype, log_floor)
    keep = x >= log_floor
    return torch.where(keep, x, log_floor).exp().masked_fill(~keep, 0.0)


def exp_or_zero_(x: torch.Tensor, log_floor: float) -> torch.Tensor:
    """`exp_or_zero` in place, for tensors outside autograd (scratch blocks of a hand-written backward)."""
    log_floor = floor_for(x.dtype, log_floor)
    negligible = x < log_floor
    return x.clamp_min_(log_floor).exp_().masked_fill_(negligible, 0.0)


_COUNT_SLICE = 1 << 22


def count_subnormals(x: torch.Tensor) -> int:
    """The number of subnormal values in a floating-point tensor (0 for other dtypes)."""
    if not (isinstance(x, torch.Tensor) and x.is_floating_point()) or x.numel() == 0:
        return 0
    tiny, flat = torch.finfo(x.dtype).tiny, x.detach().reshape(-1)
    # in slices: a census of a step whose logits take gigabytes must not double them
    return sum(int(((part != 0) & (part.abs() < tiny)).sum()) for part in flat.split(_COUNT_SLICE))


class SubnormalCensus(TorchDispatchMode):
    """While active, counts the subnormal values in every tensor each aten operation computes (not views of
    tensors already counted, not fresh allocations), forward and backward alike (autograd's backward operations dispatch through the same mode). `by_op` maps an operation's
    name to the subnormal values its outputs held in total; `total` sums them; `ops` counts the operations seen.

        with SubnormalCensus() as census:
            loss = core(...).sum(); loss.backward()
        assert census.total == 0, census.worst()
    """

    def __init__(self):
        super().__init__()
        self.by_op: Counter[str] = Counter()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        if _makes_no_values(func):
            return out
        found = sum(count_subnormals(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        if found:
            self.by_op[str(func.overloadpacket.__name__)] += found
        return out

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def worst(self, n: int = 5) -> str:
        """The operations that made the most subnormal values, as one line."""
        return ", ".join(f"{op} {count}" for op, count in self.by_op.most_common(n)) or "none"


# allocations hold whatever memory held before (garbage, not results); views show values already counted
_ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


def _makes_no_values(func) -> bool:
    returns = func._schema.returns
    return (func.overloadpacket.__name__ in _ALLOCATIONS
            or any(r.alias_info is not None and not r.alias_info.is_write for r in returns))


@contextlib.contextmanager
def flush_to_zero(on: bool):
    """Run the block with the CPU's flush-to-zero / denormals-are-zero set to `on`, then set it off again (the
    default; the CPU does not say what it was).
    For measurement only: the runtime itself never sets it."""
    before = torch.set_flush_denormal(on)  # returns whether the CPU supports it, not the previous state
    try:
        yield before
    finally:
        torch.set_flush_denormal(False)
