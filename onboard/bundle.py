"""`onboard adapt`: inspect, render the adapter, verify it, and write the bundle atomically.

Bundle: spec.json, adapter.py, kernels/ (Triton kernels rendered for the model), verification.json,
REVIEW.md, source.json, plan.json (`plan`, or one process by default) and train.sh (its torchrun command).
It is written into a fresh directory beside the target and moved into place only when complete; an existing bundle is replaced only
with `force`, and then only after the new one is complete.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

from onboard.capture import capture
from onboard.codegen import (
    attention_kinds,
    environment,
    loss_target,
    moe_kinds,
    render_adapter,
    render_kernels,
    replaceable,
    swapped_path,
)
from onboard.errors import OnboardError
from onboard.inspection import build_spec
from onboard.report import describe_mlp, human, pattern_spans, ranges
from onboard.source import ModelSource, resolve
from onboard.spec import ModelSpec
from onboard.twin import Twin, build_twin
from onboard.verify import SEEDS, Verification, verify


def load_adapter(directory: Path):
    """Import a bundle's adapter.py as a module of its own."""
    name = f"onboard_adapter_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(name, directory / "adapter.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def render_review(spec: ModelSpec, twin: Twin, verification: Verification, refused: dict | None = None) -> str:
    kinds, skipped = moe_kinds(spec, twin, refused)
    loss, loss_why = loss_target(spec, twin, refused)
    attention, attention_skipped = attention_kinds(spec, twin, refused)
    for kind in kinds:
        kind["reused"] = sorted({f"`{p}`" for p in [*kind["weights"].values(), kind["router"].weight,
                                                    kind["router"].bias, kind["router"].linear_bias, kind["output_bias"], kind["shared_gate_weight"], *kind["shared"]] if p})
    labels = [f"{layer.attention.kind} + {describe_mlp(layer.mlp)}" for layer in spec.layers]
    pattern = [f"layers {start}-{end}: " + (unit[0] if len(unit) == 1 else " / ".join(unit))
               + (f" (x{repeats})" if repeats > 1 else "") for start, end, unit, repeats in pattern_spans(labels)]
    return environment().get_template("REVIEW.md.j2").render(
        spec=spec, kinds=kinds, skipped=by_reason(skipped), verification=verification,
        pattern=pattern,
        params_total=human(spec.params_total), params_active=human(spec.params_active),
        twin_hidden=twin.config.hidden_size, twin_layers=len(twin.layer_signatures),
        loss=loss, loss_why=loss_why, attention=attention,
        attention_kept=by_reason(attention_skipped), core_names=CORE_NAMES,
        softmax_kinds=", ".join(sorted({layer.attention.kind for layer in spec.layers
                                        if not layer.attention.kind.startswith(("linear:", "sparse:", "ssm:",
                                                                                  "conv"))})),
    )


CORE_NAMES = {  # what REVIEW.md calls each runtime core a swapped linear-attention layer runs
    "chunk_gated_delta": "chunk-parallel gated delta rule (`chunk_gated_delta_rule`)",
    "ssd_chunk_scan": "Mamba2 SSD chunk scan on the scalar-decay core (`ssd_chunk_scan`)",
    "selective_scan": "Mamba1 selective scan (`selective_scan.selective_scan`)",
    "lightning": "lightning-attention block on the scalar-decay core (`swap_lightning_attention`)",
    "causal_conv1d": "causal conv (`causal_conv1d`)",
}


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise OnboardError(f"{out} exists and is not a directory")
    if out.exists() and any(out.iterdir()) and not force:
        raise OnboardError(f"{out} already holds a bundle; pass --force to replace it")
    parent = out.parent if str(out.parent) else Path(".")
    try:  # the default --out, bundles/<model>, starts a bundles/ folder on a fresh checkout
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OnboardError(f"cannot create {parent}: {exc.strerror or exc}") from None
    try:
        probe = tempfile.NamedTemporaryFile(dir=parent, prefix=".onboard-probe-")
        probe.close()
    except OSError as exc:
        raise OnboardError(f"cannot write to {parent}: {exc.strerror or exc}") from None


