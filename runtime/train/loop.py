"""The training loop: AdamW, gradient clipping and accumulation, memory policies, checkpoints, run logs.

`train(factory, plan, config)` builds the model on every rank (same seed, so the same weights), applies
the plan's recompute and offload policies, and trains `config.steps` optimizer steps, resuming from the newest
checkpoint in `config.checkpoint_dir` when there is one. Under torchrun (WORLD_SIZE > 1) it joins the
process group and hands the model to `runtime.parallel` (LoRA, expert parallelism, FSDP2, whose gradient
reduction overlaps backward). Rank 0 writes the run log and draws the progress bar.

`comm_time_s` in the run log is the time blocked on communication: the collectives the loop itself waits
for (the gradient-norm and statistics all-reduces) plus the expert-parallel exchanges' blocked time that
`runtime.parallel` measures; FSDP2's all-gathers and reduce-scatters overlap compute and are not separated.

The model contract is a HuggingFace causal LM: `model(input_ids=..., labels=..., use_cache=False).loss`, and for
packed documents also `position_ids` and the `cu_seq_lens_*` / `max_length_*` keywords (`data.model_inputs`).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from runtime.sequence_split import running
from runtime.dims import Dims
from runtime.memory import ActivationOffload, apply_recompute
from runtime.plan import Plan
from runtime.runlog import RunLogWriter
from runtime.train import checkpoint, data
from runtime.train.job import FILE as JOB_FILE
from runtime.train.job import TrainJob
from runtime.train.optimizer import AdamW


@dataclass
class StepResult:
    step: int
    loss: float
    step_time_s: float
    tokens_per_s: float
    peak_memory_bytes: int
    comm_time_s: float
    expert_tokens: list
    peak_memory_bytes_by_rank: list | None = None


@dataclass
class TrainResult:
    steps: list[StepResult]
    resumed_from: int | None  # the checkpoint step this run started from
    run_id: str | None


def _init_distributed() -> tuple[int, int, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    return rank, (dist.get_world_size() if dist.is_initialized() else 1), device


def reset_peak_memory(device: torch.device) -> None:
    """Start a new high-water mark, so that several runs in one process each report their own peak."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: reset VmHWM, the peak resident set size, to the current one
    except OSError:
        pass


