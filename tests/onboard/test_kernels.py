"""Triton kernels rendered from templates/kernels/ into the kernel store, run on CPU by Triton's interpreter."""

import ast
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from onboard.adapt.codegen import (
    DEFAULT_KERNELS,
    kernel_key,
    render_kernel,
    render_kernels,
    template_text,
)
from tests.helpers import run_kernel_check, stored_kernel

ROOT = Path(__file__).resolve().parents[2]


def _names(kernels) -> list[str]:
    return sorted(k.template.rsplit("/", 1)[-1].removesuffix(".py.j2") for k in kernels)


@pytest.mark.parametrize("template", sorted(DEFAULT_KERNELS))
def test_every_kernel_template_renders_at_default_shapes_and_lints(template):
    """Each template renders at its default shapes into Python that parses, defines `register()`, and uses no
    name it never binds (pyflakes: undefined names, unused imports, redefinitions)."""
    from pyflakes.api import check
    from pyflakes.reporter import Reporter

    text = render_kernel(template, **DEFAULT_KERNELS[template]).text
    tree = ast.parse(text)
    assert "register" in {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}

    class Collect(Reporter):
        def __init__(self):
            self.messages = []

        def flake(self, message):
            self.messages.append(str(message))

        def syntaxError(self, *args):  # noqa: N802 - pyflakes' interface
            self.messages.append(f"syntax error {args}")

        def unexpectedError(self, *args):  # noqa: N802
            self.messages.append(f"error {args}")

    reporter = Collect()
    check(text, template, reporter)
    assert not reporter.messages, reporter.messages


def test_kernel_keys_follow_template_text_and_parameters(monkeypatch):
    """The same template and parameters give one key; another parameter or a changed template gives another."""
    template = "kernels/loss_triton.py.j2"
    params = DEFAULT_KERNELS[template]
    key = render_kernel(template, **params).key
    assert key == kernel_key(template, dict(reversed(list(params.items()))))  # order does not matter
    assert key.startswith("loss_triton-") and len(key.split("-")[1]) == 12
    assert kernel_key(template, {**params, "vocab": params["vocab"] + 1}) != key
    import onboard.adapt.codegen as codegen

    monkeypatch.setattr(codegen, "template_text", lambda name: template_text(name) + "\n# edited\n")
    assert kernel_key(template, params) != key


def test_the_store_keeps_one_file_per_key_and_refuses_other_text(tmp_path, monkeypatch):
    from runtime.kernels import store

    monkeypatch.setenv("ONBOARD_KERNEL_STORE", str(tmp_path / "store"))
    kernel = render_kernel("kernels/loss_triton.py.j2", **DEFAULT_KERNELS["kernels/loss_triton.py.j2"])
    path = store.put(kernel.key, kernel.text)
    assert path == tmp_path / "store" / f"{kernel.key}.py" and path.read_text() == kernel.text
    assert store.put(kernel.key, kernel.text) == path  # the same again: nothing changes
    with pytest.raises(ValueError, match="another kernel under the same key"):
        store.put(kernel.key, kernel.text + "# tampered\n")
    assert path.read_text() == kernel.text
    with pytest.raises(ValueError, match="not a kernel key"):
        store.path_of("../../etc/passwd")
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == [path.name]  # no temporary left


def _bundle_kernels(tmp_path, bundle="deepseek-v3", change=None) -> Path:
    """A copy of a committed bundle's kernels.json (with `change` applied to its first record)."""
    document = json.loads((ROOT / "bundles" / bundle / "kernels.json").read_text())
    if change:
        change(document["kernels"][0])
    folder = tmp_path / "bundle"
    folder.mkdir()
    (folder / "kernels.json").write_text(json.dumps(document))
    return folder


def test_a_committed_bundles_kernels_render_again_into_an_empty_store(tmp_path, monkeypatch):
    """The store is not committed: each kernel of kernels.json renders again, to the recorded key and sha256."""
    import hashlib

    from onboard.bundle.kernels import restore_kernels
    from runtime.kernels import store

    monkeypatch.setenv("ONBOARD_KERNEL_STORE", str(tmp_path / "store"))
    folder = _bundle_kernels(tmp_path)
    entries = json.loads((folder / "kernels.json").read_text())["kernels"]
    assert restore_kernels(folder) == [e["key"] for e in entries]
    for e in entries:
        assert hashlib.sha256(store.path_of(e["key"]).read_bytes()).hexdigest() == e["sha256"]
    assert restore_kernels(folder) == []  # present now: nothing rendered twice


