"""Training loop: losses fall, accumulation and resume are exact, checkpoints are atomic, the CLI fails
in one line, and a run killed with SIGKILL resumes to the same losses as one that was never stopped."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from cli import main
from onboard.train.model import build_model, train_config
from onboard.train.record import trained_record
from runtime.plan import Plan
from runtime.runlog import read_runs
from runtime.train import TrainJob, train
from runtime.train.checkpoint import checkpoints
from runtime.train.data import TokenFile
from tests.parallel.zygote import Zygote, rank_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bundle(mixtral_bundle):
    return mixtral_bundle


@pytest.fixture(scope="module")
def factory(bundle):
    model, record = build_model(bundle, layers=2)
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def make():  # fresh modules, the same weights every time (the loop seeds before calling it anyway)
        model, _ = build_model(bundle, layers=2)
        model.load_state_dict(state)
        return model, record

    return make


def _plan(**kw):
    return Plan(**{"seq_len": 32, "micro_batch": 2, "dtype": "fp32", **kw})


def _losses(result):
    return [s.loss for s in result.steps]


def test_loss_falls_and_the_run_log_has_every_field(factory, tmp_path):
    log = tmp_path / "run.jsonl"
    result = train(factory, _plan(micro_batch=4), TrainJob(steps=30, lr=3e-3, runlog=str(log), progress=False))
    losses = _losses(result)
    assert sum(losses[-10:]) / 10 < losses[0] - 0.5
    runs, skipped = read_runs(log)
    assert not skipped and len(runs) == 1
    run = runs[0]
    assert run.model["hidden"] == 64 and run.model["layers"] == 2 and run.model["experts"] == 8
    (mixer,) = run.model["mixers"]  # the trained model's, not the full-scale model's
    assert (mixer["layers"], mixer["heads"], mixer["head_dim"]) == (2, run.model["heads"], run.model["head_dim"])
    assert run.plan["micro_batch"] == 4 and run.header["precision"] == "fp32"
    assert [s["step"] for s in run.steps] == list(range(30))
    for s in run.steps:
        assert s["step_time_s"] > 0 and s["tokens_per_s"] > 0 and s["peak_memory_bytes"] > 0
        assert s["comm_time_s"] == 0.0  # one process: nothing to communicate
        # every token goes to top-2 of the 8 experts, in each of the 2 MoE layers
        assert [sum(layer) for layer in s["expert_tokens"]] == [4 * 32 * 2] * 2
    assert [s["loss"] for s in run.steps] == losses


def test_run_log_mixers_are_those_of_the_trained_prefix_at_trained_size():
    """A hybrid's trained config keeps its first layers at twin size; the logged mixers must say so, or the
    predictor would price a 3-layer twin's token mixing as the full model's."""
    def layer(kind, **attention):
        return {"attention": {"kind": kind, **attention}, "mlp": {"kind": "dense", "ffn": 8192}}

    linear = {"num_heads": 32, "head_dim": 128}
    softmax = {"num_heads": 16, "num_kv_heads": 2, "head_dim": 256}
    spec = {"name": "hybrid", "num_layers": 5, "hidden_size": 2048, "vocab_size": 1000,
            "layers": [layer("linear:gated_deltanet", **linear), layer("linear:gated_deltanet", **linear),
                       layer("softmax", **softmax), layer("sliding", **softmax, window=4096),
                       layer("linear:gated_deltanet", **linear)]}
    full = {"hidden_size": 2048, "num_hidden_layers": 5, "num_attention_heads": 16, "num_key_value_heads": 2,
            "head_dim": 256, "linear_num_value_heads": 32, "linear_num_key_heads": 16, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "sliding_window": 4096, "intermediate_size": 8192, "vocab_size": 1000}
    twin = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "linear_num_value_heads": 6, "linear_num_key_heads": 3, "linear_key_head_dim": 8,
            "linear_value_head_dim": 8, "sliding_window": 8, "intermediate_size": 128, "vocab_size": 512}
    record = trained_record(spec, full, twin, torch.nn.Linear(2, 2))
    assert [(m["kind"], m["layers"], m["heads"], m["head_dim"], m["window"]) for m in record["mixers"]] == [
        ("linear:gated_deltanet", 2, 6, 8, None), ("softmax", 1, 4, 16, None), ("sliding", 1, 4, 16, 8)]
    assert (record["layers"], record["linear_attention_layers"], record["sparse_attention_layers"]) == (4, 2, 0)


def test_gradient_accumulation_equals_the_bigger_micro_batch(factory):
    one = _losses(train(factory, _plan(micro_batch=2), TrainJob(steps=4, lr=1e-2, progress=False)))
    two = _losses(train(factory, _plan(micro_batch=1, grad_accum=2), TrainJob(steps=4, lr=1e-2, progress=False)))
    assert np.allclose(one, two, rtol=0, atol=1e-5)


def test_memory_policies_leave_the_losses_unchanged(factory):
    plain = _losses(train(factory, _plan(), TrainJob(steps=3, lr=1e-2, progress=False)))
    for policy in ({"offload": "moe"}, {"offload": "all", "recompute": "selective"}, {"recompute": "full"}):
        assert _losses(train(factory, _plan(**policy), TrainJob(steps=3, lr=1e-2, progress=False))) == plain


def test_resume_continues_exactly(factory, tmp_path):
    whole = _losses(train(factory, _plan(), TrainJob(steps=6, lr=1e-2, progress=False)))
    cfg = TrainJob(steps=3, lr=1e-2, progress=False, checkpoint_dir=str(tmp_path / "ck"))
    first = train(factory, _plan(), cfg)
    assert first.resumed_from is None and _losses(first) == whole[:3]
    cfg.steps = 6
    second = train(factory, _plan(), cfg)
    assert second.resumed_from == 3
    assert [s.step for s in second.steps] == [3, 4, 5]
    assert _losses(second) == whole[3:]


def test_a_resumed_run_keeps_the_options_that_decided_its_steps(factory, tmp_path):
    """job.json in the checkpoint folder records the job; resuming with another learning rate or seed would make
    another run out of this one's steps: refused in one line. Steps, checkpoint spacing and outputs may change."""
    from runtime.train.job import TrainJob as Job

    ck = tmp_path / "ck"
    train(factory, _plan(), TrainJob(steps=1, lr=1e-2, progress=False, checkpoint_dir=str(ck)))
    recorded = Job.load(ck / "job.json")
    assert recorded.lr == 1e-2 and recorded.plan == _plan().to_dict() and recorded.steps == 1
    for change in ({"lr": 1e-3}, {"seed": 3}, {"clip": 0.5}):
        with pytest.raises(ValueError, match=f"holds checkpoints of a job with {next(iter(change))} "):
            train(factory, _plan(), TrainJob(steps=2, progress=False, checkpoint_dir=str(ck), **{"lr": 1e-2, **change}))
    (ck / "step-00000009").mkdir()  # an emptied newer step folder: there are steps left to train, and checked
    with pytest.raises(ValueError, match="holds checkpoints of a job with lr "):
        train(factory, _plan(), TrainJob(steps=2, lr=1e-3, progress=False, checkpoint_dir=str(ck)))
    (ck / "step-00000009").rmdir()
    again = train(factory, _plan(), TrainJob(steps=2, lr=1e-2, progress=False, checkpoint_dir=str(ck),
                                             checkpoint_every=1, runlog=str(tmp_path / "run.jsonl")))
    assert again.resumed_from == 1 and Job.load(ck / "job.json").steps == 2


