"""Families beyond their default configs (issue 13): for every family the support table lists, varied configs
drawn by the tests' own seeded generator (`tests.variety.draw`), saved with `save_pretrained` and read back,
must inspect right against the instantiated model's own structure (`tests.variety.structure`, which shares no
reading with the matchers) and adapt with verification passing.

The gate checks fixed cases only (`tests.variety.cases`, issue 53): seeds 0 and 1 of every family (a seed the
family's own code refuses falls back to a fixed later one) and every varied config that ever failed
(`tests/variety/regressions.jsonl`). Nothing here reads the date, the clock, the host or the environment. New
draws are discovery's job (`python -m tests.variety.discover`, daily in `.github/workflows/discovery.yml`); a
failure found there prints the line that adds it to the regression list.
"""

from __future__ import annotations

import pytest

from onboard.review.families import UNSUPPORTED, discover
from tests.variety.cases import FIXED_SEEDS, regressions, seeds_of_slot
from tests.variety.check import check, check_changes
from tests.variety.draw import draw
from tests.variety.structure import LayerExpect, disagreements

FAMILIES = [f for f in discover() if f not in UNSUPPORTED]


def _fixed_cases() -> list:
    """(family, seeds to try in turn) for each of the family's fixed slots."""
    return [pytest.param(family, seeds_of_slot(seed), id=f"{family}-{seed}")
            for family in FAMILIES for seed in FIXED_SEEDS]


@pytest.mark.family
@pytest.mark.parametrize("family, seeds", _fixed_cases())
def test_a_varied_config_inspects_right_and_verifies(family, seeds, tmp_path):
    refused = []
    for seed in seeds:
        outcome = check(family, seed, tmp_path / f"seed{seed}")
        if outcome.status != "refused":
            assert outcome.status == "passed", f"{family} seed {seed}:\n" + "\n".join(outcome.problems)
            return
        refused.append(f"seed {seed}: {outcome.problems[-1][:200]}")
    pytest.skip(f"{family}: the family's own code refused every draw of {'; '.join(refused)}")


@pytest.mark.family
@pytest.mark.parametrize("case", [pytest.param(r, id=r.case) for r in regressions()])
def test_every_varied_config_that_ever_failed_passes(case, tmp_path):
    """The regression list: each config kept as the changes that were drawn, checked as a fresh draw is."""
    assert case.family in FAMILIES, f"{case.case}: {case.family} is no longer a supported family"
    outcome = check_changes(case.family, case.changes, tmp_path, seed=case.seed)
    assert outcome.status == "passed", f"{case.case} (found {case.found}, {case.fix}):\n" + "\n".join(outcome.problems)


def test_draws_are_seeded_and_vary():
    a, b, c = draw("qwen3_moe", 0), draw("qwen3_moe", 0), draw("qwen3_moe", 1)
    assert a.changes == b.changes and a.changes != c.changes
    assert a.config.to_dict() == b.config.to_dict()
    assert {"hidden_size", "vocab_size", "num_hidden_layers"} <= set(a.changes)


def test_the_checker_sees_a_wrong_spec():
    """Planted: a spec that calls an MoE layer dense, or miscounts its experts, disagrees with the structure."""
    from types import SimpleNamespace as NS

    def spec(kind, experts):
        layer = NS(attention=NS(kind="softmax", window=None), mlp=NS(kind=kind, num_experts=experts, top_k=2))
        return NS(num_layers=1, layers=[layer])

    expect = [LayerExpect(0, "softmax", True, 8, 2, None, "Attention")]
    assert disagreements(spec("moe", 8), expect) == []
    assert any("layer is MoE" in d for d in disagreements(spec("dense", None), expect))
    assert any("the config says 8" in d for d in disagreements(spec("moe", 6), expect))


def test_the_regression_list_is_read_strictly(tmp_path):
    """Planted: a line that is not a case (a field missing, a wrong type, a case twice) is an error naming its line,
    never a smaller gate."""
    from tests.variety.cases import REGRESSIONS

    good = REGRESSIONS.read_text().splitlines()[0]
    assert len(regressions()) >= 8 and {"laguna-794", "longcat_flash-70", "longcat_flash-96"} <= {
        r.case for r in regressions()}
    for text in (good.replace('"fix"', '"fixed"'), good.replace('"seed": 794', '"seed": "794"'), f"{good}\n{good}"):
        (tmp_path / "list.jsonl").write_text(text + "\n")
        with pytest.raises(ValueError, match="list.jsonl:[12]"):
            regressions(tmp_path / "list.jsonl")


def test_discovery_draws_by_date_and_prints_the_regression_line(monkeypatch, capsys, tmp_path):
    """`python -m tests.variety.discover --dates A-B` draws each family's seed of those dates (across a month and a
    year's end); a failure prints the line that adds it to the regression list, which reads back as a case."""
    import argparse
    import json

    from tests.variety import discover
    from tests.variety.check import Outcome

    assert discover.run_dates("20261230-20270102") == [20261230, 20261231, 20270101, 20270102]
    assert discover.run_dates("20261207,20261209") == [20261207, 20261209]
    for bad in ("2026-1", "20261332", "tomorrow"):
        with pytest.raises(argparse.ArgumentTypeError):
            discover.run_dates(bad)
    assert discover.seed_range("2-4") == [2, 3, 4] and discover.seed_range("0,5") == [0, 5]
    seen = []

    def fake_check(family, seed, workdir):  # stands in for a whole adapt: what is tested is the bookkeeping
        seen.append((family, seed))
        status = "failed" if family == "qwen3_moe" else "passed"
        return Outcome(family, seed, status, ["planted"], 0, 0.0, {"hidden_size": 96})

    monkeypatch.setattr(discover, "check", fake_check)
    assert discover.main(["--dates", "20270101", "--families", "qwen3_moe,olmoe"]) == 1
    assert seen == [("qwen3_moe", discover.seed_of_run(20270101, "qwen3_moe")),
                    ("olmoe", discover.seed_of_run(20270101, "olmoe"))]
    line = capsys.readouterr().out.strip().splitlines()[-1]
    row = json.loads(line)
    assert row["case"] == f"qwen3_moe-{seen[0][1]}" and row["changes"] == {"hidden_size": 96} and row["fix"] == "open"
    assert "the draw of 20270101" in row["how"]
    (tmp_path / "list.jsonl").write_text(line + "\n")
    assert [r.case for r in regressions(tmp_path / "list.jsonl")] == [row["case"]]
