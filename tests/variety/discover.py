"""Discovery: varied configs the gate does not check, drawn to find what onboard still gets wrong. Apart from the
gate (`python -m pytest` never runs this), and run daily by `.github/workflows/discovery.yml`.

    python -m tests.variety.discover                            # today's draws (UTC): one seed per family
    python -m tests.variety.discover --dates 20261207-20261213  # the draws of those days
    python -m tests.variety.discover --seeds 2-7                # seeds 2 to 7 of every family
    python -m tests.variety.discover --seeds 0-3 --table        # passed / drawn per family (the support table's column)

A date's draw gives each family the seed `seed_of_run(date, family)` (the next one where the family's own code
refuses it), as the gate's variety test did by date before issue 53. One line per draw; a failure also prints the
line that adds it to `tests/variety/regressions.jsonl`, where the gate checks it from then on, and the command
exits 1.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import sys
import tempfile

from onboard.review.families import UNSUPPORTED, discover
from tests.variety.cases import REGRESSIONS, Regression
from tests.variety.check import Outcome, check


def seed_of_run(run: int, family: str) -> int:
    """The seed of `family` that the draws of date `run` (YYYYMMDD) give."""
    return random.Random(f"{run}:{family}").randrange(1000)


def run_dates(text: str) -> list[int]:
    """"20261207-20261213" (every date between, both included) or "20261207,20261209": run seeds."""
    try:
        if "-" in text:
            low, high = (datetime.datetime.strptime(t, "%Y%m%d").date() for t in text.split("-"))
            return [int((low + datetime.timedelta(days=d)).strftime("%Y%m%d")) for d in range((high - low).days + 1)]
        return [int(datetime.datetime.strptime(t, "%Y%m%d").strftime("%Y%m%d")) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not YYYYMMDD-YYYYMMDD or a comma-separated list of dates")


def seed_range(text: str) -> list[int]:
    """"2-7" or "0,3,5": seeds."""
    try:
        if "-" in text:
            low, high = (int(t) for t in text.split("-"))
            seeds = list(range(low, high + 1))
        else:
            seeds = [int(t) for t in text.split(",")]
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a seed range (2-7) or a comma-separated list of seeds")
    return seeds


def today() -> int:
    """Today's date (UTC) as YYYYMMDD: discovery's default draw. The gate never calls this."""
    return int(datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d"))


def regression_line(outcome: Outcome, how: str) -> str:
    """The line that adds a failed draw to the regression list (its fix still open)."""
    found = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return Regression(f"{outcome.family}-{outcome.seed}", outcome.family, outcome.seed, found, how, "open",
                      outcome.changes).line()


def _draws(args, families: list[str]) -> list[tuple[str, str, tuple[int, ...]]]:
    """(what drew it, family, seeds to try in turn) for each draw asked for."""
    if args.seeds:
        return [(f"seed {s}", f, (s,)) for f in families for s in args.seeds]
    return [(f"the draw of {run}", family, (seed_of_run(run, family), seed_of_run(run, family) + 1))
            for run in args.dates or [today()] for family in families]


def _table(outcomes: list[Outcome], families: list[str]) -> None:
    for family in families:
        drawn = [o for o in outcomes if o.family == family and o.status != "refused"]
        passed = sum(o.status == "passed" for o in drawn)
        failures = "; ".join(f"seed {o.seed}: {o.problems[0][:160]}" for o in drawn if o.status == "failed")
        print(f"{family}\t{passed}/{len(drawn)}\t{failures}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--dates", type=run_dates, metavar="DATES",
                       help="the draws of these UTC dates (YYYYMMDD-YYYYMMDD or a comma list; default: today)")
    which.add_argument("--seeds", type=seed_range, metavar="SEEDS", help="these seeds of every family (2-7 or 0,3,5)")
    parser.add_argument("--families", help="comma-separated families (default: every supported one)")
    parser.add_argument("--table", action="store_true", help="one line per family: passed / drawn (the README column)")
    args = parser.parse_args(argv)
    supported = [f for f in discover() if f not in UNSUPPORTED]
    families = args.families.split(",") if args.families else supported
    unknown = [f for f in families if f not in supported]
    if unknown:
        parser.error(f"not a supported family of the installed transformers: {', '.join(unknown)}")
    failed: list[str] = []
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory() as tmp:
        # kernels the adapts render go with the bundles, not into the repository's store
        os.environ.setdefault("ONBOARD_KERNEL_STORE", os.path.join(tmp, "kernels"))
        for how, family, seeds in _draws(args, families):
            for seed in seeds:
                outcome = check(family, seed, tempfile.mkdtemp(dir=tmp))
                if outcome.status != "refused":
                    break
            outcomes.append(outcome)
            if not args.table:
                problem = f"\t{outcome.problems[0][:200]}" if outcome.status == "failed" else ""
                print(f"{how}\t{family}-{outcome.seed}\t{outcome.status}{problem}", flush=True)
            if outcome.status == "failed":
                failed.append(regression_line(outcome, f"tests.variety.discover: {how}"))
    if args.table:
        _table(outcomes, families)
    if failed:
        print(f"\n{len(failed)} failed; each line below adds one to {REGRESSIONS.relative_to(REGRESSIONS.parents[2])} "
              "(set its fix when it is fixed):")
        print("\n".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