def test_checkpoints_are_atomic_and_pruned(factory, tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / ".step-00000099.tmp").mkdir()  # debris of a save that was killed: never loaded
    result = train(factory, _plan(), TrainJob(steps=4, checkpoint_dir=str(ck), checkpoint_every=1,
                                                 keep_checkpoints=2, progress=False))
    assert result.resumed_from is None
    assert [step for step, _ in checkpoints(ck)] == [3, 4]
    assert sorted(p.name for p in ck.iterdir()) == ["job.json", "step-00000003", "step-00000004"]
    again = train(factory, _plan(), TrainJob(steps=4, checkpoint_dir=str(ck), progress=False))
    assert again.resumed_from == 4 and again.steps == []


@pytest.mark.parametrize("change", ["int32", "shape"])
def test_resume_refuses_a_checkpoint_whose_tensors_are_not_the_runs(change, factory, tmp_path):
    """DCP copies a saved tensor into the run's own: an int32 one would be cast to float silently, another shape
    fail deep inside. The checkpoint is refused in one line naming the tensor."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    ck = tmp_path / "ck"
    train(factory, _plan(), TrainJob(steps=1, progress=False, checkpoint_dir=str(ck)))
    saved = checkpoints(ck)[-1][1]
    dcp_to_torch_save(saved, tmp_path / "plain.pt")
    state = torch.load(tmp_path / "plain.pt", weights_only=False)
    key = next(k for k in state["model"] if k.endswith("embed_tokens.weight"))
    weight = state["model"][key]
    state["model"][key] = (weight * 100).to(torch.int32) if change == "int32" else weight[:-1].clone()
    torch.save(state, tmp_path / "plain.pt")
    for f in saved.iterdir():
        f.unlink()
    torch_save_to_dcp(tmp_path / "plain.pt", saved)
    with pytest.raises(ValueError, match=f"model.{key} is " + ("int32" if change == "int32" else "float32 \\[")):
        train(factory, _plan(), TrainJob(steps=2, progress=False, checkpoint_dir=str(ck)))


@pytest.mark.parametrize("damage", ["truncated", "emptied"])
def test_resume_skips_a_damaged_newest_checkpoint_and_says_so(damage, factory, tmp_path, capsys):
    """A truncated newest checkpoint (a file cut short) or an emptied step folder is passed over: the run resumes
    from the newest complete one, with the losses of a run never stopped, and names what it skipped."""
    whole = _losses(train(factory, _plan(), TrainJob(steps=4, lr=1e-2, progress=False)))
    ck = tmp_path / "ck"
    cfg = TrainJob(steps=3, lr=1e-2, progress=False, checkpoint_dir=str(ck), checkpoint_every=1)
    train(factory, _plan(), cfg)
    newest = checkpoints(ck)[-1][1]
    if damage == "truncated":
        biggest = max(newest.glob("*.distcp"), key=lambda f: f.stat().st_size)
        biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    else:
        for f in newest.iterdir():
            f.unlink()
    cfg.steps = 4
    resumed = train(factory, _plan(), cfg)
    assert resumed.resumed_from == 2 and _losses(resumed) == whole[2:]
    err = capsys.readouterr().err
    assert f"resume: skipped {newest}: " in err and ("truncated" in err if damage == "truncated" else "metadata" in err)


def test_token_file_windows_and_bad_files(factory, tmp_path):
    tokens = np.arange(1000, dtype=np.int32) % 500
    np.save(tmp_path / "tokens.npy", tokens)
    source = TokenFile(tmp_path / "tokens.npy", 32, 512)
    assert source.sequence(3).tolist() == tokens[96:128].tolist()
    assert source.sequence(31).tolist() == tokens[:32].tolist()  # wraps after the last whole window
    result = train(factory, _plan(), TrainJob(steps=2, data=str(tmp_path / "tokens.npy"), progress=False))
    assert len(result.steps) == 2
    np.save(tmp_path / "big.npy", np.array([0, 600] * 40))
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        TokenFile(tmp_path / "big.npy", 32, 512)
    np.save(tmp_path / "negative.npy", np.array([3, -2] * 40))
    with pytest.raises(ValueError, match="never negative"):
        TokenFile(tmp_path / "negative.npy", 32, 512)
    (tmp_path / "tokens.txt").write_text("1 2 3")
    with pytest.raises(ValueError, match=r"must be \.npy or \.bin"):
        TokenFile(tmp_path / "tokens.txt", 32)


def test_cli_errors_are_one_line(bundle, tmp_path, capsys):
    assert main(["train", str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("onboard: error:") and "no such bundle" in err and "\n" not in err
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"micro_batch": 2, "pipeline": 4}))
    with pytest.raises(SystemExit) as stopped:  # read as the option is parsed: argparse's one-line error
        main(["train", str(bundle), "--plan", str(plan)])
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == 2 and "unknown plan field(s): 'pipeline'" in err and "\n" not in err
    plan.write_text(json.dumps({"ep": 3, "dp_shard": 2}))
    assert main(["train", str(bundle), "--plan", str(plan)]) == 1
    assert "cannot run" in capsys.readouterr().err


def test_cli_trains_in_process_and_bundle_has_train_sh(bundle, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(_plan().to_json())
    log, ck = tmp_path / "run.jsonl", tmp_path / "ck"
    assert main(["train", str(bundle), "--plan", str(plan), "--steps", "2", "--layers", "1", "--runlog", str(log),
                 "--checkpoint-dir", str(ck)]) == 0
    runs, _ = read_runs(log)
    assert len(runs[0].steps) == 2 and runs[0].model["layers"] == 1
    assert [step for step, _ in checkpoints(ck)] == [2]
    script = bundle / "train.sh"
    assert os.access(script, os.X_OK)
    assert "torchrun --standalone --nproc-per-node=1 -m runtime.train" in script.read_text()
    assert Plan.load(bundle / "plan.json") == Plan()


# ---------------------------------------------------------------------------------------------------
# Several processes: torchrun, gloo, one rank killed with SIGKILL


def _job_args(bundle, config, plan, log, ck, steps, every, extra=()) -> list[str]:
    """`python -m runtime.train`'s arguments (what torchrun starts on every rank): one torch thread."""
    kwargs = json.dumps({"bundle": str(bundle), "config": str(config)})
    args = ["--model", "onboard.train:build_model", "--model-kwargs", kwargs, "--plan", str(plan), "--steps",
            str(steps), "--lr", "1e-2", "--runlog", str(log), "--no-progress", "--threads", "1"]
    if ck:
        args += ["--checkpoint-dir", str(ck), "--checkpoint-every", str(every)]
    return args + [str(a) for a in extra]


