"""One varied config through onboard, the way a user's checkpoint goes: saved with `save_pretrained`, resolved
from its folder, inspected (and adapted and verified), and the spec held against the model's own structure
(`onboard.structure`, which shares no reading with the matchers)."""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from onboard.errors import one_line
from tests.variety.draw import Draw, build_config, draw
from tests.variety.structure import disagreements, expected


@dataclass
class Outcome:
    family: str
    seed: int
    status: str  # "passed" | "failed" | "refused" (the family's own code refused every attempt of this seed)
    problems: list[str]
    refused_attempts: int  # attempts of this seed the family's own code refused
    seconds: float
    changes: dict = field(default_factory=dict)  # the config's changes over the family's default

    @property
    def name(self) -> str:
        return f"{self.family}-seed{self.seed}"


def check(family: str, seed: int, workdir: Path | None = None, *, adapt: bool = True) -> Outcome:
    """Draw `family`'s config for `seed`, onboard it from its saved folder and say what disagrees; never raises."""
    return _check(lambda: draw(family, seed), workdir, adapt=adapt)


def check_changes(family: str, changes: dict, workdir: Path | None = None, *, seed: int | None = None) -> Outcome:
    """`check` for a config given as its changes over the family's default (a regression case): "refused" where
    the family's own code no longer builds it."""
    def made() -> Draw:
        try:
            return Draw(family, -1 if seed is None else seed, build_config(family, changes), changes)
        except Exception as exc:
            return Draw(family, -1 if seed is None else seed, None, changes, [one_line(exc)[:300]])

    return _check(made, workdir)


def _check(make_draw, workdir: Path | None, *, adapt: bool = True) -> Outcome:
    start = time.perf_counter()
    d = make_draw()
    family, seed = d.family, d.seed
    if d.config is None:
        return Outcome(family, seed, "refused", d.refused, len(d.refused), round(time.perf_counter() - start, 1),
                       d.changes)
    workdir = Path(workdir or tempfile.mkdtemp(prefix="onboard-variety-"))
    try:
        problems = onboard_draw(d, workdir / d.name, adapt=adapt)
    except Exception as exc:  # report, do not stop a sweep
        problems = [f"raised {type(exc).__name__}: {one_line(exc)[:300]}"]
    status = "failed" if problems else "passed"
    return Outcome(family, seed, status, problems, len(d.refused), round(time.perf_counter() - start, 1), d.changes)


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
