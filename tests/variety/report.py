"""How many varied configs of each family onboard described right and verified: the README support table's
column. `python -m tests.variety.report [--seeds N] [--families a,b]` prints one line per family.

`--runs 20261207-20261213` checks instead the configs CI's variety test will draw on those UTC dates (each
family's seed of that day, the next one where the family's code refuses it), one line per draw: a failure found
here is one CI would meet that day."""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile

from onboard.review.families import UNSUPPORTED, discover
from tests.variety.check import check, seed_of_run


def _seed_count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of seeds above zero")
    return int(text)


def run_dates(text: str) -> list[int]:
    """"20261207-20261213" (every date between, both included) or "20261207,20261209": run seeds."""
    try:
        if "-" in text:
            low, high = (datetime.datetime.strptime(t, "%Y%m%d").date() for t in text.split("-"))
            return [int((low + datetime.timedelta(days=d)).strftime("%Y%m%d")) for d in range((high - low).days + 1)]
        return [int(datetime.datetime.strptime(t, "%Y%m%d").strftime("%Y%m%d")) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not YYYYMMDD-YYYYMMDD or a comma-separated list of dates")


def _check_runs(runs: list[int], families: list[str], tmp: str) -> None:
    for run in runs:
        for family in families:
            seed = seed_of_run(run, family)
            outcome = check(family, seed, tempfile.mkdtemp(dir=tmp))
            if outcome.status == "refused":
                outcome = check(family, seed + 1, tempfile.mkdtemp(dir=tmp))
            problems = f"\t{outcome.problems[0][:200]}" if outcome.status == "failed" else ""
            print(f"{run}\t{family}-{outcome.seed}\t{outcome.status}{problems}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=_seed_count, default=4, metavar="N", help="seeds per family (0 .. N-1)")
    parser.add_argument("--families", help="comma-separated families (default: every supported one)")
    parser.add_argument("--runs", type=run_dates, metavar="DATES",
                        help="the draws CI makes on these UTC dates (YYYYMMDD-YYYYMMDD or a comma list), not seeds")
    args = parser.parse_args()
    supported = [f for f in discover() if f not in UNSUPPORTED]
    families = args.families.split(",") if args.families else supported
    unknown = [f for f in families if f not in supported]
    if unknown:
        parser.error(f"not a supported family of the installed transformers: {', '.join(unknown)}")
    with tempfile.TemporaryDirectory() as tmp:
        # kernels the adapts render go with the bundles, not into the repository's store
        os.environ.setdefault("ONBOARD_KERNEL_STORE", os.path.join(tmp, "kernels"))
        if args.runs:
            return _check_runs(args.runs, families, tmp)
        for family in families:
            outcomes = [check(family, seed, tempfile.mkdtemp(dir=tmp)) for seed in range(args.seeds)]
            drawn = [o for o in outcomes if o.status != "refused"]
            passed = sum(o.status == "passed" for o in drawn)
            failures = "; ".join(f"seed {o.seed}: {o.problems[0][:160]}" for o in drawn if o.status == "failed")
            print(f"{family}\t{passed}/{len(drawn)}\t{failures}", flush=True)


if __name__ == "__main__":
    main()
