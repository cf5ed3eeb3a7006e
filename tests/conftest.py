"""Test settings: offline, quiet, and two threads at most (CI has 2 cores)."""

import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("OMP_NUM_THREADS", "2")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)
warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.fixture(scope="session")
def inspected():
    """Inspect each catalogue model once per session (several test files read the same specs)."""
    from onboard.inspection import inspect_model

    cache: dict = {}

    def get(ref: str):
        if ref not in cache:
            cache[ref] = inspect_model(ref)
        return cache[ref]

    return get


@pytest.fixture(scope="session")
def mixtral_bundle(tmp_path_factory):
    """An adapted Mixtral bundle, written once per session (training and memory tests read it)."""
    from onboard.bundle import adapt
    from onboard.source import resolve

    out = tmp_path_factory.mktemp("bundle") / "mixtral"
    adapt(resolve("mixtral-8x7b"), out)
    return out
