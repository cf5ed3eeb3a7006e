"""Trained weights out, in the forms the rest of the ecosystem loads (`onboard train --weights M --export ...`).

    export_hf(model, pretrained, out)      # a HuggingFace checkpoint: sharded safetensors + index, LoRA merged
    export_peft(model, pretrained, out)    # a PEFT adapter: adapter_config.json + adapter_model.safetensors

Both are collective (every rank calls them; rank 0 writes). The model's tensors are gathered one at a time
(`runtime.parallel.state.iter_full`: FSDP2 shards and expert-parallel slices), named back to transformers' keys
(`Pretrained.names`: the runtime's swaps hold transformers' own tensors), and written shard by shard, so no process
holds more than one shard of the model. The HuggingFace checkpoint uses the installed transformers' own key layout
(what `from_pretrained` loads as it is) with the model directory's config, generation config and tokenizer files.
Adapters map onto PEFT's own layer names, read from a PEFT model of the same config built on the meta device:
LoRA on linear layers as `target_modules`, LoRA on expert stacks as `target_parameters` (one A / B pair per
expert, stacked as PEFT stacks them). A folder is written beside its target and renamed into place; an existing
target is refused, never replaced.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

SHARD_BYTES = 2 * 2**30  # per safetensors file of an exported checkpoint
COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def check_target(out: str | Path) -> Path:
    """An export target that may be written: not there yet, its parent writable. ValueError otherwise."""
    out = Path(out)
    if out.exists():
        raise ValueError(f"{out} exists: an export never replaces anything (choose a new folder)")
    parent = next((p for p in out.parents if p.exists()), Path("."))
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ValueError(f"cannot write the export {out}: {parent} is not a writable folder")
    return out


def _staging(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


def _lora_parts(model: nn.Module) -> dict[str, tuple[str, str, float, bool]]:
    """{key of a LoRA-adapted base tensor: (key of A, key of B, scaling, whether the stack is (E, in, out))}."""
    from runtime.lora import PREFIX, LoRAGroupedExperts, LoRALinear

    parts = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, LoRALinear):
            parts[f"{prefix}weight"] = (f"{prefix}{PREFIX}a", f"{prefix}{PREFIX}b", module.scaling, False)
        elif isinstance(module, LoRAGroupedExperts):
            for stack in LoRAGroupedExperts.STACKS:
                if getattr(module, stack, None) is not None:
                    parts[f"{prefix}{stack}"] = (f"{prefix}{PREFIX}{stack}_a", f"{prefix}{PREFIX}{stack}_b",
                                                 module.lora_scaling, module.is_transposed(stack))
    return parts


def _merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, transposed: bool) -> torch.Tensor:
    """W + scaling * B A (per expert for a stack; an (E, in, out) stack takes the transpose, a flat one, stored
    (E·rows, cols), the stack's rows one after another)."""
    delta = (b.float() @ a.float()) * scaling
    if transposed:
        delta = delta.transpose(-1, -2)
    return (weight.float() + delta.reshape(weight.shape)).to(weight.dtype)


def export_hf(model: nn.Module, pretrained, out: str | Path, *, shard_bytes: int = SHARD_BYTES) -> Path | None:
    """A HuggingFace checkpoint of `model` (LoRA merged into its base weights) at `out`; its path on rank 0."""
    from safetensors.torch import save_file

    from runtime.lora import is_lora_name
    from runtime.parallel.state import iter_full

    out = Path(out)
    writer = _rank() == 0
    staging = _staging(out) if writer else None
    lora = _lora_parts(model)
    state = model.state_dict()
    base = {k: v for k, v in state.items() if not is_lora_name(k)}
    adapters = dict(iter_full(model, {k: v for k, v in state.items() if is_lora_name(k)}))  # small: all at once
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    files: list[list[str]] = []
    size = 0
    written: set[str] = set()

    def flush():
        nonlocal shard, size
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(staging / name), metadata={"format": "pt"})
            files.append(sorted(shard))
            shard, size = {}, 0

    for key, tensor in iter_full(model, base):
        hf = pretrained.names.get(key)
        if hf is None or hf in written or not writer:
            continue  # a runtime-only tensor, or one transformers' model holds under another key already written
        if key in lora:
            a, b, scaling, transposed = lora[key]
            tensor = _merged(tensor, adapters[a], adapters[b], scaling, transposed)
        written.add(hf)
        shard[hf] = tensor.detach().contiguous().cpu()
        size += tensor.numel() * tensor.element_size()
        if size >= shard_bytes:
            flush()
    if not writer:
        return None
    flush()
    missing = sorted(set(pretrained.layout.shapes) - written - pretrained.layout.tied)
    if missing:
        shutil.rmtree(staging, ignore_errors=True)
        raise ValueError(f"the export lacks {len(missing)} of the model's tensors (first: {', '.join(missing[:3])})")
    total = len(files)
    for i, keys in enumerate(files, 1):  # the names transformers gives its shards: model-0000i-of-0000n
        final = f"model-{i:05d}-of-{total:05d}.safetensors"
        os.replace(staging / f"model-{i:05d}.safetensors", staging / final)
        weight_map.update({k: final for k in keys})
    (staging / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum((staging / f).stat().st_size for f in set(weight_map.values()))},
         "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    _copy_model_files(pretrained.checkpoint.directory, staging)
    os.replace(staging, out)
    return out