def adapt(source: ModelSource, out: Path, *, force: bool = False, plan=None) -> tuple[ModelSpec, Verification]:
    out = Path(out)
    _check_out(out, force)
    twin = build_twin(source)
    spec = build_spec(source, twin, capture(twin))
    staging = Path(tempfile.mkdtemp(dir=out.parent if str(out.parent) else ".", prefix=f".{out.name}.onboard-"))
    try:
        (staging / "spec.json").write_text(spec.to_json())
        (staging / "source.json").write_text(json.dumps(
            {"ref": source.ref, "kind": source.kind, "trust_remote_code": source.trust_remote_code},
            indent=2, sort_keys=True) + "\n")
        refused: dict[str, str] = {}
        verification = _render_and_verify(staging, spec, twin, refused)
        # readings of the model that verification has to confirm (extra routing slots taken as identity
        # experts; the loss computed from the decoder's last hidden state): when the bundle fails, drop
        # them one group at a time, keep those parts as HuggingFace code, and verify again
        for hypotheses in (_hypotheses(spec, refused), _loss_hypothesis(spec, twin, refused)):
            if verification.passed or not hypotheses:
                continue
            if verification.seeds:
                seeds = verification.seeds
                detail = (f"max relative logits difference {max(r.logits_max_rel for r in seeds):.1e}, "
                          f"loss {max(abs(r.loss_ref - r.loss_adapted) for r in seeds):.1e}")
            else:
                detail = verification.note
            for path, what in hypotheses.items():
                refused[path] = f"{what} did not verify ({detail})"
            verification = _render_and_verify(staging, spec, twin, refused)
        write_verification(staging, spec, twin, verification, refused)
        from onboard.train import write_launcher

        write_launcher(staging, plan)
        _move_into_place(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return spec, verification


def _hypotheses(spec: ModelSpec, refused: dict) -> dict[str, str]:
    out = {}
    for layer in spec.layers:
        mlp = layer.mlp
        if mlp.kind == "moe" and mlp.zero_experts and mlp.path not in refused and not replaceable(mlp, refused):
            out[mlp.path] = (f"the router scores {mlp.num_experts + mlp.zero_experts} slots for {mlp.num_experts} "
                             f"experts; taking the extra {mlp.zero_experts} as identity (zero) experts")
    return out


def _loss_hypothesis(spec: ModelSpec, twin: Twin, refused: dict) -> dict[str, str]:
    if loss_target(spec, twin, refused)[0] is None:
        return {}
    return {"loss": "computing the loss from the decoder's last hidden state through the LM head"}


def _render_and_verify(staging: Path, spec: ModelSpec, twin: Twin, refused: dict) -> Verification:
    (staging / "adapter.py").write_text(render_adapter(spec, twin, refused))
    shutil.rmtree(staging / "kernels", ignore_errors=True)
    kernels = render_kernels(spec, twin, refused)
    if kernels:
        (staging / "kernels").mkdir()
        for name, source_text in kernels.items():
            (staging / "kernels" / name).write_text(source_text)
    module = load_adapter(staging)
    return verify_swaps(spec, twin, module.adapt, refused)


def verify_swaps(spec: ModelSpec, twin: Twin, adapt_fn, refused: dict | None = None, seeds=SEEDS) -> Verification:
    """Verify `adapt_fn` against what codegen decided to swap, given the readings refused so far."""
    attention: dict[str, list[int]] = {}
    for group in attention_kinds(spec, twin, refused)[0]:
        attention.setdefault(group["mode"], []).extend(group["indices"])
    return verify(spec, twin, adapt_fn, lambda layer: swapped_path(layer, twin, refused), seeds,
                  loss_swapped=loss_target(spec, twin, refused)[0] is not None, attention=attention)


def by_reason(reasons: dict[int, str]) -> list[tuple[str, str]]:
    """{layer: why} as [(layer ranges, why)], one entry per distinct reason, in layer order."""
    grouped: dict[str, list[int]] = {}
    for index, why in sorted(reasons.items()):
        grouped.setdefault(why, []).append(index)
    return [(ranges(indices), why) for why, indices in grouped.items()]


def write_verification(directory: Path, spec: ModelSpec, twin: Twin, verification: Verification,
                       refused: dict | None = None) -> None:
    data = verification.to_dict()
    data["refused"] = dict(sorted((refused or {}).items()))
    kinds, _ = moe_kinds(spec, twin, refused)
    # layers whose experts alone run in the runtime, and why the block (its routing) could not
    data["experts_only"] = {k["ranges"]: k["why_not_block"] for k in kinds if k["mode"] == "experts"}
    # linear / sparse attention and the loss left as HuggingFace code, and why
    data["kept"] = {"attention": {layers: why for layers, why in by_reason(attention_kinds(spec, twin, refused)[1])},
                    "loss": loss_target(spec, twin, refused)[1]}
    (directory / "verification.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    (directory / "REVIEW.md").write_text(render_review(spec, twin, verification, refused))


def _move_into_place(staging: Path, out: Path) -> None:
    if out.exists():
        old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
        out.rename(old)
        staging.rename(out)
        shutil.rmtree(old)
    else:
        staging.rename(out)


def verify_bundle(directory: Path) -> tuple[ModelSpec, Verification]:
    """Re-run verification of an existing bundle (rewrites verification.json and REVIEW.md)."""
    directory = Path(directory)
    missing = [f for f in ("spec.json", "adapter.py", "source.json") if not (directory / f).is_file()]
    if missing:
        raise OnboardError(f"{directory} is not a bundle: missing {', '.join(missing)}")
    try:
        spec = ModelSpec.from_json((directory / "spec.json").read_text())
        origin = json.loads((directory / "source.json").read_text())
    except (ValueError, KeyError, TypeError) as exc:
        raise OnboardError(f"{directory}: unreadable bundle ({exc})") from None
    source = resolve(origin["ref"], trust_remote_code=origin.get("trust_remote_code", False))
    twin = build_twin(source)
    module = load_adapter(directory)
    refused = json.loads((directory / "verification.json").read_text()).get("refused", {}) \
        if (directory / "verification.json").is_file() else {}
    verification = verify_swaps(spec, twin, module.adapt, refused)
    write_verification(directory, spec, twin, verification, refused)
    return spec, verification
