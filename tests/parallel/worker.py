"""One rank of the multi-process training checks: for each case, load the pickled adapted model, parallelize
it as the case's plan says, train a few SGD steps on this rank's sequences, and gather the results.

Usage: python worker.py <job.json>, with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set. A case names a
bundle folder (adapter.py, spec.json, the twin's weights and catalogue name), its plan and batch. Many cases run
in one process group (each builds its own mesh) so the interpreters start once. Rank 0 writes, per case:
the mean loss of every step, the first step's gradients, the final parameters and, with LoRA, the adapters
(all full tensors), the expert-parallel trace, the gradient norm and, where the case asks for it, whether
the full state and the adapters survived a save / load round trip into a freshly parallelized copy.
"""

import copy
import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

torch.set_num_threads(1)


def init_lora(model, seed: int) -> None:
    """Random adapters (B included) so every adapter gets a gradient; same values on every rank."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.requires_grad:
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


_PRISTINE: dict = {}


def source_of(name: str):
    """The model a bundle folder names: a catalogue model, or `family:<model_type>`, a transformers family at its
    default config (as `onboard families` inspects them)."""
    from onboard.source import from_config, resolve

    if name.startswith("family:"):
        from onboard.review.families import default_config

        family = name.split(":", 1)[1]
        return from_config(default_config(family), family)
    return resolve(name)


def load_model(folder: str):
    """The adapted twin a bundle folder describes: the catalogue model's twin with the saved weights, put
    through the bundle's adapter.py (as `onboard.bundle.files.load_adapter` loads it). A fresh copy per call."""
    if folder not in _PRISTINE:
        from onboard.bundle.files import load_adapter
        from onboard.train.model import config_of_type, declare_parallel
        from onboard.twin import Twin

        name = (Path(folder) / "model.txt").read_text().strip()
        source = source_of(name)
        deeper = Path(folder) / "layers.txt"  # the twin's first N layers (pipeline stages need several)
        layers = int(deeper.read_text()) if deeper.exists() else None
        twin = Twin.build(source, layers=layers, check=False)
        model = twin.model
        model.load_state_dict(torch.load(Path(folder) / "weights.pt"))
        load_adapter(Path(folder)).adapt(model)
        spec = json.loads((Path(folder) / "spec.json").read_text())
        # what tensor parallelism may split and chunked attention's chunks, as onboard train declares them
        trained = twin.config.to_dict()
        declare_parallel(model, spec, config_of_type(source, trained).to_dict(), trained)
        _PRISTINE[folder] = model.float().train()
    return copy.deepcopy(_PRISTINE[folder])


def prepared(case: dict, plan, mesh, trace=None):
    """A fresh copy of the case's model with LoRA (seeded adapters) and the plan's layout applied."""
    from runtime.lora import apply_lora
    from runtime.parallel import parallelize

    model = load_model(case["model"])
    if case.get("router_loss"):  # HuggingFace adds its load-balancing loss (config.router_aux_loss_coef)
        model.config.output_router_logits = True
    if plan.lora is not None:
        apply_lora(model, plan.lora)
        init_lora(model, case["lora_seed"])
    precision = None
    if case.get("precision") == "bf16":  # FSDP2 mixed precision forced on CPU (runtime.parallel.api.mixed_precision)
        from torch.distributed.fsdp import MixedPrecisionPolicy

        precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return parallelize(model, plan, mesh, trace=trace, precision=precision)


def whole(state: dict, plan) -> dict:
    """A pipeline stage's full tensors merged with every other stage's (each rank of a stage holds them all)."""
    if plan.pp == 1:
        return state
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, state)
    return {k: v for part in parts for k, v in part.items()}


def every(ok: bool) -> bool:
    """Whether `ok` holds on every rank."""
    flag = torch.tensor(int(ok))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag)


def rows_of(ids: torch.Tensor, case: dict) -> list[dict]:
    """The model inputs of each sequence of `ids`: plain (input_ids = labels), or with `case["packed"]` documents
    starting at those offsets (positions restarting at each, no target across a start, packed-sequence bounds), as
    runtime.train.data.model_inputs gives a packed corpus's windows."""
    if not case.get("packed"):
        return [{"input_ids": ids, "labels": ids}]
    starts = case["packed"]
    length = ids.shape[1]
    bounds = torch.tensor([*starts, length], dtype=torch.int32)
    positions = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])])
    rows = []
    for row in ids:
        labels = row.clone()
        labels[starts[1:]] = -100
        rows.append({"input_ids": row[None], "labels": labels[None], "position_ids": positions[None],
                     "cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds,
                     "max_length_q": int((bounds[1:] - bounds[:-1]).max()),
                     "max_length_k": int((bounds[1:] - bounds[:-1]).max())})
    return rows