class _Run:
    """`python -m runtime.train` on a plan's ranks: through the real torchrun (`torchrun=True`), or as forks of this
    test process's zygote (tests/parallel/zygote.py: torchrun's environment and its ending when a rank fails,
    without each rank importing the torch stack again)."""

    def __init__(self, bundle, config, plan, log, ck, steps, every, extra=(), *, torchrun: bool = False):
        world = Plan.load(plan).world_size
        args = ["-m", "runtime.train", *_job_args(bundle, config, plan, log, ck, steps, every, extra)]
        self.world = None
        if torchrun:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", *args]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
            self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        else:
            env = rank_env()
            self.world = Zygote.shared().start(world, args, env=env, logs=Path(log).with_suffix(".ranks"))

    def running(self) -> bool:
        return self.proc.poll() is None if self.world is None else self.world.poll() is None

    def rank_pid(self, rank: int) -> int | None:
        if self.world is not None:
            return self.world.rank_pids().get(rank)
        try:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        except OSError:
            return None
        for pid in children:
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ:
                return int(pid)
        return None

    def finish(self, timeout: float) -> tuple[bool, str]:
        """Whether every rank ended well, and what they wrote (killed first if still running after `timeout`)."""
        if self.world is not None:
            codes = self.world.wait(timeout)
            return not any(codes.values()), "\n".join(f"rank {r} ({c}): {self.world.log(r)}" for r, c in codes.items())
        try:
            out = self.proc.communicate(timeout=timeout)[0]
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode == 0, out.decode()[-6000:]


