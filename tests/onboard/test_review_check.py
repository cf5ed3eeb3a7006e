"""Generated code reviewed in pull requests (issue 17): `onboard review` says what changed between two bundles
and what needs human eyes; `onboard check` finds a committed bundle that is stale (edited by hand, made by an
older template) or no longer verifies, one line each, and `--fix` puts it right. The bundles are OLMoE twins
(transformers' default config, two experts per token where the default has eight) adapted in this process; the
golden review is of the committed deepseek-v3 and deepseek-v3.2 bundles."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from cli import main
from onboard.adapt import codegen
from onboard.bundle.make import adapt
from onboard.review.changes import review
from onboard.review.check import check_bundle, masked
from onboard.review.families import default_config
from onboard.source import resolve

pytestmark = pytest.mark.slow  # adapts and checks OLMoE twins: about a minute

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).with_name("golden") / "review-deepseek-v3-to-v3.2.md"


def _olmoe(folder: Path, rename: str | None = None) -> Path:
    config = default_config("olmoe")
    config.num_experts_per_tok = 2
    config.save_pretrained(folder)
    if rename:  # a field transformers renamed: the old name is kept as an unknown key, the new one defaults
        data = json.loads((folder / "config.json").read_text())
        data[rename] = data.pop("num_experts_per_tok")
        (folder / "config.json").write_text(json.dumps(data, indent=2))
    return folder


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("olmoe")
    adapt(resolve(str(_olmoe(root / "model"))), root / "bundle")
    return root / "bundle"


def _copy(bundle: Path, to: Path) -> Path:
    shutil.copytree(bundle, to)
    return to


# a template edit no giving back of a swap can undo: the adapted model's first layer scales what it returns
BREAKS_THE_FIRST_LAYER = """

_adapt = adapt


def adapt(model, **kwargs):
    swaps = _adapt(model, **kwargs)
    model.get_submodule(LAYERS)[0].register_forward_hook(
        lambda m, i, o: o.mul(1.01) if not isinstance(o, tuple) else (o[0].mul(1.01), *o[1:]))
    return swaps
