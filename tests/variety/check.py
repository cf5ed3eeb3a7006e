"""One varied config through onboard, the way a user's checkpoint goes: saved with `save_pretrained`, resolved
from its folder, inspected (and adapted and verified), and the spec held against the model's own structure
(`onboard.structure`, which shares no reading with the matchers)."""

from __future__ import annotations

import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from onboard.errors import one_line
from tests.variety.structure import disagreements, expected
from tests.variety.draw import Draw, draw


def seed_of_run(run: int, family: str) -> int:
    """The seed of `family` that CI's variety test draws in the run seeded `run` (the UTC date as YYYYMMDD)."""
    return random.Random(f"{run}:{family}").randrange(1000)


@dataclass
class Outcome:
    family: str
    seed: int
    status: str  # "passed" | "failed" | "refused" (the family's own code refused every attempt of this seed)
    problems: list[str]
    refused_attempts: int  # attempts of this seed the family's own code refused
    seconds: float

    @property
    def name(self) -> str:
        return f"{self.family}-seed{self.seed}"


def check(family: str, seed: int, workdir: Path | None = None, *, adapt: bool = True) -> Outcome:
    """Draw `family`'s config for `seed`, onboard it from its saved folder and say what disagrees; never raises."""
    start = time.perf_counter()
    d = draw(family, seed)
    if d.config is None:
        return Outcome(family, seed, "refused", d.refused, len(d.refused), round(time.perf_counter() - start, 1))
    workdir = Path(workdir or tempfile.mkdtemp(prefix="onboard-variety-"))
    try:
        problems = onboard_draw(d, workdir / d.name, adapt=adapt)
    except Exception as exc:  # report, do not stop a sweep
        problems = [f"raised {type(exc).__name__}: {one_line(exc)[:300]}"]
    status = "failed" if problems else "passed"
    return Outcome(family, seed, status, problems, len(d.refused), round(time.perf_counter() - start, 1))


def onboard_draw(d: Draw, folder: Path, *, adapt: bool = True) -> list[str]:
    """Save, resolve, inspect (and adapt) one draw; what the spec or verification got wrong."""
    from onboard.source import resolve
    from onboard.twin import instantiate

    d.config.save_pretrained(folder / "model")
    source = resolve(str(folder / "model"))
    if adapt:
        from onboard.bundle.make import adapt as adapt_source

        spec, verification = adapt_source(source, folder / "bundle", force=True)
    else:
        from onboard.inspect.inspection import inspect_source

        spec, verification = inspect_source(source)[0], None
    problems = disagreements(spec, expected(source.config, instantiate(source, device="meta")))
    if verification is not None and not verification.passed:
        problems.append(f"verification failed: {verification.note or 'numbers differ'}")
    return problems