def _step_losses(log) -> dict[int, float]:
    runs, _ = read_runs(log)
    return {s["step"]: s["loss"] for run in runs for s in run.steps}


@pytest.mark.multiprocess
@pytest.mark.parametrize(("layout", "steps", "every"), [
    # through the real torchrun (the others as forks of the zygote): the kill lands within milliseconds of the
    # first checkpoint (step 5 or later), 25 steps before the end
    ({"dp_shard": 2}, 30, 5),
    # two pipeline stages of one layer, each split over two tensor-parallel ranks: 4 processes
    ({"pp": 2, "tp": 2, "micro_batch": 1, "grad_accum": 2}, 16, 4),
    # issue 38: context parallelism, each sequence over two ranks whose expert-parallel group they also are
    ({"cp": 2, "ep": 2}, 16, 4)], ids=["fsdp", "pp-tp", "cp-ep"])
def test_sigkill_one_rank_then_resume_gives_the_same_losses(bundle, tmp_path, layout, steps, every):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(train_config(bundle, layers=2)))
    plan = tmp_path / "plan.json"
    plan.write_text(_plan(**layout).to_json())
    torchrun = layout == {"dp_shard": 2}
    # the uninterrupted reference as forks of the zygote in every case: the same ranks' code, one torchrun fewer
    ok, out = _Run(bundle, config, plan, tmp_path / "whole.jsonl", None, steps, every, torchrun=False).finish(300)
    assert ok, out
    reference = _step_losses(tmp_path / "whole.jsonl")
    assert sorted(reference) == list(range(steps))

    ck, log = tmp_path / "ck", tmp_path / "killed.jsonl"
    victim = _Run(bundle, config, plan, log, ck, steps, every, torchrun=torchrun)
    deadline = time.monotonic() + 240
    while not checkpoints(ck) and victim.running() and time.monotonic() < deadline:
        time.sleep(0.01)
    pid = victim.rank_pid(1)
    assert pid is not None, "rank 1 was not found"
    os.kill(pid, signal.SIGKILL)
    ok, _ = victim.finish(120)
    assert not ok
    done_before = _step_losses(log)
    assert len(done_before) < steps, "the run finished before it was killed"
    saved = checkpoints(ck)[-1][0]
    assert saved >= every

    ok, out = _Run(bundle, config, plan, tmp_path / "resumed.jsonl", ck, steps, every, torchrun=torchrun).finish(300)
    assert ok, out
    runs, _ = read_runs(tmp_path / "resumed.jsonl")
    assert runs[0].header["meta"]["resumed_from"] == saved
    after = _step_losses(tmp_path / "resumed.jsonl")
    assert sorted(after) == list(range(saved, steps))
    for step, loss in after.items():
        assert abs(loss - reference[step]) <= 1e-6, (step, loss, reference[step])
    # the steps the killed run completed before the kill agree as well
    for step, loss in done_before.items():
        assert loss == reference[step]


