"""Render the bundle's code and pages from the Jinja2 templates in templates/ (package onboard.templates).

Everything rendered here reads the spec and the adapt decision (`onboard.adapt.decision`), never the model, so the
same model and options give byte-identical files.

Kernels: each Triton template under templates/kernels/ renders, for one model's shapes, a module the runtime's
kernel store keeps once (`runtime.kernels.store`), keyed by the template's name and a hash of its text and
parameters: the same template at the same parameters is one file whoever renders it, and a changed template is
a new key.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from importlib import resources

import jinja2

from onboard.adapt.decision import LINEAR, SPARSE, Decision, Taken, by_reason
from onboard.inspect.spec import ModelSpec
from onboard.inspect.summary import describe_mlp, human, pattern_spans, ranges


@functools.lru_cache(maxsize=None)
def environment() -> jinja2.Environment:
    """One environment a process: a template compiles once, and again only when its text changes (compiling them
    was a sixth of writing a bundle)."""
    env = jinja2.Environment(loader=jinja2.FunctionLoader(_source), keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=False, lstrip_blocks=False)
    env.filters["tojson"] = lambda v: json.dumps(v)
    env.globals["ranges"] = ranges
    return env


def _source(name: str):
    """(text, no file name, whether the compiled template is still that text): jinja asks before each reuse."""
    text = template_text(name)
    return text, None, lambda: template_text(name) == text


def template_text(name: str) -> str:
    return resources.files("onboard.templates").joinpath(name).read_text()


# ------------------------------------------------------------------------------------------------------
# adapter.py


def render_adapter(spec: ModelSpec, taken: Taken, kernels: list[str] = ()) -> str:
    """The bundle's adapter.py for what the runtime takes (`Decision.taken()`); `kernels` are the store keys of
    the kernels it loads."""
    stays = ["norms", "embeddings"]
    if any(layer.mlp.kind == "dense" for layer in spec.layers):
        stays.insert(1, "dense MLPs")
    if not taken.loss.takes:
        stays.append("LM head and loss")
    if len(taken.attention) < len({layer.attention.kind for layer in spec.layers}):
        stays.insert(0, "attention" if not taken.attention else "the other attention layers")
    return environment().get_template("adapter.py.j2").render(
        spec=spec, moe=taken.moe, stays=", ".join(stays), loss=taken.loss, attention=taken.attention,
        moe_layer_count=sum(len(e.layers) for e in taken.moe), kernels=list(kernels),
        attention_layer_count=sum(len(e.layers) for e in taken.attention), generated=taken.generated,
    )


# ------------------------------------------------------------------------------------------------------
# REVIEW.md

CORE_NAMES = {  # what REVIEW.md calls each runtime core a swapped linear-attention layer runs
    "chunk_gated_delta": "chunk-parallel gated delta rule (`chunk_gated_delta_rule`)",
    "ssd_chunk_scan": "Mamba2 SSD chunk scan on the scalar-decay core (`ssd_chunk_scan`)",
    "selective_scan": "Mamba1 selective scan (`selective_scan.selective_scan`)",
    "lightning": "lightning-attention block on the constant-decay core (`swap_lightning_attention`)",
    "causal_conv1d": "causal conv (`causal_conv1d`)",
}


def render_review(spec: ModelSpec, decision: Decision, verification, twin_size: dict) -> str:
    """REVIEW.md: what was matched, what the runtime took and what stays HuggingFace code (and why), and the
    verification; `twin_size` is {"hidden", "layers"} of the twin verification ran, and where behaviour read
    the config {"fields": what each field drives, "why": why names did not suffice, "full_width": no field
    could be shrunk safely}."""
    taken = decision.taken()
    kept_moe, kept_attention = by_reason(decision.kept_moe()), by_reason(decision.kept_attention())
    unmatched = decision.still_unmatched(spec)
    labels = [f"{layer.attention.kind} + {describe_mlp(layer.mlp)}" for layer in spec.layers]
    pattern = [f"layers {start}-{end}: " + (unit[0] if len(unit) == 1 else " / ".join(unit))
               + (f" (x{repeats})" if repeats > 1 else "") for start, end, unit, repeats in pattern_spans(labels)]
    softmax = sorted({layer.attention.kind for layer in spec.layers
                      if not layer.attention.kind.startswith(("linear:", "sparse:", "ssm:", "conv"))})
    return environment().get_template("REVIEW.md.j2").render(
        spec=spec, moe=taken.moe, kept_moe=kept_moe, verification=verification,
        pattern=pattern, params_total=human(spec.params_total), params_active=human(spec.params_active),
        twin_hidden=twin_size["hidden"], twin_layers=twin_size["layers"], loss=taken.loss,
        twin_fields=twin_size.get("fields") or {}, twin_why=twin_size.get("why"),
        twin_full_width=twin_size.get("full_width", False),
        attention=taken.attention, attention_kept=kept_attention,
        core_names=CORE_NAMES, softmax_kinds=", ".join(softmax), refused=decision.refused,
        generated=decision.generated, unmatched=unmatched,
    )



# ------------------------------------------------------------------------------------------------------
# kernels

KERNEL_DTYPE = "bf16"  # what training runs in; the kernels compute in fp32 inside


@dataclass(frozen=True)
class Kernel:
    """One rendered kernel: its template, the parameters it was rendered with, its text and its store key."""
    template: str
    params: dict
    text: str

    @property
    def key(self) -> str:
        return kernel_key(self.template, self.params)

    def record(self) -> dict:
        return {"key": self.key, "template": self.template, "params": self.params,
                "sha256": hashlib.sha256(self.text.encode()).hexdigest()}


def kernel_key(template: str, params: dict) -> str:
    """`<template stem>-<12 hex>`: a hash of the template's text and the parameters, so the same template at the
    same parameters is one key and a changed template is a new one."""
    digest = hashlib.sha256(template_text(template).encode())
    digest.update(json.dumps(params, sort_keys=True).encode())
    stem = template.rsplit("/", 1)[-1].removesuffix(".py.j2")
    return f"{stem}-{digest.hexdigest()[:12]}"


def render_kernel(template: str, **params) -> Kernel:
    return Kernel(template, params, environment().get_template(template).render(**params))


# each kernel template at default shapes: what the tests render and lint, and a reader's example
DEFAULT_KERNELS = {
    "kernels/moe_triton.py.j2": dict(name="default", hidden=1024, top_k=4, ffn=512, dtype=KERNEL_DTYPE,
                                     block_cols=1024, bm=64, bn=64, bk=32),
    "kernels/gated_delta_triton.py.j2": dict(name="default", gate="head", head_k=128, head_v=128, chunk=64,
                                             block=16, block_k=64, block_v=64, dtype=KERNEL_DTYPE),
    "kernels/scalar_decay_triton.py.j2": dict(name="default", head_k=128, head_v=64, chunk=64, block_k=64,
                                              block_v=64, dtype=KERNEL_DTYPE),
    "kernels/sparse_attention_triton.py.j2": dict(name="default", qk_head_dim=192, v_head_dim=128, top_k=2048,
                                                  dtype=KERNEL_DTYPE),
    "kernels/loss_triton.py.j2": dict(name="default", vocab=32000, block=4096),
}


def _pow2(n: int, low: int, high: int) -> int:
    p = low
    while p < n and p < high:
        p *= 2
    return p


def _is_pow2(n: int | None) -> bool:
    return bool(n) and n >= 16 and n & (n - 1) == 0


def render_kernels(spec: ModelSpec, taken: Taken) -> list[Kernel]:
    """Kernels specialised for this model's shapes, for what the adapter runs in the runtime: the MoE kernels,
    the gated delta rule / scalar-decay scan / DSA sparse attention, and cross-entropy rows. Empty when nothing
    the runtime runs has a kernel."""
    kernels = []
    moe = next((layer.mlp for entry in taken.moe for layer in spec.layers
                if layer.index == entry.layers[0]), None)
    if moe is not None:
        kernels.append(render_kernel(
            "kernels/moe_triton.py.j2", name=spec.name, hidden=spec.hidden_size, top_k=moe.top_k,
            ffn=moe.expert_ffn, dtype=KERNEL_DTYPE, block_cols=_pow2(spec.hidden_size, 16, 1024), bm=64, bn=64,
            bk=32))
    kernels += _attention_kernels(spec, taken)
    if taken.loss.takes:
        kernels.append(render_kernel("kernels/loss_triton.py.j2", name=spec.name, vocab=spec.vocab_size,
                                     block=_pow2(spec.vocab_size, 64, 4096)))
    return kernels


def _attention_kernels(spec: ModelSpec, taken: Taken) -> list[Kernel]:
    """The scalar-decay kernel (Mamba2 SSD, lightning) and the gated delta rule kernel, each for the first swapped
    attention of its kind whose dims it can tile (one op each in the registry: a model mixing gate kinds keeps
    the others on the PyTorch path), and the DSA kernel."""
    out: dict[str, Kernel] = {}
    by_index = {layer.index: layer for layer in spec.layers}
    for entry in taken.attention:
        attn = by_index[entry.layers[0]].attention
        head_k, head_v = attn.head_dim, attn.v_head_dim or attn.head_dim
        if entry.takes == LINEAR and {"ssd_chunk_scan", "lightning"} & set(entry.cores):
            # Mamba2's SSD (keys are B: the state size) and lightning attention (keys are the head size)
            head_k = attn.state_size or attn.head_dim
            if "scalar_decay" not in out and _is_pow2(head_k) and _is_pow2(attn.head_dim):
                out["scalar_decay"] = render_kernel(
                    "kernels/scalar_decay_triton.py.j2", name=spec.name, head_k=head_k, head_v=attn.head_dim,
                    chunk=64, block_k=min(head_k, 64), block_v=min(attn.head_dim, 64), dtype=KERNEL_DTYPE)
        elif (entry.takes == LINEAR and attn.gate in ("scalar", "channel") and "gated_delta" not in out
                and _is_pow2(head_k) and _is_pow2(head_v)):
            out["gated_delta"] = render_kernel(
                "kernels/gated_delta_triton.py.j2", name=spec.name, gate="head" if attn.gate == "scalar" else "channel",
                head_k=head_k, head_v=head_v, chunk=64, block=16, block_k=min(head_k, 64), block_v=min(head_v, 64),
                dtype=KERNEL_DTYPE)
        elif entry.takes == SPARSE and "sparse_attention" not in out and attn.index_topk:
            out["sparse_attention"] = render_kernel(
                "kernels/sparse_attention_triton.py.j2", name=spec.name, qk_head_dim=attn.head_dim, v_head_dim=head_v,
                top_k=attn.index_topk, dtype=KERNEL_DTYPE)
    return list(out.values())
