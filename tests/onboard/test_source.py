"""Model references resolve offline; bad ones give one-line errors through the CLI."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from onboard.errors import OnboardError
from onboard.source import CATALOGUE_DIR, resolve
from tests.helpers import HANG, run_cli  # run_cli: `onboard` in this process

ROOT = Path(__file__).resolve().parents[2]


def cli_process(*args):
    """`onboard ARGS` in a process of its own (a model whose code must not run in the test's process)."""
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=HANG)


def test_catalogue_by_slug_and_hf_id():
    by_slug = resolve("mixtral-8x7b")
    by_id = resolve("mistralai/Mixtral-8x7B-v0.1")
    assert by_slug.kind == by_id.kind == "catalogue"
    assert by_slug.config.num_local_experts == by_id.config.num_local_experts == 8


def test_local_directory(tmp_path):
    shutil.copy(CATALOGUE_DIR / "olmoe-1b-7b" / "config.json", tmp_path / "config.json")
    src = resolve(str(tmp_path))
    assert src.kind == "local" and src.model_type == "olmoe"


def test_hf_cache_layout(tmp_path, monkeypatch):
    snapshot = tmp_path / "models--acme--tiny-moe" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (tmp_path / "models--acme--tiny-moe" / "refs").mkdir()
    (tmp_path / "models--acme--tiny-moe" / "refs" / "main").write_text("abc123")
    shutil.copy(CATALOGUE_DIR / "qwen3-30b-a3b" / "config.json", snapshot / "config.json")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path))
    src = resolve("acme/tiny-moe")
    assert src.kind == "hf-cache" and src.model_type == "qwen3_moe"


def test_remote_code_needs_consent(tmp_path):
    flagship = CATALOGUE_DIR / "onboard-flagship-2.8t"
    for f in flagship.iterdir():
        if f.is_file():
            shutil.copy(f, tmp_path / f.name)
    with pytest.raises(OnboardError, match="--trust-remote-code"):
        resolve(str(tmp_path))
    assert resolve(str(tmp_path), trust_remote_code=True).model_type == "onboard_flagship"


def _write(tmp_path, content: str) -> str:
    (tmp_path / "config.json").write_text(content)
    return str(tmp_path)


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    ('{"hidden_size": 8}', "no model_type"),
    ('{"model_type": "no_such_model_xyz"}', "unknown model_type"),
    ('{"model_type": "vit"}', "no causal-LM head"),
    ('[1, 2]', "JSON object"),
])
def test_bad_configs_raise_one_line(tmp_path, content, message):
    with pytest.raises(OnboardError, match=message) as info:
        resolve(_write(tmp_path, content))
    assert "\n" not in str(info.value)


def test_unknown_name_offline_says_what_to_do():
    with pytest.raises(OnboardError, match="--online"):
        resolve("nobody/no-such-model-anywhere")


@pytest.mark.parametrize("make_arg, message", [
    (lambda tmp: str(tmp / "missing"), "no such directory"),
    (lambda tmp: _write(tmp, "{oops"), "not valid JSON"),
    (lambda tmp: _write(tmp, '{"model_type": "bert_like_unknown"}'), "unknown model_type"),
    (lambda tmp: _write(tmp, '{"model_type": "vit"}'), "no causal-LM head"),
    (lambda tmp: "nobody/no-such-model-anywhere", "not found offline"),
])
def test_cli_errors_are_one_line_without_traceback(tmp_path, make_arg, message):
    arg = make_arg(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    result = run_cli("inspect", arg)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing written, changed or removed


def test_cli_remote_code_without_flag(tmp_path):
    for f in (CATALOGUE_DIR / "onboard-flagship-2.8t").iterdir():
        if f.is_file():
            shutil.copy(f, tmp_path / f.name)
    result = cli_process("inspect", str(tmp_path))
    assert result.returncode != 0 and "--trust-remote-code" in result.stderr and "Traceback" not in result.stderr


def test_cli_inspect_json_fields():
    result = run_cli("inspect", "olmoe-1b-7b", "--json", "--seq-len", "2048")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["model_type"] == "olmoe" and data["num_layers"] == 16 == len(data["layers"])
    layer = data["layers"][0]
    assert layer["attention"]["kind"] == "softmax" and layer["mlp"]["kind"] == "moe"
    assert layer["mlp"]["num_experts"] == 64 and layer["mlp"]["top_k"] == 8
    assert layer["mlp"]["num_shared_experts"] == 0 and layer["mlp"]["router"]["score"] == "softmax"
    assert data["costs"]["seq_len"] == 2048 and data["costs"]["flops_per_token_training"] > 6 * 1e9


def test_cli_inspect_text_and_catalogue():
    result = run_cli("inspect", "deepseek-v3")
    assert result.returncode == 0, result.stderr
    assert "671.03B total" in result.stdout and "group-limited (8 groups, top-4)" in result.stdout
    listing = run_cli("catalogue")
    assert listing.returncode == 0 and "onboard-flagship-2.8t" in listing.stdout


def test_configs_written_by_save_pretrained_read_back_as_transformers_reads_them(tmp_path):
    """transformers writes an infinity as {"__float__": "Infinity"} (Mamba's time_step_limit): it reads back as
    the float, as transformers' own loading does, and the model resolves."""
    import math

    from onboard.review.families import default_config
    from onboard.source import resolve

    default_config("nemotron_h").save_pretrained(tmp_path)
    assert '"__float__"' in (tmp_path / "config.json").read_text()
    source = resolve(str(tmp_path))
    assert math.isinf(source.config.time_step_limit[1]) and math.isinf(source.raw["time_step_limit"][1])
    (tmp_path / "config.json").write_text((tmp_path / "config.json").read_text().replace('"Infinity"', '"lots"'))
    with pytest.raises(OnboardError, match="is not a float transformers wrote"):
        resolve(str(tmp_path))
