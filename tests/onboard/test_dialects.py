"""Models whose configs speak a dialect of their own: every fact the pipeline needs is read from the model.

Two remote-code fixtures name nothing as transformers does (`lexicon_size`, `breadth`, `strata`,
`specialists`, `consulted`, ...): Quorum (tests/fixtures/dialect_moe), a 10B MoE the twin shrinks by what
each field is seen to drive, and Braid (tests/fixtures/dialect_hybrid), a tiny gated-delta-rule / softmax
hybrid MoE whose widths are tied by its config's validator, so that it serves as its own twin.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from onboard.bundle.files import read_decision
from onboard.bundle.make import adapt
from onboard.errors import OnboardError
from onboard.inspect.inspection import inspect_source
from onboard.source import resolve
from onboard.train.model import build_model, train_config
from onboard.twin import Twin
from onboard.twin import behaviour as dialect
from onboard.twin import build as twin_module
from onboard.twin.build import TwinConfig, as_is
from onboard.twin.shrink import Shrink

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
QUORUM, BRAID = FIXTURES / "dialect_moe", FIXTURES / "dialect_hybrid"


def _variant(tmp_path: Path, fixture: Path, **fields) -> str:
    """A copy of a fixture with config.json fields added or changed."""
    out = tmp_path / fixture.name
    shutil.copytree(fixture, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **fields}))
    return str(out)


@pytest.fixture(scope="module")
def quorum(tmp_path_factory):
    out = tmp_path_factory.mktemp("quorum") / "bundle"
    spec, verification = adapt(resolve(str(QUORUM), trust_remote_code=True), out)
    return spec, verification, out


@pytest.fixture(scope="module")
def braid(tmp_path_factory):
    out = tmp_path_factory.mktemp("braid") / "bundle"
    spec, verification = adapt(resolve(str(BRAID), trust_remote_code=True), out)
    return spec, verification, out


# -- the probing itself, on a plain PyTorch model -------------------------------------------------------


class _Toy(nn.Module):
    """words: vocabulary; wide: hidden; depth: layers; crowd / pool: experts as modules / as a 3-D stack;
    inner: a width; pick: sizes nothing; left / right: must be equal (a validator ties them)."""

    def __init__(self, cfg: dict):
        super().__init__()
        if cfg["left"] != cfg["right"]:
            raise ValueError("left and right must match")
        self.table = nn.Embedding(cfg["words"], cfg["wide"])
        self.rows = nn.ModuleList(_ToyLayer(cfg) for _ in range(cfg["depth"]))

    def get_input_embeddings(self):
        return self.table


class _ToyLayer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.crowd = nn.ModuleList(nn.Linear(cfg["wide"], cfg["inner"]) for _ in range(cfg["crowd"]))
        self.stack = nn.Parameter(torch.empty(cfg["pool"], cfg["inner"], cfg["wide"]))
        self.sides = nn.Linear(cfg["left"], cfg["wide"])


def test_fields_are_read_by_what_they_drive():
    cfg = {"words": 1000, "wide": 48, "depth": 6, "crowd": 4, "pool": 8, "inner": 96, "pick": 2, "left": 5,
           "right": 5, "nested": {"pick_too": 7}}

    def build(c):
        with torch.device("meta"):
            return _Toy(c)

    found = dialect.probe_fields(build, cfg, dialect.candidates(cfg))
    assert found == {"words": "vocab", "wide": "hidden", "depth": "layers", "crowd": "experts", "pool": "experts",
                     "inner": "width", "pick": "inert", "left": "tied", "right": "tied", "nested.pick_too": "inert"}
    # label maps and token ids are bookkeeping, never probed
    assert dialect.candidates({"label2id": {"a": 1}, "pad_token_id": 3, "x": 2}) == ["x"]


# -- Quorum: shrunk by behaviour ------------------------------------------------------------------------


def test_quorum_twin_is_shrunk_by_behaviour():
    twin = Twin.build(resolve(str(QUORUM), trust_remote_code=True))
    assert "input embedding" in twin.why_probed
    assert {p: twin.fields[p] for p in ("lexicon_size", "breadth", "strata", "specialists", "consulted", "horizon")} \
        == {"lexicon_size": "vocab", "breadth": "hidden", "strata": "layers", "specialists": "experts",
            "consulted": "inert", "horizon": "inert"}
    shrunk = {s.path: (s.meaning, s.full, s.twin) for s in twin.shrinks}
    assert shrunk["lexicon_size"] == ("vocab", 65536, 512) and shrunk["breadth"] == ("hidden", 2048, 64)
    assert shrunk["specialists"][1:] == (64, 16)  # its top-k field is unknown: room for the model's own k
    assert shrunk["strata"] == ("layers", 24, 2)  # one dense layer, one MoE layer show every layer kind
    # widths of unknown meaning each get a twin value no other field holds, so they map back one to one
    widths = [s.twin for s in twin.shrinks if s.meaning == "width"]
    assert {"voice_width", "specialist_breadth", "steward_breadth", "plain_breadth"} <= set(shrunk)
    assert len(set(widths)) == len(widths)
    # what drives nothing stays as it is: the top-k, the position limit
    assert twin.config.consulted == 6 and twin.config.horizon == 8192
    assert (twin.vocab_size, twin.hidden_size) == (512, 64)
    assert sum(p.numel() for p in twin.model.parameters()) < 1_000_000


def test_quorum_inspects_at_full_scale(quorum):
    spec, _, _ = quorum
    assert (spec.vocab_size, spec.hidden_size, spec.num_layers) == (65536, 2048, 24)
    assert [layer.mlp.kind for layer in spec.layers] == ["dense"] + ["moe"] * 23
    assert {layer.attention.kind for layer in spec.layers} == {"softmax"}
    attn = spec.layers[5].attention
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (16, 4, 128)
    moe = spec.layers[5].mlp
    assert (moe.num_experts, moe.top_k, moe.expert_ffn, moe.expert_layout) == (64, 6, 1024, "fused")
    assert (moe.num_shared_experts, moe.shared_expert_ffn) == (1, 2816)
    assert moe.router.score == "softmax" and moe.router.renormalize and moe.activation == "silu" and moe.gated
    assert spec.layers[0].mlp.ffn == 8192
    hidden, vocab = 2048, 65536
    attention = 2 * hidden * 16 * 128 + 2 * hidden * 4 * 128
    norms = 2 * hidden
    moe_layer = attention + norms + hidden * 64 + 64 * 3 * hidden * 1024 + 3 * hidden * 2816
    total = 2 * vocab * hidden + (attention + norms + 3 * hidden * 8192) + 23 * moe_layer + hidden
    assert spec.params_total == total
    assert spec.params_active == total - 23 * (64 - 6) * 3 * hidden * 1024 - vocab * hidden
    assert not spec.unmatched


def test_experts_as_a_list_of_modules_are_taken_with_their_block(tmp_path):
    """Issue 36: a disguised model whose experts are small MLP modules (softmax, top-k, renormalised) has its whole
    block swapped, the experts read per module; the block's own code never runs under verification."""
    roster = _variant(tmp_path, QUORUM, specialists_as_modules=True)
    spec, verification = adapt(resolve(roster, trust_remote_code=True), tmp_path / "bundle")
    moe = spec.layers[5].mlp
    assert (moe.num_experts, moe.top_k, moe.expert_ffn, moe.expert_layout) == (64, 6, 1024, "modules")
    assert verification.passed, verification.note
    assert [m.takes for m in read_decision(tmp_path / "bundle").moe] == ["block"]
    assert all(s.runtime_calls and not s.original_calls for s in verification.seeds)


