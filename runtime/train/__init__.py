"""Training loop, checkpoints and run logs."""

from runtime.train.loop import StepResult, TrainConfig, TrainResult, train

__all__ = ["StepResult", "TrainConfig", "TrainResult", "train"]
