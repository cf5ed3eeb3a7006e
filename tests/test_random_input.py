"""Random JSON into every reader of user files (model config, plan, hardware spec, run log, model spec, bundle
source record): each either reads it or refuses it with its own one-line error, never another exception, and
within a time limit per input. Inputs are random documents and real documents with random fields changed."""

import json
import math
import os
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onboard.errors import OnboardError
from predictors.errors import PredictorError
from tests.helpers import ROOT

scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=12)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
SETTINGS = settings(max_examples=60, deadline=timedelta(seconds=10), derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def mutated(base: dict):
    """`base` with some fields replaced by random JSON, some removed, some added."""
    keys = st.sampled_from(sorted(base)) | st.text(min_size=1, max_size=10)
    return st.tuples(st.dictionaries(keys, json_values, max_size=4), st.sets(st.sampled_from(sorted(base)))).map(
        lambda change: {**{k: v for k, v in base.items() if k not in change[1]}, **change[0]})


def one_line(exc: BaseException) -> bool:
    return "\n" not in str(exc).strip()


def _jsonable(value) -> bool:
    try:
        json.dumps(value, allow_nan=True)
    except (ValueError, TypeError):
        return False
    return True


CONFIG = json.loads((ROOT / "onboard" / "catalogue" / "qwen3-30b-a3b" / "config.json").read_text())


@SETTINGS
@given(st.one_of(mutated(CONFIG), json_values))
def test_model_configs(document):
    from onboard.source import resolve

    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "config.json").write_text(json.dumps(document))
        try:
            resolve(folder)
        except OnboardError as exc:
            assert one_line(exc), str(exc)


PLAN = {"schema_version": 2, "dp_shard": 2, "ep": 2, "micro_batch": 1, "seq_len": 4096, "recompute": "none",
        "offload": "none", "dtype": "bf16", "lora": {"rank": 8, "alpha": 16.0, "targets": ["attention"]}}


@SETTINGS
@given(st.one_of(mutated(PLAN), json_values))
def test_plans(document):
    from runtime.plan import Plan

    try:
        plan = Plan.from_dict(document)
    except ValueError as exc:
        assert one_line(exc), str(exc)
    else:
        plan.problems(), plan.world_size, plan.to_json()  # what the loop and the planner read next
        assert Plan.from_dict(json.loads(plan.to_json())) == plan


HARDWARE = yaml.safe_load((ROOT / "predictors" / "hardware" / "h100.yaml").read_text())


@SETTINGS
@given(st.one_of(mutated(HARDWARE), json_values))
def test_hardware_specs(document):
    from predictors.hardware import load_file

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(document, f)
    try:
        hw = load_file(f.name)
    except PredictorError as exc:
        assert one_line(exc), str(exc)
    else:
        assert hw.peak_flops("bf16") > 0 and math.isfinite(hw.memory_bytes)
    finally:
        os.unlink(f.name)


RUN = json.loads((ROOT / "predictors" / "data" / "runlogs" / "cpu_sweep.jsonl").read_text().splitlines()[0])


@SETTINGS
@given(st.lists(st.one_of(mutated(RUN), json_values), min_size=1, max_size=4),
       st.lists(st.text(max_size=20), max_size=2))
def test_run_logs(records, garbage):
    from runtime.runlog import read_runs

    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write("\n".join([json.dumps(r) for r in records if _jsonable(r)] + garbage) + "\n")
    try:
        runs, skipped = read_runs(f.name)  # never raises: bad lines are skipped, each with a reason
        assert all(one_line(Exception(s.reason)) for s in skipped)
    finally:
        os.unlink(f.name)


@pytest.fixture(scope="module")
def spec_dict(inspected):
    return inspected("qwen3-30b-a3b")[0].to_dict()


@SETTINGS
@given(data=st.data())
def test_model_specs(spec_dict, data):
    from onboard.inspect.spec import ModelSpec

    document = data.draw(st.one_of(mutated(spec_dict), json_values))
    try:
        ModelSpec.from_dict(document)
    except ValueError as exc:
        assert one_line(exc), str(exc)


@SETTINGS
@given(st.one_of(mutated({"ref": "qwen3-8b", "kind": "catalogue", "trust_remote_code": False}), json_values))
def test_bundle_source_records(document):
    from onboard.bundle.files import read_bundle

    with tempfile.TemporaryDirectory() as folder:
        for name in ("spec.json", "adapter.py"):
            Path(folder, name).write_text("{}")
        Path(folder, "source.json").write_text(json.dumps(document))
        try:
            read_bundle(folder)
        except OnboardError as exc:
            assert one_line(exc), str(exc)
