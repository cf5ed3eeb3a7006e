"""How many varied configs of each family onboard described right and verified: the README support table's
column. `python -m tests.variety.report [--seeds N] [--families a,b]` prints one line per family."""

from __future__ import annotations

import argparse
import os
import tempfile

from onboard.review.families import UNSUPPORTED, discover
from tests.variety.check import check


def _seed_count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of seeds above zero")
    return int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=_seed_count, default=4, metavar="N", help="seeds per family (0 .. N-1)")
    parser.add_argument("--families", help="comma-separated families (default: every supported one)")
    args = parser.parse_args()
    supported = [f for f in discover() if f not in UNSUPPORTED]
    families = args.families.split(",") if args.families else supported
    unknown = [f for f in families if f not in supported]
    if unknown:
        parser.error(f"not a supported family of the installed transformers: {', '.join(unknown)}")
    with tempfile.TemporaryDirectory() as tmp:
        # kernels the adapts render go with the bundles, not into the repository's store
        os.environ.setdefault("ONBOARD_KERNEL_STORE", os.path.join(tmp, "kernels"))
        for family in families:
            outcomes = [check(family, seed, tempfile.mkdtemp(dir=tmp)) for seed in range(args.seeds)]
            drawn = [o for o in outcomes if o.status != "refused"]
            passed = sum(o.status == "passed" for o in drawn)
            failures = "; ".join(f"seed {o.seed}: {o.problems[0][:160]}" for o in drawn if o.status == "failed")
            print(f"{family}\t{passed}/{len(drawn)}\t{failures}", flush=True)


if __name__ == "__main__":
    main()