def run_case(case: dict) -> dict:
    from runtime.sequence_split import running
    from runtime.lora import load_lora_state_dict, lora_state_dict
    from runtime.parallel.context_split import split_inputs
    from runtime.parallel import (
        build_mesh,
        gather_experts,
        grad_norm,
        load_full_state,
        moe_blocks,
    )
    from runtime.plan import Plan

    plan = Plan.from_dict(case["plan"])
    mesh = build_mesh(plan)
    trace: list = []
    model = prepared(case, plan, mesh, trace)
    rows = plan.micro_batch * plan.grad_accum  # this data-parallel rank's sequences
    ids = torch.load(case["batch"])[mesh.dp_rank * rows:(mesh.dp_rank + 1) * rows]
    pipe = None
    if plan.pp > 1:
        from runtime.parallel.pipeline import Pipeline

        pipe = Pipeline(model, plan, mesh, torch.device("cpu"))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=case["lr"])
    out = {"losses": [], "trace": trace, "norm_tokens": set()}
    from runtime.model_tree import decoder_layers

    for layer in decoder_layers(model):  # the tokens a layer's norms see (sequence parallelism: a tp part)
        for child in layer.children():
            if any(isinstance(p, DTensor) and p.device_mesh.mesh_dim_names[-1] == "tp" and p.placements[-1].is_replicate()
                   for p in child.parameters(recurse=False)):
                child.register_forward_hook(lambda m, a, o: out["norm_tokens"].add(o.shape[1]))
    for step in range(case["steps"]):
        if pipe is None:  # (under context parallelism, this rank's segments of each sequence)
            mean, rows = torch.zeros(()), rows_of(ids, case)
            for inputs in rows:
                split, inputs = split_inputs(inputs, mesh.cp_group)
                with running(split):
                    loss = model(**inputs, use_cache=False).loss / len(rows)
                    loss.backward()
                mean += loss.detach()
        else:  # micro-batches through the stages; the loss is on the last stage
            splits, micro = zip(*(split_inputs(inputs, mesh.cp_group) for m in ids.split(plan.micro_batch)
                                  for inputs in rows_of(m, case)))
            mean = torch.tensor(pipe.step(list(micro), list(splits)))
        dist.all_reduce(mean)
        out["losses"].append(mean.item() / (dist.get_world_size() // plan.pp))
        if step == 0:
            out["grads"] = whole(gather_experts(model, {n: p.grad for n, p in model.named_parameters()
                                                        if p.grad is not None}), plan)
            out["grad_norm"] = grad_norm(model, mesh).item()
        opt.step()
        opt.zero_grad()
    out["tp_split"] = sorted(whole({n: None for n, p in model.named_parameters() if isinstance(p, DTensor)
                                    and p.device_mesh.mesh_dim_names[-1] == "tp" and p.placements[-1].is_shard()},
                                   plan))
    out["comm_seconds"] = sum(b.expert_parallel.comm.seconds for _, b in moe_blocks(model) if b.expert_parallel)
    out["params"] = whole(gather_experts(model, dict(model.named_parameters())), plan)
    if plan.lora is not None:
        out["adapters"] = whole(lora_state_dict(model), plan)
    if not case.get("round_trip"):
        return out
    # checkpoint round trip: full state out of this model, into a fresh one laid out the same way
    full = gather_experts(model)
    fresh = prepared(case, plan, mesh)
    load_full_state(fresh, full)
    again = gather_experts(fresh)
    out["state_reloaded"] = every(set(again) == set(full) and all(torch.equal(again[k], v) for k, v in full.items()))
    if plan.lora is not None:
        fresh = prepared(case, plan, mesh)
        mine = lora_state_dict(model)  # this stage's
        load_lora_state_dict(fresh, mine)
        again = lora_state_dict(fresh)
        out["reloaded"] = every(set(again) == set(mine) and all(torch.equal(again[k], v) for k, v in mine.items()))
    return out


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo", timeout=timedelta(seconds=job.get("timeout", 120)))
    results = {case["id"]: run_case(case) for case in job["cases"]}
    if dist.get_rank() == 0:
        torch.save(results, job["out"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
