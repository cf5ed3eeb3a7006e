"""The inspection cache behind `onboard plan` (issue 37): a second plan of the same model reads the spec the first
one made; any change to what a spec is made from (the config, the model's own code, onboard's) names another
entry; an entry that does not parse is made again; ONBOARD_CACHE_DIR=off keeps nothing."""

from __future__ import annotations

import json
import os

import pytest

from onboard.inspect import cache
from onboard.inspect.cache import cached_spec, spec_key
from onboard.review.families import default_config
from onboard.source import from_config, resolve


@pytest.fixture()
def model(tmp_path, monkeypatch):
    monkeypatch.setenv("ONBOARD_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    default_config("qwen3_moe").save_pretrained(folder)
    return folder


def test_a_second_inspection_is_read_from_the_cache(model, tmp_path):
    first, hit = cached_spec(resolve(str(model)))
    assert not hit and len(list((tmp_path / "cache" / "specs").glob("*.json"))) == 1
    second, hit = cached_spec(resolve(str(model)))
    assert hit and second.to_json() == first.to_json()


def test_what_a_spec_is_made_from_names_its_entry(model, monkeypatch):
    key = spec_key(resolve(str(model)))
    assert spec_key(resolve(str(model))) == key  # the same inputs, the same name
    config = json.loads((model / "config.json").read_text())
    config["num_local_experts"] += 2
    (model / "config.json").write_text(json.dumps(config))
    assert spec_key(resolve(str(model))) != key
    monkeypatch.setattr(cache, "code_digest", lambda: "another onboard")
    assert spec_key(resolve(str(model))) not in (key, None)
    assert spec_key(from_config(default_config("qwen3_moe"))) is None  # in memory: nothing to name it by


def test_remote_code_beside_the_config_is_part_of_the_name(tmp_path, monkeypatch):
    monkeypatch.setenv("ONBOARD_CACHE_DIR", str(tmp_path / "cache"))
    source = resolve("onboard-flagship-2.8t")  # the catalogue's remote-code model
    assert source.trust_remote_code
    key = spec_key(source)
    code = next(source.path.glob("*.py"))
    copy = tmp_path / "flagship"
    copy.mkdir()
    for path in source.path.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    (copy / code.name).write_text(code.read_text() + "\n# edited\n")
    assert spec_key(resolve(str(copy), trust_remote_code=True)) != key


def test_an_entry_that_does_not_parse_is_made_again(model, tmp_path):
    spec, _ = cached_spec(resolve(str(model)))
    entry = next((tmp_path / "cache" / "specs").glob("*.json"))
    kept = entry.read_text()
    entry.write_text("{not json")
    again, hit = cached_spec(resolve(str(model)))
    assert not hit and again.to_json() == spec.to_json() and entry.read_text() == kept


def test_a_forged_entry_is_a_miss_never_a_result(model, tmp_path, monkeypatch):
    """Issue 55: an entry with its parameter counts x1000 changed a plan silently (the cache checked that an entry
    parses, not that it is genuine). Each entry is sealed with an HMAC under the user's key: an edited entry, and
    one sealed under another user's key, are made again; a FIFO in an entry's place is a miss, not a hang."""
    spec, _ = cached_spec(resolve(str(model)))
    entry = next((tmp_path / "cache" / "specs").glob("*.json"))
    genuine = entry.read_text()
    record = json.loads(genuine)
    record["spec"]["params_total"] *= 1000
    entry.write_text(json.dumps(record))
    again, hit = cached_spec(resolve(str(model)))
    assert not hit and again.to_json() == spec.to_json() and entry.read_text() == genuine
    assert cached_spec(resolve(str(model)))[1]  # the genuine entry is taken
    monkeypatch.setenv("ONBOARD_CACHE_KEY", str(tmp_path / "another-users.key"))
    assert not cached_spec(resolve(str(model)))[1]  # sealed under another key: made again (and sealed anew)
    entry.unlink()
    os.mkfifo(entry)
    assert not cached_spec(resolve(str(model)))[1]


def test_caching_off_keeps_nothing(model, tmp_path, monkeypatch):
    monkeypatch.setenv("ONBOARD_CACHE_DIR", "off")
    assert cache.cache_dir() is None
    assert cached_spec(resolve(str(model)))[1] is False and cached_spec(resolve(str(model)))[1] is False
    assert not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_the_catalogue_ships_the_specs_onboard_makes_now():
    """Each catalogue model's shipped spec (catalogue/<slug>/spec.json) is the one inspecting it gives today; when
    onboard's readings change, `onboard catalogue --write-specs` makes them again (as `onboard check --fix` does
    bundles)."""
    from onboard.inspect.cache import SHIPPED, model_digest
    from onboard.inspect.inspection import inspect_source
    from onboard.inspect.spec import ModelSpec
    from onboard.source import catalogue_index

    stale = []
    for slug in catalogue_index():
        source = resolve(slug)
        shipped = json.loads((source.path / SHIPPED).read_text())
        # compared whatever transformers made it (another version's file is not read by plans, but must still be
        # what onboard makes): the model's files, then the spec itself
        if (shipped["model_digest"] != model_digest(source.path, slug)
                or ModelSpec.from_dict(shipped["spec"]).to_json() != inspect_source(source)[0].to_json()):
            stale.append(slug)
    assert not stale, f"stale shipped specs (run `onboard catalogue --write-specs`): {', '.join(stale)}"


def test_a_shipped_spec_is_taken_only_for_the_files_it_was_made_from(tmp_path, monkeypatch):
    import shutil

    import onboard.source
    from onboard.inspect.cache import catalogue_spec

    assert catalogue_spec("mixtral-8x7b") is not None
    assert catalogue_spec("mistralai/Mixtral-8x7B-v0.1") is not None  # by its HuggingFace id too, as resolve reads
    copy = tmp_path / "catalogue"
    shutil.copytree(onboard.source.CATALOGUE_DIR, copy)
    monkeypatch.setattr(onboard.source, "CATALOGUE_DIR", copy)
    assert catalogue_spec("mixtral-8x7b") is not None
    config = json.loads((copy / "mixtral-8x7b" / "config.json").read_text())
    config["num_hidden_layers"] = 7
    (copy / "mixtral-8x7b" / "config.json").write_text(json.dumps(config))
    assert catalogue_spec("mixtral-8x7b") is None  # another model now: inspected, not read
    monkeypatch.setattr(cache, "transformers_version", lambda: "0.0.1")
    assert catalogue_spec("deepseek-v3") is None  # read by another transformers: inspected too
    monkeypatch.undo()
    monkeypatch.setattr(onboard.source, "CATALOGUE_DIR", copy)
    (tmp_path / "mixtral-8x7b").mkdir()
    monkeypatch.chdir(tmp_path)
    assert catalogue_spec("deepseek-v3") is not None and catalogue_spec("mixtral-8x7b") is None  # a directory wins


def test_a_plan_of_a_catalogue_model_imports_neither_torch_nor_transformers_for_its_spec():
    import subprocess
    import sys

    code = ("import sys; from onboard.plan import load_spec; spec = load_spec('onboard-flagship-2.8t'); "
            "print(spec.name, 'torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["onboard-flagship-2.8t", "False", "False"]
