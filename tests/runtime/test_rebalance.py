"""Rebalancing experts changes nothing but speed: with deliberately skewed routing, runs that move experts between
EP ranks and copy hot ones onto others (`--rebalance-every`, `--expert-replicas`) have the losses and, gathered, the
parameters of a run that never does, over steps that cross placements, a checkpoint and a resume after one.

The placement itself (`runtime.moe.placement`) is checked in one process: the LPT owners and greedy replicas lower
the busiest rank's load, every expert is owned once, and bad placements are refused.

The multi-process test starts gloo processes of this file (its `__main__` is the worker), as
tests/runtime/test_train_ep.py does.
"""

import json
import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runtime.moe import MoEBlock, RouterSpec
from runtime.moe.block import GroupedExperts
from runtime.moe.placement import Placement, imbalance, place, rank_loads
from runtime.plan import Plan

EXPERTS, HIDDEN, FFN, VOCAB = 8, 16, 8, 64
STEPS, SAVED, EVERY, REPLICAS = 6, 3, 2, 1


def zipf(experts: int, skew: float, seed: int = 0) -> list[float]:
    """Token counts proportional to 1 / rank^skew, the hottest experts where the static layout puts them together."""
    return [1000.0 / (e + 1) ** skew for e in range(experts)]


def test_placement_lowers_the_busiest_rank():
    counts = zipf(64, 1.0)
    static = Placement.contiguous(64, 4)
    for spare in (0, 1, 2):
        chosen = place(counts, 4, spare)
        assert not chosen.problems()
        assert sorted(e for owned in chosen.owners for e in owned) == list(range(64))
        assert math.isclose(sum(rank_loads(counts, chosen)), sum(counts))  # tokens are moved, never lost
        assert imbalance(counts, chosen) < imbalance(counts, static)
    # replicas lower it further where one expert alone outweighs a rank's fair share
    few = zipf(8, 1.2)
    excess = [imbalance(few, p) - 1 for p in (Placement.contiguous(8, 4), place(few, 4), place(few, 4, 1))]
    assert excess[2] < excess[1] < excess[0] and excess[2] <= excess[0] / 2


def test_placement_is_deterministic_and_round_trips():
    counts = zipf(16, 0.8)
    a, b = place(counts, 4, 2), place(list(counts), 4, 2)
    assert a == b == Placement.from_dict(json.loads(json.dumps(a.to_dict())))
    assert Placement.contiguous(16, 4).is_contiguous and not a.is_contiguous


@pytest.mark.parametrize("broken", [
    {"experts": 4, "owners": [[0, 1], [1, 3]], "replicas": [[], []]},  # expert 1 twice, 2 never
    {"experts": 4, "owners": [[0, 1], [2, 3]], "replicas": [[2, 3], []], "spare": 1},  # more replicas than rows
    {"experts": 4, "owners": [[0, 1], [2, 3]], "replicas": [[0], []], "spare": 1},  # a copy beside its owner
    {"experts": 4, "owners": [[0, 1, 2], [3]], "replicas": [[], []]},  # uneven owners
    {"owners": [[0]]},  # no expert count
])
def test_bad_placements_are_refused(broken):
    with pytest.raises(ValueError, match="placement"):
        Placement.from_dict(broken)


def test_rebalancing_without_expert_parallelism_is_refused_in_one_line(tmp_path):
    """The committed bundles' plans have ep=1: nothing to place, said before anything is built or written."""
    from tests.helpers import ROOT, run_cli

    bundle = ROOT / "bundles" / "qwen3-30b-a3b"
    before = sorted(p.name for p in bundle.iterdir())
    result = run_cli("train", bundle, "--rebalance-every", "2", "--checkpoint-dir", tmp_path / "ck", "--runlog",
                     tmp_path / "run.jsonl")
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "ep=1" in lines[0] and "--rebalance-every" in lines[0]
    assert sorted(p.name for p in bundle.iterdir()) == before and not list(tmp_path.iterdir())


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.mix = nn.Linear(HIDDEN, HIDDEN)
        experts = GroupedExperts(nn.Parameter(torch.randn(EXPERTS, 2 * FFN, HIDDEN) * 0.2),
                                 nn.Parameter(torch.randn(EXPERTS, HIDDEN, FFN) * 0.2), activation=F.silu)
        self.mlp = MoEBlock(nn.Parameter(torch.randn(EXPERTS, HIDDEN) * 0.3), RouterSpec(EXPERTS, 2), experts,
                            router_linear_bias=torch.tensor([math.log(w) for w in zipf(EXPERTS, 1.2)]))

    def forward(self, h):
        h = h + self.mix(self.norm(h))
        return h + self.mlp(h)


