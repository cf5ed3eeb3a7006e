"""Triton kernels rendered from templates/kernels/, run on CPU by Triton's interpreter."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest

from onboard.codegen import render_kernels

pytest.importorskip("triton")
HERE = Path(__file__).parent


def _run(script: str, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "2"}
    return subprocess.run([sys.executable, str(HERE / "kernels" / script), *args], capture_output=True, text=True,
                          env=env, timeout=600)


@pytest.mark.parametrize("model", ["mixtral-8x7b", "deepseek-v3"])
def test_rendered_kernels_match_the_reference(model, tmp_path, inspected):
    spec, _ = inspected(model)
    kernels = render_kernels(spec)
    assert list(kernels) == ["moe_triton.py"]
    source = kernels["moe_triton.py"]
    moe = next(layer.mlp for layer in spec.layers if layer.mlp.kind == "moe")
    assert f"HIDDEN = {spec.hidden_size}" in source and f"TOP_K = {moe.top_k}" in source
    # the kernels are checked at a small width with the same top-k: re-render for hidden 64 (on a copy:
    # the inspected spec is shared by the whole session)
    spec = copy.deepcopy(spec)
    spec.hidden_size = 64
    path = tmp_path / "moe_triton.py"
    path.write_text(render_kernels(spec)["moe_triton.py"])
    result = _run("check_moe_triton.py", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "grouped GEMM dw (out_in=True): ok" in result.stdout


def test_dense_model_renders_no_kernels(inspected):
    spec, _ = inspected("qwen3-8b")
    assert render_kernels(spec) == {}


def test_adapted_twin_verifies_with_triton_kernels(tmp_path):
    """The whole adapter path with the rendered kernels selected by backend dispatch (interpreter)."""
    import json

    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "2"}
    root = HERE.parent
    result = subprocess.run([sys.executable, str(root / "cli.py"), "adapt", "olmoe-1b-7b", "--out", str(tmp_path / "b")],
                            capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads((tmp_path / "b" / "verification.json").read_text())
    assert data["passed"] and set(data["backends"].values()) == {"triton"}


@pytest.mark.parametrize("model, attention_kernel", [("qwen3-next-80b-a3b", "gated_delta_triton.py"),
                                                      ("deepseek-v3.2", "sparse_attention_triton.py")])
def test_hybrid_models_get_attention_and_loss_kernels_at_their_full_scale_shapes(model, attention_kernel):
    """With the twin (which decides what attention and loss the adapter swaps), the bundle also carries the
    attention and cross-entropy kernels, rendered for the full-size model's head dims, top-k and vocabulary."""
    from onboard.capture import capture
    from onboard.inspection import build_spec
    from onboard.source import resolve
    from onboard.twin import build_twin

    source = resolve(model)
    twin = build_twin(source)
    spec = build_spec(source, twin, capture(twin))
    kernels = render_kernels(spec, twin)
    assert sorted(kernels) == sorted(["moe_triton.py", attention_kernel, "loss_triton.py"])
    assert f"VOCAB = {spec.vocab_size}" in kernels["loss_triton.py"]
    swapped = next(layer.attention for layer in spec.layers if layer.attention.kind.startswith(("linear", "sparse")))
    if attention_kernel == "gated_delta_triton.py":
        assert f"HEAD_K = {swapped.head_dim}" in kernels[attention_kernel] and "PER_CHANNEL = False" in kernels[attention_kernel]
    else:
        assert f"TOP_K = {swapped.index_topk}" in kernels[attention_kernel]
        assert f"QK_HEAD_DIM = {swapped.head_dim}" in kernels[attention_kernel]
    for name, source_code in kernels.items():
        compile(source_code, name, "exec")
    # a refused attention reading takes its kernel out with it
    refused = {f"attention:{swapped.path}": "refused for the test"}
    assert attention_kernel not in render_kernels(spec, twin, refused)


@pytest.mark.parametrize("family", ["nemotron_h", "minimax"])
def test_scalar_decay_models_get_its_kernel_with_keys_of_state_or_head_size(family):
    """Mamba2's SSD scan runs on the scalar-decay core with B (the state) as keys; lightning attention with its
    heads' keys: the bundle's kernel is rendered at those full-scale sizes."""
    from onboard.capture import capture
    from onboard.families import default_config
    from onboard.inspection import build_spec
    from onboard.source import from_config
    from onboard.twin import build_twin

    config = default_config(family)
    source = from_config(config, family)
    twin = build_twin(source)
    spec = build_spec(source, twin, capture(twin))
    kernels = render_kernels(spec, twin)
    assert "scalar_decay_triton.py" in kernels and "gated_delta_triton.py" not in kernels
    keys = config.ssm_state_size if family == "nemotron_h" else config.head_dim or config.hidden_size // config.num_attention_heads
    values = config.mamba_head_dim if family == "nemotron_h" else keys
    assert f"HEAD_K = {keys}" in kernels["scalar_decay_triton.py"]
    assert f"HEAD_V = {values}" in kernels["scalar_decay_triton.py"]
    compile(kernels["scalar_decay_triton.py"], "scalar_decay_triton.py", "exec")
