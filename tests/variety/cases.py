"""The varied configs the gate checks: a function of the commit alone.

Every supported family is checked at two fixed seeds (`FIXED_SEEDS`), and every varied config that has ever
failed is checked again from the committed regression list (`regressions.jsonl`, one JSON object a line: the
case's name, its family and seed, the date it was found, how, the fix that closed it, and the config's changes
over the family's default). A regression keeps the drawn changes themselves, not only its seed: the generator
grows (a new field drawn moves every later draw of a seed), and the case must stay the config that failed.

The date-seeded draws that find new cases run apart from the gate (`python -m tests.variety.discover`); a
failure there prints the line to append to `regressions.jsonl`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

REGRESSIONS = Path(__file__).with_name("regressions.jsonl")

# Each family's two fixed varied configs: seed 0 and seed 1 of `tests.variety.draw`. Where the family's own code
# refuses every attempt of one, the seed FALLBACK further on is tried in its place (a fixed order, so the gate still
# checks the same configs on every run).
FIXED_SEEDS = (0, 1)
FALLBACK = 2  # seed s falls back to s + 2, then s + 4
TRIES = 3


def seeds_of_slot(seed: int) -> tuple[int, ...]:
    """The seeds a fixed slot tries in turn: `seed`, then the fallbacks."""
    return tuple(seed + FALLBACK * k for k in range(TRIES))


@dataclass(frozen=True)
class Regression:
    case: str  # "<family>-<seed>": the test id
    family: str
    seed: int | None  # the seed that drew it, where known
    found: str  # YYYY-MM-DD
    how: str  # what found it (a CI run's draw, a discovery run, a sweep)
    fix: str  # "<commit>: what closed it" ("open" until it is fixed)
    changes: dict = field(default_factory=dict)  # dotted config field -> value, over the family's default

    def line(self) -> str:
        return json.dumps(asdict(self))


FIELDS = {"case": str, "family": str, "found": str, "how": str, "fix": str, "changes": dict}


def regressions(path: Path = REGRESSIONS) -> list[Regression]:
    """The committed regression list, checked field by field (a line that is not a case is an error that names
    its line, never a silently smaller gate)."""
    out, names = [], set()
    for number, text in enumerate(path.read_text().splitlines(), 1):
        if not text.strip():
            continue
        row = json.loads(text)
        wrong = [name for name, kind in FIELDS.items() if not isinstance(row.get(name), kind)]
        if wrong or set(row) - {*FIELDS, "seed"} or not isinstance(row.get("seed"), (int, type(None))):
            raise ValueError(f"{path.name}:{number}: not a regression case (fields {sorted(row)}; wrong: {wrong})")
        if row["case"] in names:
            raise ValueError(f"{path.name}:{number}: case {row['case']!r} is listed twice")
        names.add(row["case"])
        out.append(Regression(**row))
    return out