class SkewedMoE(nn.Module):
    """A causal LM with the HuggingFace call contract whose routers prefer the first experts (a Zipf-like bias
    on the router logits): the static layout gives their rank most of the tokens."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=VOCAB)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([_Layer(), _Layer()])
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids, labels, use_cache=False):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(h)
        return SimpleNamespace(loss=F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()))


def _worker(job_path: str) -> None:
    """One rank: a run without rebalancing, one that rebalances throughout, and one stopped at a checkpoint
    after a rebalance and resumed; each ends by gathering the full parameters."""
    from runtime.parallel import gather_experts
    from runtime.train import TrainJob, train

    torch.set_num_threads(1)
    job = json.loads(Path(job_path).read_text())
    plan = Plan(dp_shard=job["world"], ep=job["ep"], seq_len=16, micro_batch=2, dtype="fp32")

    def run(steps, *, rebalance, ck=None, runlog=None):
        built = {}

        def factory():
            built["model"] = SkewedMoE()
            return built["model"]

        result = train(factory, plan, TrainJob(
            steps=steps, lr=1e-2, progress=False, checkpoint_dir=ck, checkpoint_every=SAVED if ck else 0,
            runlog=runlog, rebalance_every=EVERY if rebalance else 0, expert_replicas=REPLICAS if rebalance else 0))
        params = {k: v.tolist() for k, v in gather_experts(built["model"]).items()}
        return [s.loss for s in result.steps], params

    static, static_params = run(STEPS, rebalance=False)
    moved, moved_params = run(STEPS, rebalance=True, runlog=job["runlog"])
    first, _ = run(SAVED, rebalance=True, ck=job["ck"])
    second, resumed_params = run(STEPS, rebalance=True, ck=job["ck"])
    if torch.distributed.get_rank() == 0:
        Path(job["out"]).write_text(json.dumps({
            "static": static, "moved": moved, "first": first, "second": second, "static_params": static_params,
            "moved_params": moved_params, "resumed_params": resumed_params}))
    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)  # past the last collective; gloo's teardown can abort a finished process (runtime.train does so too)


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> bool:
    """|a - b| <= rel |b| in the L2 norm. (Element by element, an embedding row whose gradient is ~1e-9 moves by
    ~lr after Adam's normalisation whatever its sign, so rounding in the last bits of such a gradient, from
    adding expert outputs in another order, shows up as 1e-4 in that one element; the tensor is unchanged.)"""
    return float((a - b).norm()) <= rel * max(float(b.norm()), 1e-12)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(("world", "ep"), [(4, 4), (4, 2)], ids=["w4-ep4", "w4-ep2-fsdp2"])
def test_rebalancing_changes_nothing_but_speed(tmp_path, world, ep):
    from runtime.runlog import read_runs
    from tests.runtime.test_parallel import launch

    job = {"world": world, "ep": ep, "ck": str(tmp_path / "ck"), "out": str(tmp_path / "out.json"),
           "runlog": str(tmp_path / "moved.jsonl")}
    launch(world, job, tmp_path, script=Path(__file__), timeout=300)
    got = json.loads((tmp_path / "out.json").read_text())
    static = torch.tensor(got["static"])
    assert _close(torch.tensor(got["moved"]), static), (got["moved"], got["static"])
    assert _close(torch.tensor(got["first"] + got["second"]), static), (got["first"], got["second"], got["static"])
    for params in (got["moved_params"], got["resumed_params"]):
        assert params.keys() == got["static_params"].keys()
        for key, want in got["static_params"].items():
            assert _close(torch.tensor(params[key]), torch.tensor(want)), key
    # the placements did move experts, and the busiest rank's share of tokens fell
    (run,), _ = read_runs(tmp_path / "moved.jsonl")
    before, after = [], []
    for step in run.steps:
        for counts, placement in zip(step["expert_tokens"], step["expert_placement"]):
            if placement is None or step["step"] < EVERY:
                before.append(imbalance(counts, Placement.contiguous(EXPERTS, ep)))
            else:
                after.append(imbalance(counts, Placement.from_dict(placement)))
    assert after and before and max(after) < min(before), (before, after)
    assert any(p is not None and not Placement.from_dict(p).is_contiguous
               for step in run.steps for p in step["expert_placement"])
    assert len(run.steps[-1]["peak_memory_bytes_by_rank"]) == world
    # and onboard report draws that run: its per-rank load under each step's placement among the rest
    import cli
    from tests.onboard.test_run_report import check_page

    assert cli.main(["report", str(tmp_path / "moved.jsonl"), "--out", str(tmp_path / "report")]) == 0
    names = {f["id"] for f in check_page(tmp_path / "report").figures}
    assert {"loss.png", "memory.png", "r1-tokens-per-expert.png", "r1-ep-load.png", "r1-hot-cold.png"} <= names


if __name__ == "__main__":
    _worker(sys.argv[1])