"""


def _edited_template(name: str, extra: str):
    """template_text with `extra` appended to template `name` (a template edit, as a pull request makes it)."""
    original = codegen.template_text
    return lambda n: original(n) + (extra if n == name else "")


def test_a_bundle_records_what_produced_it(made):
    record = json.loads((made / "provenance.json").read_text())
    assert record["versions"]["transformers"] and record["versions"]["torch"]
    assert record["source"]["kind"] == "local" and len(record["source"]["config_sha256"]) == 64
    files = record["files"]
    assert {"templates/adapter.py.j2", "templates/kernels/moe_triton.py.j2", "runtime.moe.block",
            "runtime.swap"} <= set(files)
    assert all(len(h) == 64 for h in files.values())


def test_a_bundle_reviewed_against_itself_says_no_changes(made):
    text = review(made, made)
    assert "No changes" in text and "## Needs human eyes\n\n- nothing\n" in text
    assert review(made, made, "github") == review(made, made, "github")  # deterministic


def test_review_of_a_fresh_bundle_shows_it_in_full(made):
    text = review(None, made)
    assert "## Code" in text and "`adapter.py`" in text and "def adapt(" in text
    assert "| seed |" in text and "runtime MoEBlock" in text


def test_check_finds_an_older_template_and_review_names_it(made, tmp_path, monkeypatch):
    """Planted: the adapter template gains a line. The bundle made before it is stale, naming the template;
    with --fix it is made again, and the review of old against new lists the changed code under human eyes."""
    monkeypatch.setattr(codegen, "template_text", _edited_template("adapter.py.j2", "# a template edit\n"))
    older = _copy(made, tmp_path / "older")
    result = check_bundle(older, fix=True)
    assert not result.failed and result.fixed
    assert any(line.startswith("adapter.py differs") and "templates/adapter.py.j2" in line for line in result.stale)
    assert (older / "adapter.py").read_text().endswith("# a template edit\n")
    text = review(made, older)
    eyes = text.split("## Provenance")[0]
    assert "code made from changed templates or runtime files (templates/adapter.py.j2): adapter.py" in eyes
    assert "+# a template edit" in text


def test_check_never_runs_a_hand_edit_and_fails_when_what_onboard_makes_no_longer_verifies(
        made, tmp_path, capsys, monkeypatch):
    """A committed adapter edited by hand is stale, and its code is not run (a marker it would write stays
    absent): check compares it with what onboard makes now, whose verification it runs. When what onboard makes
    no longer verifies (planted: the template renormalises the router's weights), check says so (exit 3), and
    --fix puts the hand edit right."""
    edited = _copy(made, tmp_path / "edited")
    marker = tmp_path / "ran"
    with open(edited / "adapter.py", "a") as f:
        f.write(f"open({str(marker)!r}, 'w').write('the committed adapter ran')\n")
    assert main(["check", str(edited)]) == 5  # stale; what onboard makes verifies
    lines = capsys.readouterr().out.splitlines()
    assert f"{edited}: stale: adapter.py differs from what onboard makes now (nothing it was made from changed: " \
           f"edited by hand?)" in lines
    assert not marker.exists()

    original = codegen.template_text
    monkeypatch.setattr(codegen, "template_text", _edited_template("adapter.py.j2", BREAKS_THE_FIRST_LAYER))
    assert main(["check", str(_copy(made, tmp_path / "failing"))]) == 3
    assert any(": no longer verifies" in line for line in capsys.readouterr().out.splitlines())
    monkeypatch.setattr(codegen, "template_text", original)

    assert main(["check", "--fix", str(edited)]) == 0
    assert (edited / "adapter.py").read_text() == (made / "adapter.py").read_text()
    assert check_bundle(edited).ok and not marker.exists()


def test_review_lists_a_renamed_config_field_and_a_shrinking_margin(made, tmp_path):
    renamed = tmp_path / "renamed"
    adapt(resolve(str(_olmoe(tmp_path / "model", rename="experts_per_token"))), renamed)
    text = review(made, renamed)
    eyes = text.split("## Provenance")[0]
    assert "the model's config changed" in eyes
    assert "top-2" in text and "top-8" in text  # the spec section: the field fell back to its default

    tight = _copy(made, tmp_path / "tight")
    record = json.loads((tight / "verification.json").read_text())
    seed = record["seeds"][1]
    assert seed["truth"] == "fp64"
    tol = record["tolerances"]
    bound = tol["err_factor"] * seed["logits_err_hf"] + tol["err_floor"]
    seed["logits_err_adapted"] = bound / 3
    (tight / "verification.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    eyes = review(made, tight).split("## Provenance")[0]
    assert "verification margin: seed 1 logits is 3.0x inside its tolerance, was" in eyes
    assert "verification margin" not in review(made, made)


def test_numbers_are_masked_when_measured_files_are_compared():
    assert masked('"err": 3.2e-07, "seed": 2, "loss": 6.25') == '"err": <n>, "seed": 2, "loss": <n>'


def test_golden_review_of_deepseek_v3_against_v3_2():
    """The committed bundles: V3.2 adds DeepSeek sparse attention (DSA) to every layer; the review lists the
    layers, the runtime's new attention swap and each seed's verification, old beside new."""
    old, new = ROOT / "bundles" / "deepseek-v3", ROOT / "bundles" / "deepseek-v3.2"
    text = review(old, new, "github")
    if os.environ.get("ONBOARD_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "rerun with ONBOARD_UPDATE_GOLDEN=1 after a deliberate change"
    spec = text.split("## Spec")[1].split("## What runs where")[0]
    assert "sparse:dsa" in spec and "mla" in spec
    where = text.split("## What runs where")[1].split("## Code")[0]
    assert "runtime sparse (sparse:dsa) **changed**" in where
    seeds = json.loads((new / "verification.json").read_text())["seeds"]
    for s in seeds:
        assert f"| {s['seed']} (old) |" in text and f"| {s['seed']} (new) |" in text


@pytest.mark.parametrize("bundle", sorted(p.parent.name for p in (ROOT / "bundles").glob("*/spec.json")))
def test_every_committed_bundle_records_its_provenance_and_verified(bundle):
    """The committed bundles (`onboard check` in CI makes each again and compares): one per catalogue model."""
    folder = ROOT / "bundles" / bundle
    record = json.loads((folder / "provenance.json").read_text())
    assert record["source"]["kind"] == "catalogue" and record["source"]["ref"] == bundle
    assert json.loads((folder / "verification.json").read_text())["passed"]


def _moved(tmp_path, old: str, new: str, edit: str = "") -> Path:
    """A copy of runtime/ with module `old` moved to the file of `new` (importers rewritten, `edit` appended to
    the moved file): the refactor a maintainer makes."""
    root = tmp_path / "project"
    shutil.copytree(ROOT / "runtime", root / "runtime", ignore=shutil.ignore_patterns("__pycache__", "store"))
    source, target = (root.joinpath(*name.split(".")).with_suffix(".py") for name in (old, new))
    target.parent.mkdir(parents=True, exist_ok=True)
    source.rename(target)
    target.write_text(target.read_text() + edit)
    for path in (root / "runtime").rglob("*.py"):
        text = path.read_text()
        path.write_text(re.sub(rf"\b{re.escape(old)}\b", new, text))
    return root


def test_a_runtime_module_moved_without_change_leaves_every_bundle_up_to_date(tmp_path):
    """runtime.subnormals (which every bundle imports) moved to a new file, its importers rewritten, the move
    recorded: each committed bundle's record of runtime modules is the one it holds. The same move with the
    file changed, or not recorded, is a change."""
    from onboard.bundle import provenance

    bundles = sorted(p.parent for p in (ROOT / "bundles").glob("*/provenance.json"))
    moved = _moved(tmp_path / "a", "runtime.subnormals", "runtime.exp_floor")
    changed = _moved(tmp_path / "b", "runtime.subnormals", "runtime.exp_floor", "\nFLOOR = 1\n")
    move = {"runtime.subnormals": "runtime.exp_floor"}
    for bundle in bundles:
        committed = json.loads((bundle / "provenance.json").read_text())["files"]
        code = [bundle / "adapter.py", *sorted((bundle / "generated").glob("*.py"))]
        recorded = {k: v for k, v in committed.items() if k.startswith("runtime")}
        assert "runtime.subnormals" in recorded
        assert provenance.runtime_digests(code, move, moved) == recorded, bundle.name
        assert provenance.runtime_digests(code, move, changed) != recorded
        assert "runtime.exp_floor" in provenance.runtime_digests(code, {}, moved)
    assert provenance.moves() == {}  # nothing has moved yet: the shipped map is empty, and reads


def test_the_catalogue_has_a_committed_bundle_each():
    from onboard.source import catalogue_index

    assert {p.parent.name for p in (ROOT / "bundles").glob("*/spec.json")} == set(catalogue_index())


def test_check_makes_an_agents_bundle_again_by_replaying_its_record(zaya_agent_bundle, tmp_path):
    """ZAYA's residual scalings are generated by the agent's rules policy (the session's bundle, copied: it is
    edited here); check replays agent.jsonl (timing verdicts included) and finds the bundle up to date; a generated
    file edited by hand makes it stale."""
    shutil.copytree(zaya_agent_bundle, tmp_path / "bundle")
    generated = sorted((tmp_path / "bundle" / "generated").glob("*.py"))
    assert generated
    assert check_bundle(tmp_path / "bundle").ok
    with open(generated[0], "a") as f:
        f.write("# edited\n")
    stale = check_bundle(tmp_path / "bundle").stale
    assert stale == [f"generated/{generated[0].name} differs from what onboard makes now (nothing it was made from "
                     f"changed: edited by hand?)"]
