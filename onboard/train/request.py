"""What `onboard train` needs besides the job (`runtime.train.TrainJob`): the bundle, the model to build, and how
to read text data. Its command-line options are generated from the fields, as the job's are; this module is
light (no torch), because the command line is built from it."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.train.job import Options, option


@dataclass
class TrainRequest(Options):
    """What `onboard train` needs besides the job (`runtime.train.TrainJob`): the bundle, the model to build,
    and how to read text data. Its command-line options are generated from these fields, as the job's are."""
    bundle: str = option(None, "bundle directory written by onboard adapt", kind="positional")
    trust_remote_code: bool = option(False, "run the model's own modeling code (a bundle never switches it on by "
                                            "itself)", kind="switch")
    weights: str | None = option(None, "train the released model: its config, and its *.safetensors weights read "
                                       "shard by shard (a local directory or the HuggingFace cache); default: the "
                                       "tiny twin with random weights", metavar="MODEL")
    online: bool = option(False, "with --weights: allow fetching MODEL's config from the Hub", kind="switch")
    layers: int | None = option(None, "decoder layers to train (default: the tiny twin's)", kind="positive")
    width: int = option(1, "widen the twin's hidden size, heads and MLPs (default 1)", kind="positive")
    mask_prompt: bool = option(False, "train on completions only (prompt + completion records, or chat messages)",
                               kind="switch")
    text_field: str = option("text", "the text field of .jsonl / .parquet records (default text)")