@pytest.mark.parametrize("change, words", [
    (lambda e: e.update(template="../../../etc/passwd"), "not one of onboard's kernel templates"),
    (lambda e: e["params"].update(name="x\nimport os; os.system('id')"), "must be a number or a plain name"),
    (lambda e: e["params"].update(hidden=[1]), "must be a number or a plain name"),
    (lambda e: e["params"].update(hidden=e["params"]["hidden"] + 1), "another version of"),
    (lambda e: e.update(sha256="0" * 64), "renders to other text"),
    (lambda e: e.update(key="../../x"), "not a kernel key"),
    (lambda e: e.pop("sha256"), r"\[0\]: no 'sha256'"),
    (lambda e: e.update(key=7), r"'kernels'\[0\]: 'key' must be text, not a whole number"),
    (lambda e: e.update(sha256="f" * 63), "'sha256' must be 64 hex digits"),
], ids=["template path", "code in a name", "list parameter", "edited parameter", "wrong sha256", "key a path",
        "no sha256", "key a number", "short sha256"])
def test_a_tampered_kernel_record_is_refused_and_nothing_is_stored(change, words, tmp_path, monkeypatch):
    """kernels.json arrives in a pull request, and its parameters are rendered into code."""
    from onboard.bundle.kernels import restore_kernels
    from onboard.errors import OnboardError

    monkeypatch.setenv("ONBOARD_KERNEL_STORE", str(tmp_path / "store"))
    with pytest.raises(OnboardError, match=words):
        restore_kernels(_bundle_kernels(tmp_path, change=change))
    assert not (tmp_path / "store").exists() or not list((tmp_path / "store").iterdir())


