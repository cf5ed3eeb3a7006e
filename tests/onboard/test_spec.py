import json

import pytest

from onboard.inspect.spec import SCHEMA_VERSION, ModelSpec


def test_json_round_trip_is_exact(inspected):
    spec, _ = inspected("deepseek-v3")
    text = spec.to_json()
    again = ModelSpec.from_json(text)
    assert again == spec
    assert again.to_json() == text
    data = json.loads(text)
    for key in ("model_type", "num_layers", "params_total", "params_active", "layers", "schema_version"):
        assert key in data
    moe = data["layers"][3]["mlp"]
    assert {"num_experts", "top_k", "num_shared_experts"} <= set(moe)
    assert moe["router"]["score"] in ("softmax", "sigmoid")


def test_other_schema_version_is_refused(inspected):
    spec, _ = inspected("qwen3-8b")
    data = spec.to_dict()
    data["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(ValueError, match="schema version"):
        ModelSpec.from_dict(data)
