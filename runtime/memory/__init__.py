"""Memory policies: activation swap to host, per-layer recompute."""

from runtime.memory.recompute import apply_recompute
from runtime.memory.swap import ActivationSwap, FileStore, PinnedHostStore

__all__ = ["ActivationSwap", "FileStore", "PinnedHostStore", "apply_recompute"]
