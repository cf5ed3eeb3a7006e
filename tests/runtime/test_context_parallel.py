"""Issue 38 items 2-3: attention under context parallelism matches one process: the gated delta rule (Gated
DeltaNet, KDA), scalar-decay linear attention (Mamba2's SSD, lightning attention), and softmax attention (causal,
sliding window, chunked) over all-gathered keys.

Two gloo ranks (one thread each) each run their segments of one sequence with the states carried between them
(`runtime.parallel.context`); their outputs and the gradients of every input (queries, keys, values, decays,
betas) at their tokens must equal one process running the whole sequence, in fp64 to 1e-9: contiguous shares and
zig-zag ones, a decay per head (Gated DeltaNet, SSD) and per key channel (KDA), and documents packed across share
boundaries; the softmax reference builds the unsplit sequence's mask itself.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from context_worker import documents_of, inputs, reset_of  # noqa: E402
from test_parallel import ROOT, launch  # noqa: E402

from runtime.attention.gated_delta import chunk_gated_delta_rule  # noqa: E402
from runtime.attention.scalar_decay import chunk_scalar_decay  # noqa: E402

WORKER = ROOT / "tests" / "parallel" / "context_worker.py"


def _reference(job: dict):
    parts, weights = inputs(job)
    parts = [x.clone().requires_grad_(True) for x in parts]
    if job.get("core") == "scalar_decay":
        out, _ = chunk_scalar_decay(*parts, chunk_size=job["chunk"], reset=reset_of(job))
        (out * weights).sum().backward()
        return out.detach(), [x.grad for x in parts]
    if job.get("core") == "conv":
        from runtime.attention.conv import causal_conv1d

        docs = documents_of(job)
        out = causal_conv1d(*parts, activation="silu", seq_idx=None if docs is None else docs[None])
        (out * weights).sum().backward()
        return out.detach(), [x.grad for x in parts]
    if job.get("core") == "dsa":  # the single-process DSA: indexer top-k, then sparse attention, on the whole sequence
        from runtime.attention.dsa import visible_picks
        from runtime.attention.indexer import indexer_topk
        from runtime.attention.sparse import sparse_attention

        q, k, v, iq, ik, iw = parts
        docs = documents_of(job)
        t = job["tokens"]
        mask = torch.arange(t)[None, :] <= torch.arange(t)[:, None]
        if docs is not None:
            mask &= docs[:, None] == docs[None, :]
        picks = indexer_topk(iq.detach(), ik.detach(), iw.detach(), mask[None], job["top_k"], None)
        out = sparse_attention(q, k, v, visible_picks(picks, mask[None, None], t), job["key_dim"] ** -0.5)
        (out * weights).sum().backward()
        return out.detach(), [q.grad, k.grad, v.grad]
    if job.get("core") == "softmax":  # the unsplit sequence's mask, written out independently
        t = job["tokens"]
        i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
        mask = j <= i
        if job.get("window"):
            mask &= i - j < job["window"]
        if job.get("attention_chunk"):
            mask &= i // job["attention_chunk"] == j // job["attention_chunk"]
        docs = documents_of(job)
        if docs is not None:
            mask &= docs[:, None] == docs[None, :]
        q, k, v = parts
        group = q.shape[1] // k.shape[1]
        scores = (q @ k.repeat_interleave(group, 1).transpose(-1, -2)) / q.shape[-1] ** 0.5
        out = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v.repeat_interleave(group, 1)
        (out * weights).sum().backward()
        return out.detach(), [x.grad for x in parts]
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
    "scalar decay (SSD, lightning), zig-zag, packed": {"core": "scalar_decay", "zigzag": True, "per_channel": False,
                                                      "documents": [7, 30]},
    "softmax, causal, zig-zag, packed": {"core": "softmax", "zigzag": True, "per_channel": False,
                                         "documents": [9, 33]},
    # plain causal with one head size: the flash passes merged by log-sum-exp, no mask (`MergedCausal`)
    "softmax, causal, zig-zag (flash passes merged)": {"core": "softmax", "zigzag": True, "per_channel": False,
                                                       "documents": [], "value_dim": 8},
    "softmax, causal, contiguous (flash passes merged)": {"core": "softmax", "zigzag": False, "per_channel": False,
                                                          "documents": [], "value_dim": 8},
    # MLA's values are narrower than its queries and keys: padded with zero columns for the flash passes
    "softmax, causal, zig-zag, narrower values (flash passes merged)": {"core": "softmax", "zigzag": True,
                                                                         "per_channel": False, "documents": []},
    "sliding window": {"core": "softmax", "zigzag": True, "per_channel": False, "documents": [], "window": 7},
    "chunked attention": {"core": "softmax", "zigzag": False, "per_channel": False, "documents": [],
                          "attention_chunk": 16},
    "DeepSeek sparse attention, zig-zag, packed": {"core": "dsa", "zigzag": True, "per_channel": False,
                                                   "documents": [17], "top_k": 6},
    "short causal convolution, zig-zag, packed": {"core": "conv", "zigzag": True, "per_channel": False,
                                                  "documents": [13, 26]},
    "short causal convolution, contiguous": {"core": "conv", "zigzag": False, "per_channel": False,
                                             "documents": []},
}


def job_of(case: str, folder: Path) -> dict:
    return {"seed": 3, "tokens": 48, "key_heads": 2, "heads": 4, "key_dim": 8, "value_dim": 6, "chunk": 4,
            **CASES[case], "out": str(folder / str(list(CASES).index(case)))}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Every case run by one two-rank gloo launch, on first request: the folder of each case's rank outputs."""
    launched = []

    def get(case: str) -> Path:
        if not launched:
            folder = tmp_path_factory.mktemp("cp-cases")
            jobs = [job_of(name, folder) for name in CASES]
            for job in jobs:
                Path(job["out"]).mkdir()
            launch(2, {"cases": jobs}, folder, script=WORKER, timeout=300)
            launched.append(folder)
        return Path(job_of(case, launched[0])["out"])
    return get


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(CASES))
def test_attention_under_context_parallelism_matches_one_process(case, outputs):
    out = outputs(case)
    job = job_of(case, out.parent)
    errors = sorted(out.glob("error*.txt"))
    assert not errors, errors[0].read_text()[-3000:]
    want, want_grads = _reference(job)
    covered = torch.zeros(job["tokens"], dtype=torch.bool)
    for rank in range(2):
        got = torch.load(out / f"rank{rank}.pt")
        at = got["positions"]
        covered[at] = True
        seq = 2 if job.get("core") in ("softmax", "dsa", "conv") else 1  # attention takes (B, H, T, D)
        torch.testing.assert_close(got["out"], want.index_select(seq, at), rtol=1e-9, atol=1e-9)
        got["grads"] = [g for g in got["grads"] if g is not None]  # the indexer's inputs take no gradient
        assert len(got["grads"]) == len(want_grads)
        whole = 1 if job.get("core") == "conv" else len(want_grads)  # the filter's and bias's gradients are whole
        for index, (g, w) in enumerate(zip(got["grads"], want_grads)):
            torch.testing.assert_close(g, w.index_select(seq, at) if index < whole else w, rtol=1e-9, atol=1e-9,
                                       msg=lambda m, n=index: f"input {n}: {m}")
    assert covered.all()


