"""Training loop, checkpoints and run logs; `TrainJob` (job.py), the one record of a run's options.

The loop's names are imported on first use, so that reading a job (`onboard`'s command line) costs no torch.
"""

from runtime.train.job import TrainJob

__all__ = ["StepResult", "TrainJob", "TrainResult", "train"]


def __getattr__(name: str):
    if name in ("StepResult", "TrainResult", "train"):
        from runtime.train import loop

        return getattr(loop, name)
    raise AttributeError(f"module 'runtime.train' has no attribute {name!r}")
