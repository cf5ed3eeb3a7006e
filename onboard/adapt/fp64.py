"""Run model code in fp64 throughout, whatever precision its own lines ask for: the truth verification judges by.

`model.double()` alone does not make a HuggingFace model compute in fp64. Its code upcasts for half-precision
training, and an upcast written as `x.float()` or `x.to(torch.float32)` is a downcast when x is fp64: the
RMSNorms, the attention softmax (`softmax(..., dtype=torch.float32)`), the router's softmax, the loss
(`logits.float()`), the gated-delta-rule scans (every input `.to(torch.float32)`) and their decays
(`-A_log.float().exp() * softplus(a.float() + dt_bias)`) all run in fp32 inside a "fp64" model. A truth
rounded to fp32 where HuggingFace's fp32 run rounds shares that run's errors, so HuggingFace's own error looks
smaller than it is and the errors of a decay gradient computed there are not seen at all.

`Fp64Everywhere` is a TorchFunctionMode: while active, a cast to a lower float precision (`.float()`,
`.half()`, `.bfloat16()`, `.to(dtype)`, `.to(other)`, `.type(dtype)`) gives fp64, a `dtype=` argument of a
lower float precision asks for fp64, and the default dtype is fp64. Autograd's backward runs below Python, so
what the forward built in fp64 is differentiated in fp64.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

LOWER = frozenset({torch.float32, torch.float16, torch.bfloat16})
_CASTS = {torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16}


def _fp64(dtype):
    return torch.float64 if dtype in LOWER else dtype


class Fp64Everywhere(TorchFunctionMode):
    """While active, float tensors made or cast by torch calls are fp64 (see the module docstring)."""

    def __enter__(self):
        self._default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.set_default_dtype(self._default)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _CASTS:
            return args[0].double()
        if func is torch.Tensor.to or func is torch.Tensor.type:
            args = tuple(_fp64(a) if isinstance(a, torch.dtype) else a for a in args)
            other = next((a for a in args[1:] if isinstance(a, torch.Tensor)), None)
            if other is not None and other.dtype in LOWER:  # x.to(other): other's device, fp64
                args = tuple(a for a in args if a is not other)
                kwargs.setdefault("device", other.device)
                kwargs["dtype"] = torch.float64
        if "dtype" in kwargs:
            kwargs["dtype"] = _fp64(kwargs["dtype"])
        return func(*args, **kwargs)
