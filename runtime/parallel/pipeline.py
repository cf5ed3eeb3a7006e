"""Pipeline parallelism: the decoder stack cut into `pp` stages, run by torch.distributed.pipelining's schedules.

    stages = stage_layers(plan, num_layers)          # layer ranges, plan.pp_layers (the planner's cost balance)
    check_stages(model, stages)                     # one process, before cutting: the stages reproduce the loss
    stage = cut(model, stages, pp_rank)             # this rank keeps its layers (and the embedding / the head)
    pipe = Pipeline(model, stage, plan, mesh, device)
    loss = pipe.step(micro_batches)                 # forward and backward of every micro-batch, 1F1B or GPipe

Every stage runs the HuggingFace model's own code, so whatever a family does between its layers (masks for
each layer type, rotary tables, per-layer position handling) happens as it does unsplit:

- stage 0 runs the decoder from `input_ids` with the later layers and the final norm passed through, and sends
  the hidden states;
- a middle stage runs the decoder from `inputs_embeds` (the received hidden states), its own layers only;
- the last stage runs the causal LM from `inputs_embeds` with the labels, so the loss is the runtime's chunked
  loss (the logits never exist), and returns it as the stage's output.

That is exact only when the decoder does nothing to `inputs_embeds` before its first layer (Gemma scales them)
and the loss needs nothing from other stages (a router-balance loss sums over every layer), which is why
`check_stages` runs the stages in sequence in one process and compares the loss with the model's before any
rank cuts anything. Tied input and output embeddings sit on the first and the last stage: refused.

The modules a stage does not run are replaced by parameter-free stand-ins (layers and the norm pass their input
through; the embedding and the head refuse to run), so the optimizer, FSDP2 and checkpoints see the stage's
parameters only, under the full model's names: the stages' checkpoints together are the whole model's. Every
change to the model is a swap (`runtime.swap`, kind PIPELINE): the stand-ins `cut` puts in (its handle is
`Stage.swap`; undone before anything is sharded, the whole model is back), the forwards `check_stages` skips
while it runs one stage, and the entry `Pipeline` gives the model for torch's schedule (`Pipeline.swap`). Each
micro-batch's other inputs (labels, packed-document positions) reach every stage from the data, which every rank
of a pipeline reads alike, rather than through the pipeline. Under context parallelism each micro-batch comes with
its split (`runtime.parallel.context_split`), under which the stage runs its forward; the backward needs none (what
crosses the cp ranks is recorded in the autograd graph), except a recomputed layer's, which is not built.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from runtime.model_tree import Vacated, find_layer_stack
from runtime.plan import Plan
from runtime.sequence_split import running
from runtime.swap import PIPELINE, Swap

_STAGE = "pipeline_stage"  # the attribute `cut` sets on a model (read by `stage_of` only)

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}  # runtime.plan.PP_SCHEDULES, by name


def stage_layers(plan: Plan, num_layers: int) -> list[range]:
    """The decoder layers of each stage: plan.pp_layers when the planner balanced them, else an even split (the
    first stages one layer longer when pp does not divide the layers). ValueError when they do not fit."""
    counts = plan.pp_layers
    if counts is None:
        base, extra = divmod(num_layers, plan.pp)
        counts = [base + (i < extra) for i in range(plan.pp)]
    if len(counts) != plan.pp or sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(f"pipeline stages of {counts} layers do not cover the model's {num_layers} layers with "
                         f"pp={plan.pp} non-empty stages")
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [range(a, a + n) for a, n in zip(starts, counts)]


@dataclass
class Parts:
    """Where the pieces a stage keeps or drops live in the model."""
    layers: str  # the decoder layer stack (ModuleList)
    decoder: str  # the module whose forward runs the stack (it takes input_ids or inputs_embeds)
    norm: str | None  # the decoder's child whose output is its last hidden state (None: there is none)
    hidden: int = 0  # the width of the hidden states stages send each other


@dataclass
class Stage:
    index: int
    num_stages: int
    layers: range
    parts: Parts
    swap: Swap | None = field(default=None, repr=False, compare=False)  # what `cut` changed

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1


def stage_of(model: nn.Module) -> Stage | None:
    """The stage `cut` left `model` as, or None for a whole model."""
    return getattr(model, _STAGE, None)


def _passthrough(*args, **kwargs):
    return args[0] if args else kwargs["hidden_states"]


class _PassThrough(Vacated):
    """A layer (or the final norm) another stage runs: returns its input. Keeps the plain attributes of the module
    it stands for (a layer's attention type, its index), which the decoder's loop may read."""

    def __init__(self, replaced: nn.Module):
        super().__init__()
        for key, value in vars(replaced).items():
            if not key.startswith("_") and not isinstance(value, (nn.Module, torch.Tensor)) and key != "training":
                setattr(self, key, value)

    def forward(self, *args, **kwargs):
        return _passthrough(*args, **kwargs)


class _Elsewhere(Vacated):
    """The embedding or the LM head on a stage that does not hold it."""

    def __init__(self, what: str):
        super().__init__()
        self.what = what

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"the {self.what} lives on another pipeline stage")


def _path_of(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def _stand_in(swap: Swap, model: nn.Module, path: str, module: nn.Module) -> None:
    """`module` where the module at `path` was; stand-ins run no runtime code, so nothing counts their calls."""
    owner, _, name = path.rpartition(".")
    swap.set(model.get_submodule(owner) if owner else model, name, module)


def find_parts(model: nn.Module) -> Parts:
    """The layer stack, the decoder that runs it and its final norm, found by a forward pass of `model` (the norm
    is the decoder's child that writes the decoder's output)."""
    layers, _ = find_layer_stack(model, getattr(getattr(model, "config", None), "num_hidden_layers", None))
    decoder = layers.rpartition(".")[0]
    decoder_module = model.get_submodule(decoder) if decoder else model
    made, out = {}, {}
    hooks = [child.register_forward_hook(lambda m, a, o, n=name: made.setdefault(n, o))
             for name, child in decoder_module.named_children()]
    hooks.append(decoder_module.register_forward_hook(lambda m, a, o: out.setdefault("state", o)))
    try:
        with torch.no_grad():
            model(**_probe_inputs(model))
    finally:
        for h in hooks:
            h.remove()
    state = getattr(out.get("state"), "last_hidden_state", None)
    norm = next((name for name, o in made.items() if o is state), None)
    return Parts(layers, decoder, f"{decoder}.{norm}" if decoder and norm else norm,
                 state.shape[-1] if isinstance(state, torch.Tensor) else 0)


def _probe_inputs(model: nn.Module) -> dict:
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    ids = ids.to(next(model.parameters()).device)
    return {"input_ids": ids, "labels": ids, "use_cache": False}


def run_stage(model: nn.Module, stage: Stage, x: torch.Tensor, inputs: dict, forward=None) -> torch.Tensor:
    """One stage's forward on one micro-batch: hidden states out (the loss on the last stage, computed by
    `forward`, default the model's: the runtime's loss where a swap gave the model one)."""
    kwargs = {k: v for k, v in inputs.items() if k not in ("input_ids", "labels", "use_cache")}
    kwargs["input_ids" if stage.first else "inputs_embeds"] = x
    if stage.last:
        return (forward or model.forward)(labels=inputs["labels"], use_cache=False, **kwargs).loss
    decoder = model.get_submodule(stage.parts.decoder) if stage.parts.decoder else model
    return decoder(use_cache=False, **kwargs).last_hidden_state


def _skipping(modules: list[nn.Module]) -> Swap:
    """A swap (undone on leaving a `with` block) whose modules pass their input through."""
    swap = Swap(PIPELINE)
    for m in modules:
        swap.set(m, "forward", _passthrough)
    return swap


def check_stages(model: nn.Module, stages: list[range], parts: Parts | None = None) -> Parts:
    """Run the stages one after another in this process and compare the loss with the whole model's; returns the
    parts. ValueError when pipelining this model would change its numbers (or cannot run it)."""
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("pipeline parallelism checks its stages with a forward pass, which a model on the meta device "
                         "(released weights, read after parallelising) cannot run yet")
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is not None and head.weight is embed.weight:
        raise ValueError("pipeline parallelism: the input and output embeddings are tied, and they sit on the "
                         "first and the last stage; tied embeddings across stages are not built")
    parts = parts or find_parts(model)
    if parts.norm is None:
        raise ValueError("pipeline parallelism: no module of the decoder writes its last hidden state")
    inputs = _probe_inputs(model)
    stack = model.get_submodule(parts.layers)
    with torch.no_grad():
        want = model(**inputs).loss
        x = inputs["input_ids"]
        for i, layers in enumerate(stages):
            stage = Stage(i, len(stages), layers, parts)
            skipped = [layer for j, layer in enumerate(stack) if j not in layers]
            if not stage.last:
                skipped.append(model.get_submodule(parts.norm))
            try:
                with _skipping(skipped):
                    x = run_stage(model, stage, x, inputs)
            except Exception as exc:  # noqa: BLE001 - whatever the family's code raises, said in one line
                raise ValueError(f"pipeline parallelism: stage {i} does not run on its own: "
                                 f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
    if not torch.allclose(x, want, rtol=1e-5, atol=1e-6):
        raise ValueError(f"pipeline parallelism: the stages compute loss {x.item():.6g}, the model {want.item():.6g} "
                         f"(its decoder changes inputs_embeds before the first layer, or its loss reads every layer)")
    return parts


def cut(model: nn.Module, stages: list[range], index: int, parts: Parts) -> Stage:
    """Keep stage `index` of `model` (in place): other stages' layers, and the embedding, final norm and head where
    this stage does not run them, become parameter-free stand-ins."""
    stage = Stage(index, len(stages), stages[index], parts, Swap(PIPELINE, f"stage {index}"))
    stack = model.get_submodule(parts.layers)
    for j in range(len(stack)):
        if j not in stage.layers:
            stage.swap.set(stack, str(j), _PassThrough(stack[j]))
    if not stage.first:
        _stand_in(stage.swap, model, _path_of(model, model.get_input_embeddings()), _Elsewhere("embedding"))
    if not stage.last:
        _stand_in(stage.swap, model, parts.norm, _PassThrough(model.get_submodule(parts.norm)))
        head = model.get_output_embeddings()
        if head is not None:
            _stand_in(stage.swap, model, _path_of(model, head), _Elsewhere("LM head"))
    stage.swap.set(model, _STAGE, stage)
    return stage


class Pipeline:
    """The schedule of one rank's stage: `step` runs forward and backward of every micro-batch of a step."""

    def __init__(self, model: nn.Module, plan: Plan, mesh, device: torch.device, dtype: torch.dtype = torch.float32):
        self.model, self.stage = model, stage_of(model)
        if self.stage is None:
            raise ValueError("the model was not cut into pipeline stages (runtime.parallel.parallelize does it)")
        if plan.pp_schedule not in SCHEDULES:
            raise ValueError(f"pipeline schedule {plan.pp_schedule!r} is not one of {', '.join(SCHEDULES)}")
        self.plan, self.group, self.device, self.dtype = plan, mesh.pp.get_group(), device, dtype
        self.inputs: deque = deque()
        self.micro = plan.grad_accum
        self.schedules: dict[tuple, object] = {}  # by the shape of a micro-batch's input_ids
        self.pipe_stages: dict[tuple, PipelineStage] = {}  # torch's stage object of each schedule
        self.expert_tokens: dict[str, torch.Tensor] = {}
        # the routing modules this stage runs, found once rather than per micro-batch
        self.routers = [(name, m) for name, m in model.named_modules() if hasattr(m, "tokens_per_expert")]
        # the forward the last stage computes its loss with: the model's own (the runtime's loss swap, or the
        # class's), which the entry below hides from everything else
        self.underneath = model.forward
        self.swap = Swap(PIPELINE, "forward")  # PipelineStage calls the model: its FSDP2 hooks run, then this
        self.swap.set(model, "forward", self._forward)

    def _schedule(self, ids_shape: torch.Size):
        """The schedule for micro-batches of `ids_shape` (rows of sequences, or a packed row of them end to end).
        What a stage receives and sends is given rather than inferred: inference would run the model on meta
        tensors and take micro-batch inputs meant for the real run."""
        key = tuple(ids_shape)
        if key not in self.schedules:
            hidden = torch.empty(*key, self.stage.parts.hidden, dtype=self.dtype, device="meta",
                                 requires_grad=True)  # received hidden states carry their gradient back
            ids = torch.empty(*key, dtype=torch.long, device="meta")
            stage = PipelineStage(self.model, self.stage.index, self.stage.num_stages, self.device,
                                  input_args=ids if self.stage.first else hidden,
                                  output_args=torch.empty((), device="meta") if self.stage.last else hidden,
                                  group=self.group)
            self.pipe_stages[key] = stage
            self.schedules[key] = SCHEDULES[self.plan.pp_schedule](stage, n_microbatches=self.micro,
                                                                    loss_fn=self._loss, scale_grads=True)
        return self.schedules[key]

    @staticmethod
    def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return output  # the last stage's output is its micro-batch's loss already

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        self.swap.count("micro_batch")
        inputs, split = self.inputs.popleft()
        with running(split):
            out = run_stage(self.model, self.stage, x, inputs, self.underneath)
        if torch.is_grad_enabled():  # a micro-batch's routing, counted once (recompute does not come through here)
            for name, m in self.routers:
                counts = m.tokens_per_expert
                if counts is not None:
                    self.expert_tokens[name] = self.expert_tokens.get(name, 0) + counts.detach().double().cpu()
        return out

    def evaluate(self, micro_batches: list[dict], splits: list | None = None) -> list[float]:
        """The loss of each micro-batch, forward only (on the last stage; an empty list on the others); `splits`:
        each micro-batch's context-parallel split (None: whole sequences)."""
        self.inputs.extend(zip(micro_batches, splits or [None] * len(micro_batches)))
        ids = torch.cat([m["input_ids"] for m in micro_batches])
        losses: list = []
        self._schedule(micro_batches[0]["input_ids"].shape).eval(
            *([ids] if self.stage.first else []), target=ids if self.stage.last else None, losses=losses,
            return_outputs=False)  # the outputs are the losses (scalars, which torch would concatenate)
        self.inputs.clear()
        return [float(loss) for loss in losses] if self.stage.last else []

    def step(self, micro_batches: list[dict], splits: list | None = None) -> float:
        """Forward and backward of the micro-batches (gradients are those of their mean loss); returns the sum of
        their losses over their count on the last stage, 0 on the others. `splits`: as `evaluate`'s."""
        if len(micro_batches) != self.micro:
            raise ValueError(f"the schedule runs {self.micro} micro-batches, got {len(micro_batches)}")
        self.inputs.extend(zip(micro_batches, splits or [None] * len(micro_batches)))
        ids = torch.cat([m["input_ids"] for m in micro_batches])
        losses: list = []
        self._schedule(micro_batches[0]["input_ids"].shape).step(
            *([ids] if self.stage.first else []), target=ids if self.stage.last else None, losses=losses,
            return_outputs=False)
        self.inputs.clear()
        return math.fsum(float(loss) for loss in losses) / self.micro if self.stage.last else 0.0
