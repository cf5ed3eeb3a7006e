"""Issue 38 item 3: the gated delta rule (Gated DeltaNet, KDA) under context parallelism matches one process.

Two gloo ranks (one thread each) each run their segments of one sequence with the states carried between them
(`runtime.parallel.context`); their outputs and the gradients of every input (queries, keys, values, decays,
betas) at their tokens must equal one process running the whole sequence, in fp64 to 1e-9: contiguous shares and
zig-zag ones, a decay per head (Gated DeltaNet) and per key channel (KDA), and documents packed across a share
boundary.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from context_worker import inputs  # noqa: E402
from test_parallel import ROOT, launch  # noqa: E402

from runtime.attention.gated_delta import chunk_gated_delta_rule  # noqa: E402

WORKER = ROOT / "tests" / "parallel" / "context_worker.py"


def _reference(job: dict):
    parts, weights = inputs(job)
    parts = [x.clone().requires_grad_(True) for x in parts]
    cu = None
    if job["documents"]:
        cu = torch.tensor([0, *job["documents"], job["tokens"]])
    out, _ = chunk_gated_delta_rule(*parts, chunk_size=job["chunk"], use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    (out * weights).sum().backward()
    return out.detach(), [x.grad for x in parts]


CASES = {
    "contiguous, decay per head": {"zigzag": False, "per_channel": False, "documents": []},
    "zig-zag, decay per key channel (KDA)": {"zigzag": True, "per_channel": True, "documents": []},
    "documents packed across share boundaries": {"zigzag": True, "per_channel": False, "documents": [5, 21, 40]},
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(CASES))
def test_gated_delta_under_context_parallelism_matches_one_process(case, tmp_path):
    job = {"seed": 3, "tokens": 48, "key_heads": 2, "heads": 4, "key_dim": 8, "value_dim": 6, "chunk": 4,
           **CASES[case], "out": str(tmp_path)}
    launch(2, job, tmp_path, script=WORKER, timeout=300)
    want, want_grads = _reference(job)
    covered = torch.zeros(job["tokens"], dtype=torch.bool)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        at = got["positions"]
        covered[at] = True
        torch.testing.assert_close(got["out"], want[:, at], rtol=1e-9, atol=1e-9)
        for name, g, w in zip(("query", "key", "value", "g", "beta"), got["grads"], want_grads):
            torch.testing.assert_close(g, w[:, at], rtol=1e-9, atol=1e-9, msg=lambda m, n=name: f"{n}: {m}")
    assert covered.all()


def test_the_carry_is_what_makes_it_right(tmp_path, monkeypatch):
    """Planted: without the incoming state (each segment from zero) the second share's outputs differ."""
    job = {"seed": 3, "tokens": 48, "key_heads": 2, "heads": 4, "key_dim": 8, "value_dim": 6, "chunk": 4,
           "zigzag": False, "per_channel": False, "documents": []}
    parts, _ = inputs(job)
    whole, _ = chunk_gated_delta_rule(*parts, chunk_size=4, use_qk_l2norm_in_kernel=True)
    alone, _ = chunk_gated_delta_rule(*[x[:, 24:] for x in parts], chunk_size=4, use_qk_l2norm_in_kernel=True)
    assert not torch.allclose(alone, whole[:, 24:], atol=1e-3)
