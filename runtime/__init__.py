"""Shared training runtime: reference ops, kernels, backend dispatch, parallelism, memory, training loop.

Never imports `onboard`; generated adapters import only this package, torch and transformers.
"""