def test_quorum_adapts_with_its_top_k_as_a_literal(quorum):
    _, verification, out = quorum
    assert verification.passed, verification.note
    assert verification.replaced == verification.expected == 1
    entry = read_decision(out).moe[0]
    assert entry.takes == "block" and entry.routing.top_k == "6"  # no config field holds it: a literal
    assert "top_k=6," in (out / "adapter.py").read_text()


def test_quorum_trains_by_its_own_fields(quorum):
    _, _, out = quorum
    cfg = train_config(out, layers=3, width=2, trust_remote_code=True)
    assert cfg["strata"] == 3 and cfg["breadth"] == 128 and cfg["lexicon_size"] == 512
    model, record = build_model(out, layers=2, trust_remote_code=True)
    assert len(model.body.strata) == 2
    # the run log describes what is trained, through the fields the twin shrank by what they drive
    assert (record["layers"], record["hidden"], record["vocab"], record["experts"], record["top_k"]) == \
        (2, 64, 512, 16, 6)
    assert (record["ffn"], record["expert_ffn"], record["heads"], record["kv_heads"], record["head_dim"]) == \
        (56, 48, 16, 4, 32)
    assert [(m["heads"], m["head_dim"], m["v_head_dim"]) for m in record["mixers"]] == [(16, 32, 32)]


