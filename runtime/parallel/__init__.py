"""Parallel layout: device mesh, FSDP2, expert parallelism."""