@pytest.mark.interpreter
def test_a_committed_bundle_runs_its_kernels_from_an_emptied_store(tmp_path):
    """A fresh clone: an empty store, Triton's interpreter, a committed bundle's adapter loaded as `onboard train`
    and `verify` load it (its kernels render again), then its loss kernel checked against the reference."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "ONBOARD_KERNEL_STORE": str(tmp_path)}
    script = ("from onboard.bundle.files import load_adapter; import sys; "
              f"m = load_adapter({str(ROOT / 'bundles' / 'deepseek-v3')!r}); print(' '.join(m.KERNELS))")
    loaded = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                            cwd=ROOT)
    assert loaded.returncode == 0, loaded.stderr
    keys = loaded.stdout.split()
    assert sorted(p.stem for p in tmp_path.glob("*.py")) == sorted(keys)
    loss = next(k for k in keys if k.startswith("loss_triton-"))
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "kernels" / "check_loss_triton.py"), loss],
                            capture_output=True, text=True, env={**env, "PYTHONPATH": str(ROOT)}, timeout=600,
                            cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.interpreter
@pytest.mark.parametrize("model", ["mixtral-8x7b", "deepseek-v3"])
def test_rendered_kernels_match_the_reference(model, twin_adapter, tmp_path):
    spec, _, decision, _ = twin_adapter(tmp_path, ref=model)
    kernels = {k.template: k for k in render_kernels(spec, decision.taken())}
    assert sorted(kernels) == ["kernels/loss_triton.py.j2", "kernels/moe_triton.py.j2"]
    source = kernels["kernels/moe_triton.py.j2"].text
    moe = next(layer.mlp for layer in spec.layers if layer.mlp.kind == "moe")
    assert f"HIDDEN = {spec.hidden_size}" in source and f"TOP_K = {moe.top_k}" in source
    # the kernels are checked at a small width with the same top-k: re-render for hidden 64
    spec = copy.deepcopy(spec)
    spec.hidden_size = 64
    small = next(k for k in render_kernels(spec, decision.taken()) if k.template == "kernels/moe_triton.py.j2")
    result = run_kernel_check("check_moe_triton.py", stored_kernel(small.template, **small.params), threads=2)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "grouped GEMM dw (out_in=True): ok" in result.stdout


def test_dense_model_renders_only_the_loss_kernel(twin_adapter, tmp_path):
    spec, _, decision, _ = twin_adapter(tmp_path, ref="qwen3-8b")
    assert _names(render_kernels(spec, decision.taken())) == ["loss_triton"]
    decision.refuse("loss", "refused for the test")
    assert render_kernels(spec, decision.taken()) == []


@pytest.mark.interpreter
def test_adapted_twin_verifies_with_triton_kernels(tmp_path):
    """The whole adapter path with the rendered kernels selected by backend dispatch (interpreter); the bundle
    names its kernels by store key, and the store holds them."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "2"}
    result = subprocess.run([sys.executable, str(ROOT / "cli.py"), "adapt", "olmoe-1b-7b", "--out",
                             str(tmp_path / "b")], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads((tmp_path / "b" / "verification.json").read_text())
    assert data["passed"] and set(data["backends"].values()) == {"triton"}
    from runtime.kernels import store

    kernels = json.loads((tmp_path / "b" / "kernels.json").read_text())["kernels"]
    assert [k["template"] for k in kernels] == ["kernels/moe_triton.py.j2", "kernels/loss_triton.py.j2"]
    for k in kernels:
        assert store.path_of(k["key"]).is_file() and k["key"] in (tmp_path / "b" / "adapter.py").read_text()


@pytest.mark.parametrize("model, attention_kernel", [("qwen3-next-80b-a3b", "gated_delta_triton"),
                                                      ("deepseek-v3.2", "sparse_attention_triton")])
def test_hybrid_models_get_attention_and_loss_kernels_at_their_full_scale_shapes(model, attention_kernel,
                                                                                 twin_adapter, tmp_path):
    """The bundle also carries the attention and cross-entropy kernels, rendered for the full-size model's head
    dims, top-k and vocabulary."""
    spec, _, decision, _ = twin_adapter(tmp_path, ref=model)
    kernels = {k.template.rsplit("/", 1)[-1].removesuffix(".py.j2"): k.text for k in render_kernels(spec, decision.taken())}
    assert sorted(kernels) == sorted(["moe_triton", attention_kernel, "loss_triton"])
    assert f"VOCAB = {spec.vocab_size}" in kernels["loss_triton"]
    swapped = next(layer.attention for layer in spec.layers if layer.attention.kind.startswith(("linear", "sparse")))
    if attention_kernel == "gated_delta_triton":
        assert f"HEAD_K = {swapped.head_dim}" in kernels[attention_kernel] and "PER_CHANNEL = False" in kernels[attention_kernel]
    else:
        assert f"TOP_K = {swapped.index_topk}" in kernels[attention_kernel]
        assert f"QK_HEAD_DIM = {swapped.head_dim}" in kernels[attention_kernel]
    # a refused attention reading takes its kernel out with it
    decision.refuse(f"attention:{swapped.path}", "refused for the test")
    assert attention_kernel not in _names(render_kernels(spec, decision.taken()))


@pytest.mark.parametrize("family", ["nemotron_h", "minimax"])
def test_scalar_decay_models_get_its_kernel_with_keys_of_state_or_head_size(family, twin_adapter, tmp_path):
    """Mamba2's SSD scan runs on the scalar-decay core with B (the state) as keys; lightning attention with its
    heads' keys: the bundle's kernel is rendered at those full-scale sizes."""
    from onboard.review.families import default_config

    config = default_config(family)
    spec, _, decision, _ = twin_adapter(tmp_path, family=family)
    kernels = {k.template.rsplit("/", 1)[-1].removesuffix(".py.j2"): k for k in render_kernels(spec, decision.taken())}
    assert "scalar_decay_triton" in kernels and "gated_delta_triton" not in kernels
    keys = config.ssm_state_size if family == "nemotron_h" else config.head_dim or config.hidden_size // config.num_attention_heads
    values = config.mamba_head_dim if family == "nemotron_h" else keys
    assert kernels["scalar_decay_triton"].params["head_k"] == keys
    assert kernels["scalar_decay_triton"].params["head_v"] == values
    assert f"HEAD_K = {keys}" in kernels["scalar_decay_triton"].text
