"""Families beyond their default configs (issue 13): for every family the support table lists, varied configs
drawn by the tests' own seeded generator (`tests.variety.draw`), saved with `save_pretrained` and read back,
must inspect right against the instantiated model's own structure (`tests.variety.structure`, which shares no
reading with the matchers) and adapt with verification passing. CI checks one varied config of every family
(`family` tests, so outside the fast lane; about a minute in all), its seed drawn from the run's seed, which is
the UTC date unless ONBOARD_VARIETY_RUN names one: no single config is what passes, and a failure reproduces with
`ONBOARD_VARIETY_SEEDS=N -k FAMILY`, N from its test id. ONBOARD_VARIETY_SEEDS=0-7 checks every listed seed of
every family. A draw the family's own code refuses every attempt of describes no checkpoint: CI then checks the family's
other seed, and a seed named in ONBOARD_VARIETY_SEEDS is skipped, saying why.

    python -m tests.variety.report --seeds 4    # how many varied configs each family passed (the README column)
    python -m tests.variety.report --runs 20261207-20261213    # the draws CI makes on those dates
"""

from __future__ import annotations

import datetime
import os

import pytest

from onboard.review.families import UNSUPPORTED, discover
from tests.variety.check import check, seed_of_run
from tests.variety.draw import draw
from tests.variety.structure import LayerExpect, disagreements

FAMILIES = [f for f in discover() if f not in UNSUPPORTED]


def _seeds(text: str) -> list[int]:
    """"0-7" or "0,3,5"."""
    if "-" in text:
        low, high = text.split("-")
        return list(range(int(low), int(high) + 1))
    return [int(s) for s in text.split(",")]


def run_seed() -> int:
    """The run's seed: ONBOARD_VARIETY_RUN, else the UTC date as YYYYMMDD, so CI draws other configs every day
    (and the same ones all day: a failure reproduces with the seed its test id names)."""
    named = os.environ.get("ONBOARD_VARIETY_RUN")
    return int(named) if named else int(datetime.datetime.now(datetime.UTC).strftime("%Y%m%d"))


def _cases() -> list:
    """(family, seeds to try in turn): every named seed of every family with ONBOARD_VARIETY_SEEDS; by default one
    seed per family drawn from the run's seed (`run_seed`), the next tried where the first describes no
    checkpoint."""
    named = os.environ.get("ONBOARD_VARIETY_SEEDS")
    if named:
        return [pytest.param(family, (seed,), id=f"{family}-{seed}") for family in FAMILIES for seed in _seeds(named)]
    run = run_seed()
    seeds = {family: seed_of_run(run, family) for family in FAMILIES}
    return [pytest.param(family, (seeds[family], seeds[family] + 1), id=f"{family}-{seeds[family]}")
            for family in FAMILIES]


@pytest.mark.family
@pytest.mark.parametrize("family, seeds", _cases())
def test_a_varied_config_inspects_right_and_verifies(family, seeds, tmp_path):
    refused = []
    for seed in seeds:
        outcome = check(family, seed, tmp_path / f"seed{seed}")
        if outcome.status != "refused":
            assert outcome.status == "passed", f"{family} seed {seed}:\n" + "\n".join(outcome.problems)
            return
        refused.append(f"seed {seed}: {outcome.problems[-1][:200]}")
    pytest.skip(f"{family}: the family's own code refused every draw of {'; '.join(refused)}")


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


def test_the_report_names_the_draws_ci_makes_on_coming_dates(monkeypatch):
    """`python -m tests.variety.report --runs A-B` checks the seeds this test draws on those dates (across a month
    and a year's end), so a failure CI would meet on a coming day is found before that day."""
    import argparse

    from tests.variety.report import run_dates

    assert run_dates("20261230-20270102") == [20261230, 20261231, 20270101, 20270102]
    assert run_dates("20261207,20261209") == [20261207, 20261209]
    for bad in ("2026-1", "20261332", "tomorrow"):
        with pytest.raises(argparse.ArgumentTypeError):
            run_dates(bad)
    monkeypatch.setenv("ONBOARD_VARIETY_RUN", "20270101")
    assert {p.id for p in _cases()} == {f"{f}-{seed_of_run(20270101, f)}" for f in FAMILIES}
