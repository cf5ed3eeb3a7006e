"""Memory policies: activation offload to host, per-layer recompute."""

from runtime.memory.offload import ActivationOffload, FileStore, PinnedHostStore
from runtime.memory.recompute import apply_recompute

__all__ = ["ActivationOffload", "FileStore", "PinnedHostStore", "apply_recompute"]