@pytest.mark.multiprocess
def test_memory_policies_compose_with_pipeline_and_tensor_parallelism(bundle, tmp_path):
    """pp 2 x tp 2 with full recompute and MoE activation offload trains with the losses of one process without
    either (AdamW, clipping, 2 micro-batches a step, tokens from a file, through the training loop), and its
    held-out loss (forward only, through the pipeline schedule) is the single process's."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(train_config(bundle, layers=2)))
    rng = np.random.default_rng(0)
    for name in ("train", "held_out"):
        np.save(tmp_path / f"{name}.npy", rng.integers(3, 500, 4000).astype(np.int64))
    data = ["--data", tmp_path / "train.npy", "--eval-data", tmp_path / "held_out.npy", "--eval-every", 3]
    runs, held_out = {}, {}
    for name, layout in (("one", {}), ("pp-tp", {"pp": 2, "tp": 2, "recompute": "full", "offload": "moe"})):
        plan = tmp_path / f"{name}.json"
        plan.write_text(_plan(micro_batch=1, grad_accum=2, **layout).to_json())
        if name == "one":  # the single process's run: runtime.train's main in this process (its thread count kept)
            from runtime.train.__main__ import main as runtime_train

            assert not torch.distributed.is_initialized()  # (its main leaves by os._exit where one is)
            threads = torch.get_num_threads()
            try:
                assert runtime_train(_job_args(bundle, config, plan, tmp_path / "one.jsonl", None, 3, 0, data)) == 0
            finally:
                torch.set_num_threads(threads)
        else:
            ok, out = _Run(bundle, config, plan, tmp_path / f"{name}.jsonl", None, 3, 0, data).finish(300)
            assert ok, out
        runs[name] = _step_losses(tmp_path / f"{name}.jsonl")
        held_out[name] = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()
                          if '"eval"' in line][-1]
    assert sorted(runs["one"]) == [0, 1, 2]
    for step, loss in runs["one"].items():
        assert runs["pp-tp"][step] == pytest.approx(loss, rel=1e-5)
    assert held_out["pp-tp"]["tokens"] == held_out["one"]["tokens"] > 0
    assert held_out["pp-tp"]["loss"] == pytest.approx(held_out["one"]["loss"], rel=1e-5)


@pytest.mark.multiprocess
def test_cli_launches_torchrun_for_two_processes_with_expert_parallelism(bundle, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text(_plan(dp_shard=2, ep=2).to_json())
    log = tmp_path / "run.jsonl"
    assert main(["train", str(bundle), "--plan", str(plan), "--steps", "3", "--layers", "2", "--runlog", str(log),
                 "--checkpoint-dir", str(tmp_path / "ck"), "--threads", "1"]) == 0  # one thread a rank
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["job.json", "step-00000003"]  # EP checkpoints too
    runs, skipped = read_runs(log)
    assert not skipped and len(runs) == 1
    run = runs[0]
    assert run.hardware["devices"] == 2 and run.plan["ep"] == 2
    for s in run.steps:  # both ranks' tokens: 2 ranks x 2 sequences x 32 tokens, top-2
        assert [sum(layer) for layer in s["expert_tokens"]] == [2 * 2 * 32 * 2] * 2
        assert s["comm_time_s"] > 0


def test_train_sh_runs_on_several_nodes_and_train_slurm_starts_it_there(tmp_path):
    """A plan of 16 processes: train.sh alone runs them on this node; with NNODES=2 (as train.slurm exports it
    from Slurm's variables) it hands torchrun a c10d rendezvous at MASTER_ADDR and 8 processes per node. The
    torchrun on PATH here is a stand-in that prints its arguments (no cluster is reachable from this machine)."""
    from onboard.bundle.launcher import write_launcher

    write_launcher(tmp_path, Plan(dp_shard=16))
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "torchrun").write_text("#!/usr/bin/env bash\necho \"$@\"\n")
    (fake / "torchrun").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}
    for script in ("train.sh", "train.slurm"):
        assert subprocess.run(["bash", "-n", str(tmp_path / script)]).returncode == 0
        assert os.access(tmp_path / script, os.X_OK)
    alone = subprocess.run([str(tmp_path / "train.sh"), "--steps", "3"], env=env, capture_output=True, text=True)
    assert alone.stdout.startswith("--standalone --nproc-per-node=16 -m runtime.train") and "--steps 3" in alone.stdout
    nodes = subprocess.run([str(tmp_path / "train.sh")], capture_output=True, text=True,
                           env={**env, "NNODES": "2", "MASTER_ADDR": "node-a", "RDZV_ID": "42"})
    assert nodes.stdout.startswith("--nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=node-a:29500 "
                                   "--rdzv-id=42 -m runtime.train --model onboard.train:build_model")
    odd = subprocess.run([str(tmp_path / "train.sh")], capture_output=True, text=True, env={**env, "NNODES": "3"})
    assert odd.returncode == 2 and "do not split over 3 nodes" in odd.stderr
    slurm = (tmp_path / "train.slurm").read_text()
    assert "#SBATCH --nodes=2" in slurm and "#SBATCH --gpus-per-node=8" in slurm
    assert "srun --kill-on-bad-exit=1 ./train.sh" in slurm


EXTEND_JOB = """
import dataclasses, json, os
from runtime.train import loop
import runtime.train.job as job

Wider = dataclasses.make_dataclass("TrainJob", [("warmup_steps", int, job.option(
    0, "steps of learning-rate warm-up (a field this test adds)", kind="non_negative"))], bases=(job.TrainJob,))
job.TrainJob = Wider
original = loop.train


def train(factory, plan, cfg):
    out = os.environ["ONBOARD_TEST_SEEN"] + f"-{os.environ.get('RANK', '0')}.json"
    with open(out, "w") as f:
        json.dump({"type": type(cfg).__name__, "warmup_steps": getattr(cfg, "warmup_steps", None)}, f)
    return original(factory, plan, cfg)


loop.train = train
"""


@pytest.mark.multiprocess
def test_a_field_added_to_the_job_reaches_every_rank_through_torchrun(bundle, tmp_path):
    """An option is one field: added to TrainJob (here by a sitecustomize every process of the run imports), it is
    an `onboard train` option, it goes into job.json, and each rank torchrun starts trains with it."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(EXTEND_JOB)
    plan = tmp_path / "plan.json"
    plan.write_text(_plan(dp_shard=2).to_json())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{ROOT}",
           "ONBOARD_TEST_SEEN": str(tmp_path / "seen")}
    done = subprocess.run([sys.executable, str(ROOT / "cli.py"), "train", str(bundle), "--plan", str(plan),
                           "--steps", "1", "--warmup-steps", "7", "--checkpoint-dir", str(tmp_path / "ck"),
                           "--runlog", str(tmp_path / "run.jsonl")], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    seen = [json.loads((tmp_path / f"seen-{rank}.json").read_text()) for rank in (0, 1)]
    assert seen == [{"type": "TrainJob", "warmup_steps": 7}] * 2
    assert json.loads((tmp_path / "ck" / "job.json").read_text())["warmup_steps"] == 7
