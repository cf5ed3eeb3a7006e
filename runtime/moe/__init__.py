"""Mixture-of-Experts in the shared runtime: routing, token dispatch, grouped expert MLPs, losses."""

from runtime.moe.block import MoEBlock
from runtime.moe.routed_experts import RoutedExperts
from runtime.moe.router import RouterSpec, route

__all__ = ["MoEBlock", "RoutedExperts", "RouterSpec", "route"]
