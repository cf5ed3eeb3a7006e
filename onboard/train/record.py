"""The run log's record of the model really trained: the spec's full-scale numbers, each read back from the config
field that holds it (by what the field means, never by its name alone)."""

from __future__ import annotations

import json

import torch


def trained_record(spec: dict, full: dict, cfg: dict, model: torch.nn.Module, found: list | None = None) -> dict:
    """The run log's model fields for what is really trained: the spec's full-scale numbers, each taken
    from the config field that holds it at full scale (`full`) and read back from the trained config. Fields
    of no known name count too where the twin shrank them by what they were seen to drive (`found`: the
    `onboard.twin.shrink.Shrink`s of `onboard.twin.build.twin_config`), after every named one
    (`onboard.twin.scale.FullFields`)."""
    import dataclasses
    import hashlib

    from onboard.twin.fields import get, layers_key
    from onboard.twin.meanings import MIXER, MIXER_FAMILY, SPEC
    from onboard.twin.scale import FullFields
    from runtime.dims import grouped, mixers_of
    from runtime.model_tree import find_layer_stack
    from runtime.moe.block import MoEBlock
    from runtime.runlog import mixer_fields, model_record

    record = model_record(spec)
    full_hidden = record["hidden"] or 0
    trained = FullFields(full, cfg, found).read

    for name, meaning in SPEC.items():
        value = record.get(name)
        held, got = trained(value, (meaning,))
        if isinstance(got, int) and not isinstance(got, bool):
            record[name] = got
        elif name == "head_dim" and value and record.get("heads") and not held:  # implied: hidden / heads
            record[name] = record["hidden"] // record["heads"]
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    if blocks:
        record["experts"], record["top_k"] = blocks[0].spec.num_experts, blocks[0].spec.top_k
    key = layers_key(cfg)
    record["layers"] = (get(cfg, key) if key else None) or len(find_layer_stack(model)[1])  # else count them

    def scaled(mixer):
        family = next((m for prefix, m in MIXER_FAMILY.items() if mixer.kind.startswith(prefix)), {})
        changes = {}
        for name, meaning in MIXER.items():
            value = getattr(mixer, name)
            if not value:
                continue
            held, got = trained(value, (*family.get(name, ()), meaning))
            if isinstance(got, int) and not isinstance(got, bool):
                changes[name] = got
            elif name == "head_dim" and not held and mixer.heads and value == full_hidden // mixer.heads:
                changes[name] = record["hidden"] // changes.get("heads", mixer.heads)  # implied: hidden / heads
        return dataclasses.replace(mixer, **changes)

    # the twin and --layers N both train a prefix of the full model's layers; shapes that differed at full
    # scale may coincide once shrunk, hence grouped again
    kept = mixers_of(layer.get("attention", {}) for layer in spec.get("layers", [])[:record["layers"]])
    record.update(mixer_fields(grouped(scaled(m) for m in kept)))
    record["moe_layers"] = len(blocks)
    record["name"] = f"{spec.get('name')} (trained config)"
    total = sum(p.numel() for p in model.parameters())
    idle = sum(sum(p.numel() for p in b.experts.parameters()) * (1 - b.spec.top_k / b.spec.num_experts)
               for b in blocks)
    embedding = model.get_input_embeddings().weight.numel() if hasattr(model, "get_input_embeddings") else 0
    record["params_total"], record["params_active"] = total, int(total - idle - embedding)
    record["digest"] = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return record
