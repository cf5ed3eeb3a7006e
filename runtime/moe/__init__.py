"""Mixture-of-Experts in the shared runtime: routing, token dispatch, grouped expert MLPs, losses, placement.

The names below load on first use, so that reading a placement or a run log (`runtime.moe.placement`, pure Python)
does not import torch and transformers.
"""

from importlib import import_module

_WHERE = {"MoEBlock": "runtime.moe.block", "RoutedExperts": "runtime.moe.routed_experts",
          "RouterSpec": "runtime.moe.router", "route": "runtime.moe.router"}

__all__ = ["MoEBlock", "RoutedExperts", "RouterSpec", "route"]


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'runtime.moe' has no attribute {name!r}")