def peak_memory_bytes(device: torch.device) -> int:
    """Peak device memory (cuda) or peak resident set (cpu) since the last `reset_peak_memory`."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def hardware(device: torch.device, world: int) -> dict:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
        except OSError:
            pass
    return {"name": name, "devices": world, "device_type": device.type, "threads": torch.get_num_threads()}


def _clip(model: nn.Module, params: list, mesh, max_norm: float) -> None:
    if mesh is not None and mesh.dense is not None:
        # gradients live on several meshes (data-parallel shards, tp splits, expert slices): the parallel layer
        # weighs each piece by how many ranks hold it
        from runtime.parallel.grads import clip_grad_norm_

        clip_grad_norm_(model, mesh, max_norm)
    else:
        nn.utils.clip_grad_norm_(params, max_norm, foreach=False)


def _data_source(path: str | None, cfg: TrainJob, plan: Plan, vocab: int | None):
    if path and Path(path).is_dir():
        return data.PackedCorpus.open(path, plan.seq_len, vocab)
    if path:
        return data.TokenFile(path, plan.seq_len, vocab)
    if not vocab:
        raise ValueError("synthetic tokens need the model's vocabulary size (model.config.vocab_size)")
    return data.SyntheticTokens(vocab, plan.seq_len, cfg.seed)


def _on(inputs: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _evaluate(model, source, plan: Plan, cfg: TrainJob, dp_rank: int, world: int, device, autocast,
              pipeline=None, mesh=None) -> tuple[float, int]:
    """(mean loss over the held-out target tokens of every rank, their count): `cfg.eval_batches` micro-batches
    per rank (under a pipeline, rounded up to whole schedules), each window read once (they are indexed as the
    micro-steps of one step)."""
    model.eval()
    count = cfg.eval_batches if pipeline is None else -(-cfg.eval_batches // plan.grad_accum) * plan.grad_accum
    batches = _micro_batches(source, 0, dp_rank, plan, device, count)
    targets = [int((inputs["labels"][..., 1:] != -100).sum()) for inputs in batches]
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad(), autocast:
        if pipeline is None:
            losses = []
            for inputs in batches:
                split, inputs = _split(inputs, mesh)
                with running(split):
                    losses.append(float(model(**inputs, use_cache=False).loss))
        else:
            splits, local = zip(*(_split(inputs, mesh) for inputs in batches))
            losses = [loss for i in range(0, count, plan.grad_accum)
                      for loss in pipeline.evaluate(list(local[i:i + plan.grad_accum]),
                                                    list(splits[i:i + plan.grad_accum]))]
    if losses:  # a pipeline's loss is on its last stage
        total += torch.tensor([sum(a * n for a, n in zip(losses, targets)), sum(targets)], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(total)
        # the ranks of a tp group read the same tokens; so do a cp group's, each loss cp x its part of the mean
        total /= plan.tp * plan.cp
    model.train()
    return float(total[0] / total[1].clamp_min(1)), int(total[1])


def check_outputs(cfg: TrainJob) -> None:
    """Where the run will write, checked before anything is built: a run never trains to the end only to find
    it cannot save."""
    from runtime.train.export import check_target

    for place in (cfg.export_hf, cfg.export_peft):
        if place:
            check_target(place)
    places = (("checkpoint directory", cfg.checkpoint_dir, True), ("offload directory", cfg.offload_dir, True),
              ("run log", cfg.runlog, False))
    for what, place, is_dir in places:
        if not place:
            continue
        place = Path(place)
        if is_dir and place.exists() and not place.is_dir():
            raise ValueError(f"the {what} {place} is a file")
        if not is_dir and place.is_dir():
            raise ValueError(f"the {what} {place} is a directory; give a file")
        folder = place if is_dir else place.parent
        existing = next((f for f in (folder, *folder.parents) if f.exists()), None)
        if existing is not None and not existing.is_dir():
            raise ValueError(f"cannot write the {what} under {existing}: it is a file")
        if existing is not None and not os.access(existing, os.W_OK):
            raise ValueError(f"cannot write the {what} under {existing}: permission denied")


def _record_job(cfg: TrainJob, plan: Plan, rank: int) -> None:
    """job.json in the checkpoint folder: this job, plan included. Where the folder holds checkpoints of an earlier
    job, the options that decided their steps (`job.RESUME_FIXED`) must be the same: a resumed run continues that
    run, it does not quietly become another."""
    if not cfg.checkpoint_dir:
        return
    folder = Path(cfg.checkpoint_dir)
    here = dataclasses.replace(cfg, plan=plan.to_dict())
    saved, _ = checkpoint.newest(folder, cfg.trust_checkpoint)
    if saved and cfg.steps <= saved[0]:
        return  # nothing left to train (an export resumes to write): the record stays the training run's
    if saved and (folder / JOB_FILE).is_file():
        conflicts = here.resume_conflicts(TrainJob.load(folder / JOB_FILE))
        if conflicts:
            raise ValueError(f"{folder} holds checkpoints of a job with {conflicts[0]}: resume with its options, or "
                             f"train into another checkpoint folder")
    if rank == 0:
        here.write(folder)


def _unpack(built) -> tuple[nn.Module, dict, object | None]:
    """A factory returns a model, (model, run-log record) or (model, record, `runtime.train.weights.Pretrained`)
    for a model built on the meta device whose weights the loop reads once it is parallelised."""
    if not isinstance(built, tuple):
        return built, {}, None
    return built[0], built[1], built[2] if len(built) > 2 else None


def train(factory: Callable[[], nn.Module | tuple], plan: Plan, cfg: TrainJob) -> TrainResult:
    check_outputs(cfg)
    from runtime.parallel.runnable import not_runnable

    if problems := not_runnable(plan):
        raise ValueError(f"the plan cannot run: {'; '.join(problems)}")
    if (cfg.rebalance_every or cfg.expert_replicas) and plan.ep == 1:
        raise ValueError("rebalancing places experts on expert-parallel ranks: the plan has ep=1")
    if cfg.rebalance_every < 0 or cfg.expert_replicas < 0:
        raise ValueError("rebalance_every and expert_replicas must not be negative")
    if plan.pp > 1 and (cfg.export_hf or cfg.export_peft):
        raise ValueError("exports gather the whole model, which pipeline stages hold in parts: export from a "
                         "checkpoint of this run with pp=1 (not built: gathering across stages)")
    rank, world, device = _init_distributed()
    if world != plan.world_size:
        raise ValueError(f"the plan lays out {plan.world_size} processes, and {world} were started")
    _record_job(cfg, plan, rank)
    torch.manual_seed(cfg.seed)  # every rank builds the same initial weights
    model, record, pretrained = _unpack(factory())
    if (plan.tp > 1 or plan.cp > 1) and record and (problems := not_runnable(plan, Dims.from_record(record))):
        raise ValueError(f"the plan cannot run on this model: {'; '.join(problems)}")  # as the planner said
    vocab = record.get("vocab") or getattr(getattr(model, "config", None), "vocab_size", None)
    if pretrained is None:
        model.to(device)
        if world > 1:
            with torch.no_grad():  # same start on every rank even if a factory drew weights differently
                for p in model.parameters():
                    dist.broadcast(p.data, 0)
    model.train()
    # every MoE layer's (path, experts), taken before a pipeline stage keeps only its own: the run log's counts
    slots = [(name, m.num_experts) for name, m in model.named_modules() if hasattr(m, "tokens_per_expert")]
    mesh = pipeline = None
    if world > 1 or plan.lora is not None:
        from runtime.parallel import build_mesh, parallelize
        from runtime.parallel.api import mixed_precision

        mesh = build_mesh(plan)
        precision = mixed_precision(plan, device.type) if world > 1 else None
        # LoRA, expert parallelism, FSDP2 (gradient reduction included; bf16 compute on an accelerator)
        model = parallelize(model, plan, mesh, precision=precision, expert_spare=cfg.expert_replicas)
        if plan.pp > 1:
            from runtime.parallel.pipeline import Pipeline

            pipeline = Pipeline(model, plan, mesh, device, torch.bfloat16 if precision is not None else torch.float32)
    if pretrained is not None:  # built on the meta device: allocate this rank's shards, then read into them
        shared = pretrained.shared_slots(model)
        model.to_empty(device=device)
        pretrained.tie(shared)
        loaded = pretrained.load(model)
        cfg.run_meta = {**cfg.run_meta, "weights": str(pretrained.checkpoint.directory),
                        "weights_bytes": loaded["bytes"]}
    apply_recompute(model, plan.recompute)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    resumed = (checkpoint.load_latest(cfg.checkpoint_dir, model, optimizer, trust=cfg.trust_checkpoint)
               if cfg.checkpoint_dir else None)
    for path, why in (resumed or {}).get("skipped", []):
        if rank == 0:
            print(f"resume: skipped {path}: {why}", file=sys.stderr, flush=True)
    start = resumed["step"] if resumed else 0
    source = _data_source(cfg.data, cfg, plan, vocab)
    held_out = _data_source(cfg.eval_data, cfg, plan, vocab) if cfg.eval_data else None
    offload = ActivationOffload(plan.offload, device=device, offload_dir=cfg.offload_dir)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" and plan.dtype == "bf16" \
        else torch.autocast(device.type, enabled=False)
    writer = None
    if rank == 0 and cfg.runlog:
        meta = {**cfg.run_meta, "resumed_from": start if resumed and resumed["path"] else None, "steps": cfg.steps,
                "skipped_checkpoints": [why for _, why in (resumed or {}).get("skipped", [])]}
        writer = RunLogWriter(cfg.runlog, model=record, plan=plan.to_dict(), hardware=hardware(device, world),
                              precision="bf16" if device.type == "cuda" and plan.dtype == "bf16" else "fp32",
                              meta=meta)
    bar = None
    if rank == 0 and cfg.progress and start < cfg.steps:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start, unit="step", dynamic_ncols=True, leave=False)
    dp_rank = mesh.dp_rank if mesh is not None else 0  # which slice of each batch this rank reads
    here = dict(model.named_modules())
    blocks = {name: here[name] for name, _ in slots if name in here}  # this rank's (its pipeline stage's)
    results = []
    balance = ExpertBalance(slots, blocks, plan, cfg, optimizer)
    reset_peak_memory(device)
    try:
        for step in range(start, cfg.steps):
            results.append(_step(step, model, optimizer, params, mesh, plan, cfg, source, offload, autocast, slots,
                                 blocks, pipeline, dp_rank, world, device))
            r = results[-1]
            if writer:
                writer.step(step, step_time_s=r.step_time_s, tokens_per_s=r.tokens_per_s,
                            peak_memory_bytes=r.peak_memory_bytes, loss=r.loss, expert_tokens=r.expert_tokens,
                            comm_time_s=r.comm_time_s, peak_memory_bytes_by_rank=r.peak_memory_bytes_by_rank,
                            expert_placement=balance.logged())
            balance.measured(step + 1, r.expert_tokens)
            if bar:
                bar.update(1)
                bar.set_postfix(loss=f"{r.loss:.4f}", tok_s=f"{r.tokens_per_s:,.0f}")
            done = step + 1
            if held_out is not None and (done == cfg.steps or (cfg.eval_every and done % cfg.eval_every == 0)):
                loss, tokens = _evaluate(model, held_out, plan, cfg, dp_rank, world, device, autocast, pipeline,
                                         mesh)
                if writer:
                    writer.eval(done, loss=loss, tokens=tokens)
            if cfg.checkpoint_dir and (done == cfg.steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0)):
                checkpoint.save(cfg.checkpoint_dir, done, model, optimizer, keep=cfg.keep_checkpoints,
                                data_position=data.sequence_index(done, 0, 0, 0, grad_accum=plan.grad_accum,
                                                                  dp=plan.dp, micro_batch=plan.micro_batch))
        if cfg.export_hf or cfg.export_peft:
            _export(model, pretrained, cfg)
    finally:
        offload.close()
        if bar:
            bar.close()
        if writer:
            writer.close()
    return TrainResult(results, start if resumed and resumed["path"] else None, writer.run_id if writer else None)


def _export(model, pretrained, cfg: TrainJob) -> None:
    from runtime.train.export import export_hf, export_peft

    if pretrained is None:
        raise ValueError("exports need the model's released weights (its config and key names): train with them")
    model.eval()
    if cfg.export_peft:
        export_peft(model, pretrained, cfg.export_peft)
    if cfg.export_hf:
        export_hf(model, pretrained, cfg.export_hf)
    model.train()


def _split(inputs: dict, mesh) -> tuple[object | None, dict]:
    """(this rank's context-parallel split, its model inputs); (None, inputs) without context parallelism."""
    if mesh is None or mesh.cp_group is None:
        return None, inputs
    from runtime.parallel.context_split import split_inputs

    return split_inputs(inputs, mesh.cp_group)


def _micro_batches(source, step: int, dp_rank: int, plan: Plan, device, count: int) -> list[dict]:
    """This rank's `count` micro-batches of a step (every rank of a tp group and of a pipeline reads the same)."""
    return [_on(data.model_inputs(source, step, micro, dp_rank, grad_accum=count, dp=plan.dp,
                                  micro_batch=plan.micro_batch), device) for micro in range(count)]


def _step(step, model, optimizer, params, mesh, plan, cfg, source, offload, autocast, slots, blocks, pipeline, dp_rank,
          world, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    micro_batches = _micro_batches(source, step, dp_rank, plan, device, plan.grad_accum)
    counts: dict[str, torch.Tensor] = {}
    if pipeline is not None:
        pipeline.expert_tokens.clear()
        splits, micro_batches = zip(*(_split(inputs, mesh) for inputs in micro_batches))
        with offload, autocast:
            loss_sum = torch.tensor(pipeline.step(list(micro_batches), list(splits)), dtype=torch.float64)
        counts = pipeline.expert_tokens
    else:
        loss_sum = torch.zeros((), dtype=torch.float64)
        for inputs in micro_batches:
            split, inputs = _split(inputs, mesh)
            with running(split):  # the backward too: a recomputed layer runs its forward again in it
                with offload, autocast:
                    loss = model(**inputs, use_cache=False).loss / plan.grad_accum
                loss.backward()
            loss_sum += loss.detach().double().cpu()
            for name, block in blocks.items():
                counted = block.tokens_per_expert
                if counted is not None:
                    counts[name] = counts.get(name, 0) + counted.double().cpu()
    if cfg.expert_replicas:  # each hot expert's copies computed parts of its tokens: their gradients add up
        from runtime.parallel.rebalance import sum_replica_grads

        sum_replica_grads(model)
    comm = 0.0
    if cfg.clip:
        t = time.perf_counter()
        _clip(model, params, mesh, cfg.clip)
        comm += time.perf_counter() - t if world > 1 else 0.0  # the norm's all-reduce dominates it
    optimizer.step()
    for block in blocks.values():  # time blocked on expert-parallel token exchanges (what overlap did not hide)
        clock = getattr(getattr(block, "expert_parallel", None), "comm", None)
        if clock is not None:
            comm += clock.reset()
    # every MoE layer of the model in one vector (a pipeline stage fills its own layers'), summed over the world,
    # then each rank's peak memory in its own place
    peaks = torch.zeros(world, dtype=torch.float64)
    peaks[dist.get_rank() if world > 1 else 0] = peak_memory_bytes(device)
    stats = torch.cat([loss_sum.reshape(1), *(torch.as_tensor(counts.get(name, torch.zeros(size)),
                                                              dtype=torch.float64).reshape(size)
                                              for name, size in slots), peaks])
    if world > 1:
        t = time.perf_counter()
        dist.all_reduce(stats)
        comm += time.perf_counter() - t
        stats[0] /= world // plan.pp  # the last stage's ranks hold the loss (every rank without a pipeline)
        stats[1:-world] /= plan.tp  # the ranks of a tp group route the same tokens
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0
    expert_tokens, offset = [], 1
    for _, size in slots:
        expert_tokens.append([int(v) for v in stats[offset:offset + size].tolist()])
        offset += size
    return StepResult(step, float(stats[0]), elapsed, plan.tokens_per_step / elapsed, peak_memory_bytes(device),
                      comm, expert_tokens, [int(v) for v in stats[-world:].tolist()])


class ExpertBalance:
    """Every `cfg.rebalance_every` steps, a new placement of each MoE layer's experts from the tokens its experts
    received since the last one (the all-reduced counts every rank has, so every rank computes the same), applied
    to this rank's layers (`runtime.parallel.rebalance`) where it lowers the busiest rank's load by MIN_GAIN or
    more. Keeps what each layer's placement is for the run log."""

    MIN_GAIN = 0.05

    def __init__(self, slots, blocks, plan: Plan, cfg: TrainJob, optimizer):
        self.slots, self.blocks, self.plan, self.cfg, self.optimizer = slots, blocks, plan, cfg, optimizer
        self.window = [[0] * size for _, size in slots]
        # what each layer's placement is: this rank's layers say (a resumed run restored theirs); the others
        # (other pipeline stages) are known from the first rebalance on
        self.placements = {name: getattr(getattr(blocks.get(name), "expert_parallel", None), "placement", None)
                           for name, _ in slots}

    def logged(self) -> list | None:
        """Per MoE layer: its placement (dict) where experts are not in the static layout, else null."""
        if not self.cfg.expert_replicas and not self.cfg.rebalance_every:
            return None
        return [p.to_dict() if p is not None and not (p.is_contiguous and not p.spare) else None
                for p in self.placements.values()]

    def measured(self, done: int, expert_tokens: list) -> None:
        if not self.cfg.rebalance_every or self.plan.ep == 1:
            return
        for window, counts in zip(self.window, expert_tokens):
            for e, n in enumerate(counts):
                window[e] += n
        if done % self.cfg.rebalance_every or done >= self.cfg.steps:
            return
        from runtime.moe.placement import Placement, imbalance, place
        from runtime.parallel.rebalance import apply_placement

        for (name, size), window in zip(self.slots, self.window):
            chosen = place(window, self.plan.ep, self.cfg.expert_replicas)
            current = self.placements[name] or Placement.contiguous(size, self.plan.ep, self.cfg.expert_replicas)
            # moving costs a collective per tensor and replicas cost their exchange: only for a real gain
            if imbalance(window, chosen) > imbalance(window, current) * (1 - self.MIN_GAIN):
                continue
            self.placements[name] = chosen
            block = self.blocks.get(name)
            if block is not None and getattr(block, "expert_parallel", None) is not None:
                apply_placement(block, self.placements[name], self.optimizer)
        self.window = [[0] * size for _, size in self.slots]
