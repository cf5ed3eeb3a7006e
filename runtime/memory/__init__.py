"""Memory policies: activation swap to host, per-layer recompute."""
