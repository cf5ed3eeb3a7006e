"""The contracts without a module of their own before (verification.json, kernels.json, source.json, launch.json): each
carries schema_version, reads back into its dataclass and writes the same bytes again, reads the unversioned files
bundles held before as version 0, and refuses anything else in one line naming the file and the field."""

import json
from pathlib import Path

import pytest

from onboard import contract
from onboard.adapt.verify import SCHEMA_VERSION, SeedResult, Verification
from onboard.bundle.files import read_bundle, read_verification
from onboard.bundle.kernel_list import KernelList, KernelRecord, read_kernels
from onboard.bundle.source_record import SourceRecord
from onboard.errors import OnboardError
from onboard.train.launch import LaunchRecord
from runtime.plan import Plan

ROOT = Path(__file__).resolve().parents[2]
BUNDLES = sorted(p.parent for p in (ROOT / "bundles").glob("*/spec.json"))


def _verification() -> Verification:
    seeds = [SeedResult(seed=i, logits_max_abs=0.0, logits_max_rel=1e-7 * i, loss_ref=6.25, loss_adapted=6.25,
                        kl=0, grads_checked=14, grad_worst_rel=3e-7, grad_worst_param="model.norm.weight",
                        grad_failures=["model.layers.0.mlp.gate.weight"] if i else [], truth="fp64", passed=not i)
             for i in range(2)]
    return Verification(False, 1, 2, seeds, {"err_factor": 10.0, "loss_rtol": 1e-5}, "a note",
                        backends={"grouped_mm": "cpu"}, swaps={"moe_block": {"expected": 2, "made": 1}},
                        packed={"kept_apart": True})


def test_verification_round_trip():
    record = _verification()
    text = record.to_json()
    again = Verification.from_dict(json.loads(text))
    assert again == record and again.to_json() == text
    assert json.loads(text)["schema_version"] == SCHEMA_VERSION == 1
    assert again.seeds[0].kl == 0 and isinstance(again.seeds[0].kl, int)  # numbers as written: the same bytes


def test_kernel_list_and_source_record_round_trip():
    kernels = KernelList([KernelRecord("loss_triton-0123456789ab", "kernels/loss_triton.py.j2",
                                       {"block": 4096, "name": "m"}, "0" * 64)])
    assert KernelList.from_dict(json.loads(kernels.to_json())) == kernels
    assert json.loads(kernels.to_json())["schema_version"] == 1
    source = SourceRecord("qwen3-8b", "catalogue", False)
    assert SourceRecord.from_dict(json.loads(source.to_json())) == source
    assert json.loads(source.to_json()) == {"schema_version": 1, "ref": "qwen3-8b", "kind": "catalogue",
                                            "trust_remote_code": False}


def test_launch_record_round_trip_reads_its_unversioned_form_and_holds_no_consent():
    """launch.json, in a run's checkpoint folder: what `onboard export` rebuilds the trained model from."""
    record = LaunchRecord("/runs/bundle", "0" * 64, "/models/released", Plan(dtype="fp32", seq_len=64).to_dict())
    text = record.to_json()
    again = LaunchRecord.from_dict(json.loads(text))
    assert again == record and again.to_json() == text and json.loads(text)["schema_version"] == 1
    old = json.loads(text)
    del old["schema_version"]  # as runs wrote it before it had a version
    assert LaunchRecord.from_dict(old).schema_version == 0
    with pytest.raises(OnboardError, match="launch.json: 'trust_remote_code' is not a field of LaunchRecord"):
        LaunchRecord.from_dict({**old, "trust_remote_code": True})
    with pytest.raises(OnboardError, match="launch.json: 'plan' must be an object, not text"):
        LaunchRecord.from_dict({**old, "plan": "pp=2"})


@pytest.mark.parametrize("bundle", BUNDLES, ids=[b.name for b in BUNDLES])
def test_every_committed_bundle_holds_each_contract_as_its_writer_writes_it(bundle):
    for name, record in (("verification.json", read_verification(bundle)), ("kernels.json", read_kernels(bundle)),
                         ("source.json", read_bundle(bundle)[2])):
        assert record.schema_version == 1, name
        assert record.to_json() == (bundle / name).read_text(), name


def test_unversioned_files_read_as_version_0(tmp_path):
    """What bundles held before these contracts had a version: a base branch's bundle is reviewed against them."""
    old = _verification().to_dict()
    del old["schema_version"]
    assert Verification.from_dict(old).schema_version == 0
    record = KernelList.from_dict([{"key": "k-0123456789ab", "template": "t", "params": {}, "sha256": "0" * 64}])
    assert record.schema_version == 0 and record.keys() == ["k-0123456789ab"]
    assert SourceRecord.from_dict({"ref": "m", "kind": "local", "trust_remote_code": False}).schema_version == 0


def _broken(data: dict, path: tuple, value) -> dict:
    """`data` with the field at `path` (keys and list indices) set to `value`, or removed where `value` is ...."""
    data = json.loads(json.dumps(data))
    owner = data
    for step in path[:-1]:
        owner = owner[step]
    if value is ...:
        del owner[path[-1]]
    else:
        owner[path[-1]] = value
    return data


@pytest.mark.parametrize("path, value, words", [
    (("seeds", 1, "kl"), "0.1", r"x/verification.json: 'seeds'\[1\]: 'kl' must be a number, not text"),
    (("seeds", 1, "grad_failures", 0), 3, r"'seeds'\[1\]: 'grad_failures'\[0\] must be text, not a whole number"),
    (("passed",), 1, "'passed' must be true or false, not a whole number"),
    (("replaced",), True, "'replaced' must be a whole number, not true or false"),
    (("tolerances",), [], "'tolerances' must be an object, not a list"),
    (("seeds",), None, "'seeds' must be a list, not null"),
    (("seeds", 0, "seed"), ..., r"'seeds'\[0\]: no 'seed'"),
    (("colour",), "red", "'colour' is not a field of Verification"),
    (("schema_version",), 2, "schema_version 2 is not 1"),
    (("schema_version",), True, "schema_version True is not 1"),
])
def test_a_malformed_verification_is_one_line_naming_the_file_and_field(path, value, words):
    data = _broken(_verification().to_dict(), path, value)
    with pytest.raises(OnboardError, match=words) as err:
        Verification.from_dict(data, "x/verification.json")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("text, words", [
    ("{not json", "kernels.json: not JSON"),
    ('{"schema_version": 1, "kernels": [{"key": "k"}]}', r"kernels.json: 'kernels'\[0\]: no 'template'"),
    ('{"schema_version": 1, "kernels": {}}', "'kernels' must be a list, not an object"),
    ('"kernels"', "kernels.json must be a JSON object"),
    (json.dumps([{"key": "k", "template": "t", "params": {}, "sha256": "0"}] * 65), "more than 64 kernel records"),
])
def test_a_malformed_kernel_list_is_one_line_naming_the_file(tmp_path, text, words):
    (tmp_path / "kernels.json").write_text(text)
    with pytest.raises(OnboardError, match=words):
        read_kernels(tmp_path)


def test_a_contract_field_of_an_unread_type_is_a_programming_error():
    from dataclasses import dataclass

    @dataclass
    class Odd:
        when: complex

    with pytest.raises(TypeError, match="not read by onboard.contract"):
        contract.build(Odd, {"when": 1}, "odd.json")
