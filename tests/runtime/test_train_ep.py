"""Checkpoints of expert-parallel runs: a run resumed from a checkpoint continues with the losses of one
that was never stopped, every EP rank's experts are stored once under their global identity, and a resume
with another expert-parallel degree is refused in one line.

The test starts `world` gloo processes of this file (its `__main__` is the worker); each trains a tiny
MoE model (one layer of expert stacks, one of per-module experts) with `runtime.train.train`.
"""

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runtime.moe import MoEBlock, RouterSpec
from runtime.moe.block import GroupedExperts, ModuleExperts
from runtime.plan import Plan

EXPERTS, HIDDEN, FFN, VOCAB = 4, 16, 8, 64
STEPS, SAVED = 6, 3


class _Layer(nn.Module):
    def __init__(self, experts: nn.Module):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.mix = nn.Linear(HIDDEN, HIDDEN)
        self.mlp = MoEBlock(nn.Parameter(torch.randn(EXPERTS, HIDDEN) * 0.3), RouterSpec(EXPERTS, 2), experts)

    def forward(self, h):
        h = h + self.mix(self.norm(h))
        return h + self.mlp(h)


def _stacks() -> GroupedExperts:
    return GroupedExperts(nn.Parameter(torch.randn(EXPERTS, 2 * FFN, HIDDEN) * 0.2),
                          nn.Parameter(torch.randn(EXPERTS, HIDDEN, FFN) * 0.2), activation=F.silu)


def _modules() -> ModuleExperts:
    return ModuleExperts(nn.ModuleList(nn.Sequential(nn.Linear(HIDDEN, FFN), nn.SiLU(), nn.Linear(FFN, HIDDEN))
                                       for _ in range(EXPERTS)))


class TinyMoE(nn.Module):
    """A causal LM with the HuggingFace call contract: expert stacks in layer 0, and in layer 1 one module per
    expert (`per_module`) or stacks again."""

    def __init__(self, per_module: bool = True):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=VOCAB)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([_Layer(_stacks()), _Layer(_modules() if per_module else _stacks())])
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids, labels, use_cache=False):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(h)
        return SimpleNamespace(loss=F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()))


def _plan(world: int, ep: int) -> Plan:
    return Plan(dp_shard=world, ep=ep, seq_len=16, micro_batch=2, dtype="fp32")


def _worker(job_path: str) -> None:
    """One rank: an uninterrupted run, a run stopped at a checkpoint, its resume, and a resume at another ep."""
    from runtime.train import TrainJob, train

    torch.set_num_threads(1)
    job = json.loads(Path(job_path).read_text())
    world, ep, other, per_module = job["world"], job["ep"], job["other_ep"], job["per_module"]

    def run(steps, ck=None, ep=ep):
        return train(lambda: TinyMoE(per_module), _plan(world, ep),
                     TrainJob(steps=steps, lr=1e-2, progress=False, checkpoint_dir=ck))

    whole = run(STEPS)
    first = run(SAVED, job["ck"])
    second = run(STEPS, job["ck"])
    try:
        run(STEPS, job["ck"], ep=other)
        refused = None
    except ValueError as e:
        refused = str(e)
    out = {"whole": [s.loss for s in whole.steps], "first": [s.loss for s in first.steps],
           "second": [s.loss for s in second.steps], "second_steps": [s.step for s in second.steps],
           "resumed_from": second.resumed_from, "refused": refused}
    Path(job["out"]).with_suffix(f".{torch.distributed.get_rank()}.json").write_text(json.dumps(out))
    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)  # past the last collective; gloo's teardown can abort a finished process (runtime.train does so too)


@pytest.mark.multiprocess
# world 4 (ep 2 x edp 2) shards the per-module experts over two ranks as well: it deadlocked in backward while
# an expert with no tokens on one rank left its parameters out of that rank's reduce-scatter
@pytest.mark.parametrize(("world", "ep", "other_ep", "per_module"), [(2, 2, 1, True), (4, 2, 4, True)],
                         ids=["w2-ep2", "w4-ep2-edp2"])
def test_expert_parallel_resume_continues_exactly(tmp_path, world, ep, other_ep, per_module):
    from torch.distributed.checkpoint import FileSystemReader

    from runtime.train.checkpoint import checkpoints
    from tests.runtime.test_parallel import launch

    ck = tmp_path / "ck"
    job = {"world": world, "ep": ep, "other_ep": other_ep, "per_module": per_module, "ck": str(ck),
           "out": str(tmp_path / "out")}
    launch(world, job, tmp_path, script=Path(__file__), timeout=120)
    for rank in range(world):
        got = json.loads((tmp_path / f"out.{rank}.json").read_text())
        assert got["first"] == got["whole"][:SAVED]
        assert got["resumed_from"] == SAVED and got["second_steps"] == list(range(SAVED, STEPS))
        for resumed, uninterrupted in zip(got["second"], got["whole"][SAVED:], strict=True):
            assert abs(resumed - uninterrupted) <= 1e-6, (rank, got["second"], got["whole"])
        refused = got["refused"]
        assert refused is not None and "\n" not in refused
        assert f"saved with expert parallelism ep={ep} and this run has ep={other_ep}" in refused
    # every EP rank's experts are stored once, under their global identity
    keys = FileSystemReader(str(checkpoints(ck)[-1][1])).read_metadata().state_dict_metadata
    for name in ("gate_up", "down"):
        stacks = sorted(k for k in keys if k.startswith(f"model.layers.0.mlp.experts.{name}"))
        assert stacks == [f"model.layers.0.mlp.experts.{name}@ep{r}of{ep}" for r in range(ep)]
        assert all(keys[k].size[0] == EXPERTS // ep for k in stacks)
        assert f"optim.state.layers.0.mlp.experts.{name}@ep{ep - 1}of{ep}.exp_avg" in keys
    if per_module:  # one module per expert: each under its global index
        indices = {int(k.split(".")[6]) for k in keys if k.startswith("model.layers.1.mlp.experts.experts.")}
        assert indices == set(range(EXPERTS))


if __name__ == "__main__":
    _worker(sys.argv[1])