def test_lying_hints_are_overruled(tmp_path):
    """Fields named as transformers names them that size nothing: none is taken for what its name says. The
    top-k hint holds the model's value at full size, but the twin shrinks it and the model never reads it: the
    adapter must not read it either."""
    ref = _variant(tmp_path, QUORUM, vocab_size=50, hidden_size=4096, num_hidden_layers=99, num_experts=8,
                   num_experts_per_tok=6)
    spec, verification = adapt(resolve(ref, trust_remote_code=True), tmp_path / "bundle")
    assert (spec.vocab_size, spec.hidden_size, spec.num_layers) == (65536, 2048, 24)
    moe = spec.layers[1].mlp
    assert (moe.num_experts, moe.top_k) == (64, 6) and not moe.router.config_fields
    assert verification.passed, verification.note
    assert read_decision(tmp_path / "bundle").moe[0].routing.top_k == "6"
    twin = Twin.build(resolve(ref, trust_remote_code=True))
    assert {twin.fields[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_experts")} == {"inert"}
    assert {s.path for s in twin.shrinks} >= {"lexicon_size", "breadth", "specialists", "strata"}
    assert not {"vocab_size", "hidden_size", "num_hidden_layers", "num_experts"} & {s.path for s in twin.shrinks}


def test_a_head_count_that_sizes_nothing_still_divides_the_twin(tmp_path):
    """novel_moe in a dialect, 24 heads whose size is the width over the head count: that count sizes no
    parameter, so behaviour never finds it; the twin's width keeps the model's odd factors (3072 -> 96, not 64,
    which 24 does not divide) and the head size at full scale is derived as the model derives it."""
    out = tmp_path / "renamed"
    shutil.copytree(FIXTURES / "novel_moe", out)
    words = {"vocab_size": "wordstock", "hidden_size": "girth", "num_hidden_layers": "tiers",
             "num_attention_heads": "mouths", "ffn_hidden_size": "kitchen", "n_experts": "guild"}
    for path in out.iterdir():
        text = path.read_text()
        for old, new in words.items():
            text = text.replace(old, new)
        path.write_text(text)
    ref = _variant(tmp_path / "sized", out, girth=3072, mouths=24)
    twin = Twin.build(resolve(ref, trust_remote_code=True))
    assert twin.fields["mouths"] == "inert" and twin.hidden_size == 96
    spec, _ = inspect_source(resolve(ref, trust_remote_code=True))
    attn = spec.layers[0].attention
    assert (spec.hidden_size, attn.num_heads, attn.head_dim) == (3072, 24, 128)


# -- Braid: a hybrid that is its own twin -----------------------------------------------------------------


def test_braid_is_its_own_twin():
    twin = Twin.build(resolve(str(BRAID), trust_remote_code=True))
    assert twin.why_probed and twin.shrinks == []
    # breadth = voices x voice_width is checked by the config: none of the three can change alone
    assert {twin.fields[k] for k in ("breadth", "voices", "voice_width")} == {"tied"}
    assert twin.fields["lexicon_size"] == "vocab" and twin.fields["strata"] == "layers"
    assert (twin.vocab_size, twin.hidden_size, len(twin.layer_signatures)) == (384, 96, 4)


def test_braid_inspects(braid):
    spec, _, _ = braid
    kinds = [layer.attention.kind for layer in spec.layers]
    assert kinds == ["linear:gated_deltanet"] * 3 + ["softmax"]
    linear, soft = spec.layers[0].attention, spec.layers[3].attention
    assert (linear.num_heads, linear.head_dim, linear.conv_kernel, linear.gate) == (4, 16, 4, "scalar")
    assert (soft.num_heads, soft.num_kv_heads, soft.head_dim) == (6, 2, 16)
    moe = spec.layers[0].mlp
    assert (moe.num_experts, moe.top_k, moe.expert_ffn, moe.router.score) == (8, 2, 48, "sigmoid")
    assert set(moe.expert_weights) == {"gate", "up", "down"}
    hidden, vocab = 96, 384
    experts = 8 * 3 * hidden * 48
    current = 3 * hidden * 64 + 3 * 64 * 4 + 2 * hidden * 4 + 2 * 4 + 64 * hidden
    gaze = hidden * 96 + 2 * hidden * 32 + 96 * hidden
    layer = 2 * hidden + hidden * 8 + experts
    total = 2 * vocab * hidden + 3 * (current + layer) + (gaze + layer) + hidden
    assert spec.params_total == total
    assert spec.params_active == total - 4 * experts * 6 // 8 - vocab * hidden


def test_braid_adapts_with_the_runtime_delta_rule(braid):
    _, verification, out = braid
    assert verification.passed, verification.note
    assert verification.replaced == verification.expected == 4
    assert all(r.runtime_attention_calls for r in verification.seeds)
    decision = read_decision(out)
    linear = next(e for e in decision.attention if e.kind == "linear:gated_deltanet")
    assert linear.takes == "linear" and linear.cores == ["causal_conv1d", "chunk_gated_delta"]
    assert decision.loss.takes


def test_a_large_model_nothing_can_shrink_is_refused(tmp_path):
    """Tied widths and a 400M-parameter layer: no safe twin, and too big to be its own."""
    ref = _variant(tmp_path, BRAID, breadth=6 * 2048, voice_width=2048)
    with pytest.raises(OnboardError, match="no config field could be shrunk safely"):
        Twin.build(resolve(ref, trust_remote_code=True))


def test_a_shrunk_twin_that_does_not_run_gives_way_to_the_model_as_it_is(monkeypatch):
    source = resolve(str(BRAID), trust_remote_code=True)
    # one expert builds, but a top-2 router over it cannot run
    broken = TwinConfig({**source.config.to_dict(), "specialists": 1}, [Shrink("specialists", "experts", 8, 1)],
                        "strata", {"specialists": "experts"}, "planted")
    monkeypatch.setattr(twin_module, "twin_config", lambda _: broken)
    twin = Twin.build(source)
    assert twin.shrinks == [] and twin.full_width and "did not run" in twin.why_probed
    assert twin.config.specialists == 8
    # a model too large to be its own twin has no such way out
    quorum = resolve(str(QUORUM), trust_remote_code=True)
    assert as_is(quorum, TwinConfig({}, [Shrink("breadth", "hidden", 2048, 64)], "strata", {}, "planted")) is None


def test_named_families_are_shrunk_by_names_alone():
    twin = Twin.build(resolve("mixtral-8x7b"))
    assert twin.why_probed is None and twin.fields == {}
