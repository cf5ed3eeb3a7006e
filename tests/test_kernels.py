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