def test_the_carry_is_what_makes_it_right(tmp_path, monkeypatch):
    """Planted: without the incoming state (each segment from zero) the second share's outputs differ."""
    job = {"seed": 3, "tokens": 48, "key_heads": 2, "heads": 4, "key_dim": 8, "value_dim": 6, "chunk": 4,
           "zigzag": False, "per_channel": False, "documents": []}
    parts, _ = inputs(job)
    whole, _ = chunk_gated_delta_rule(*parts, chunk_size=4, use_qk_l2norm_in_kernel=True)
    alone, _ = chunk_gated_delta_rule(*[x[:, 24:] for x in parts], chunk_size=4, use_qk_l2norm_in_kernel=True)
    assert not torch.allclose(alone, whole[:, 24:], atol=1e-3)


def test_two_flash_passes_merged_by_their_log_sum_exps_are_one_attention():
    """`MergedCausal`: a segment's queries over earlier keys (all visible) and its own (causal), as two flash
    passes merged by log-sum-exp, with each pass's backward run on the merged output: the same outputs and
    gradients as one masked attention over all the keys."""
    from runtime.parallel.context import MergedCausal

    gen = torch.Generator().manual_seed(0)
    q, kb, vb, ko, vo = (torch.randn(1, 2, n, 4, generator=gen, dtype=torch.float64, requires_grad=True)
                         for n in (8, 12, 12, 8, 8))
    out = MergedCausal.apply(q, kb, vb, ko, vo, 0.5)
    weights = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((out * weights).sum(), (q, kb, vb, ko, vo))
    k, v = torch.cat([kb, ko], 2), torch.cat([vb, vo], 2)
    mask = torch.cat([torch.ones(8, 12, dtype=torch.bool), torch.ones(8, 8, dtype=torch.bool).tril()], 1)
    want = ((q @ k.transpose(-1, -2)) * 0.5).masked_fill(~mask, float("-inf")).softmax(-1) @ v
    want_grads = torch.autograd.grad((want * weights).sum(), (q, kb, vb, ko, vo))
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    # the first segment has no earlier keys: its own causal pass alone
    empty = torch.zeros(1, 2, 0, 4, dtype=torch.float64)
    first = MergedCausal.apply(q, empty, empty, ko, vo, 0.5)
    torch.testing.assert_close(first, torch.nn.functional.scaled_dot_product_attention(q, ko, vo, is_causal=True,
                                                                                      scale=0.5))
