"""The suite keeps its budget by counting, never by timing (issue 53): every fixture that outlives a test (scope
module, package or session) and every gloo world a test starts is declared in one registry, `tests/budget.py`,
with what it builds and who shares it. A new one, one gone, or a declared user that no longer uses it fails here,
so adding an expensive piece of setup is a decision the diff shows.

Fixtures are read from the source (`shared_fixtures`); gloo worlds are counted as they start (`tests/conftest.py`
watches `subprocess.Popen` and `tests.budget.note_launch` raises on a world its site has not declared, or one more
than declared)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests import budget
from tests.budget import shared_fixtures, users

ROOT = Path(__file__).resolve().parent.parent


def test_every_shared_fixture_is_declared_with_its_users():
    found = shared_fixtures()
    declared = budget.SHARED_FIXTURES
    assert sorted(set(found) - set(declared)) == [], "declare these in tests/budget.py SHARED_FIXTURES (what " \
                                                     "they build, who shares them)"
    assert sorted(set(declared) - set(found)) == [], "tests/budget.py declares fixtures that no longer exist"
    wrong = {name: sorted(users(name)) for name, entry in declared.items()
             if set(entry.shared_by) != users(name)}
    assert wrong == {}, "tests/budget.py: who shares each of these is now (paste it as shared_by)"


def test_every_declared_launch_names_a_function_that_exists():
    """A declared gloo site is a test or fixture of the file it names (a renamed test leaves no stale entry)."""
    stale = []
    for site in budget.GLOO_LAUNCHES:
        where, name = site.split("::")
        tree = ast.parse((ROOT / where).read_text())
        if not any(isinstance(n, ast.FunctionDef) and n.name == name for n in ast.walk(tree)):
            stale.append(site)
    assert stale == []


PLANTED = '''
import pytest

@pytest.fixture(scope="session")
def world(tmp_path_factory):
    return 1

@pytest.fixture
def cheap():
    return 2

@pytest.fixture(scope="module", params=[1, 2])
def pair(request):
    return request.param

def test_uses(world, pair):
    pass
'''


def test_the_count_sees_a_new_shared_fixture_and_an_undeclared_world(tmp_path, monkeypatch):
    """Planted: a test file that adds a session fixture and a module fixture is seen (and its test as their
    user); a gloo world started from a site nobody declared, or one world more than declared, raises."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_new.py").write_text(PLANTED)
    assert shared_fixtures(tmp_path / "tests") == {"tests/test_new.py::world": "session",
                                                   "tests/test_new.py::pair": "module"}
    assert users("tests/test_new.py::world", tmp_path / "tests") == {"tests/test_new.py"}
    torchrun = ["python", "-m", "torch.distributed.run", "--nproc-per-node=2", "-m", "runtime.train"]
    with pytest.raises(budget.UndeclaredLaunch, match="test_the_count_sees"):
        budget.note_launch(torchrun, None)
    site = "tests/test_budget.py::test_the_count_sees_a_new_shared_fixture_and_an_undeclared_world"
    monkeypatch.setitem(budget.GLOO_LAUNCHES, site, budget.Launch(1, "planted"))
    monkeypatch.setattr(budget, "_started", {})
    budget.note_launch(torchrun, None)
    budget.note_launch(["python", "worker.py"], {"RANK": "1", "WORLD_SIZE": "2"})  # rank 1 of the same world
    with pytest.raises(budget.UndeclaredLaunch, match="2 gloo worlds, 1 declared"):
        budget.note_launch(["python", "worker.py"], {"RANK": "0", "WORLD_SIZE": "2"})
    budget.note_launch(["python", "-c", "print(1)"], None)  # not a world: not counted
