"""Training loop, checkpoints and run logs."""
