"""Kernels: the registry that backend dispatch reads, and kernels rendered for a model (generated)."""