def _copy_model_files(source: Path, staging: Path) -> None:
    for name in COPIED:
        if (source / name).is_file():
            shutil.copy(source / name, staging / name)


def _peft_names(config_dir: Path, modules: list[str], parameters: list[str], rank: int, alpha: float):
    """(LoraConfig, {target: (key of lora_A, key of lora_B)}) of a PEFT model of the model at `config_dir`
    (built on the meta device) with LoRA on `modules` (linear layers) and `parameters` (expert stacks); a target
    is a module path, or a parameter's path."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    lora_config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules or None,
                             target_parameters=parameters or None, task_type="CAUSAL_LM")
    peft_model = get_peft_model(skeleton, lora_config)
    names = {}
    for name, module in peft_model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        path = ".".join(p for p in name.split(".") if p != "base_layer").removeprefix("base_model.model.")
        target = f"{path}.{module.parameter_name}" if isinstance(module, ParamWrapper) else path
        names[target] = (f"{name}.lora_A.weight", f"{name}.lora_B.weight")
    return peft_model.peft_config["default"], names


def export_peft(model: nn.Module, pretrained, out: str | Path) -> Path | None:
    """The LoRA adapters of `model` as a PEFT adapter folder at `out`; its path on rank 0."""
    from safetensors.torch import save_file

    from runtime.lora import lora_state_dict

    out = Path(out)
    adapters = lora_state_dict(model)  # collective; full tensors
    if not adapters:
        raise ValueError("the model has no LoRA adapters to export (train with a plan that sets lora)")
    if _rank() != 0:
        return None
    lora = _lora_parts(model)
    targets = {}  # PEFT target -> (A, B in PEFT's layout)
    modules, parameters = [], []
    scalings = set()
    for key, (a_key, b_key, scaling, _) in lora.items():
        hf = pretrained.names[key]
        a, b = adapters[a_key], adapters[b_key]
        scalings.add(scaling)
        if a.dim() == 2:  # a linear layer: PEFT's lora_A (r, in), lora_B (out, r) as they are
            target = hf.removesuffix(".weight")
            modules.append(target)
        else:  # an expert stack: A (E, r, in) -> (E * r, in); B (E, out, r) -> (out, r * E), expert fastest
            target = hf
            parameters.append(target)
            a, b = a.reshape(-1, a.shape[-1]), b.permute(1, 2, 0).reshape(b.shape[1], -1)
        targets[target] = (a, b)
    if len(scalings) != 1:
        raise ValueError("LoRA adapters with different scalings cannot be one PEFT adapter")
    first_a = adapters[next(iter(lora.values()))[0]]
    rank = first_a.shape[-2]  # A is (r, in), or (E, r, in) for a stack
    alpha = scalings.pop() * rank
    config, names = _peft_names(pretrained.checkpoint.directory, sorted(modules), sorted(parameters), rank, alpha)
    unknown = sorted(set(targets) - set(names))
    if unknown:
        raise ValueError(f"PEFT places no adapter at {', '.join(unknown[:3])}")
    tensors = {}
    for target, (a, b) in targets.items():
        a_key, b_key = names[target]
        tensors[a_key] = a.contiguous()
        tensors[b_key] = b.contiguous()
    staging = _staging(out)
    save_file(tensors, str(staging / "adapter_model.safetensors"), metadata={"format": "pt"})
    config.base_model_name_or_path = str(pretrained.checkpoint.directory)
    config.save_pretrained(str(staging))
    os.replace(staging, out)
    return out
