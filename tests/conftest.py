"""Test settings: offline, quiet, one torch thread a process (the suite runs on two pytest-xdist workers, one a core
of CI's two) that sleeps rather than spins while it waits for work, a kernel store and spec cache of the session's
own (rendered kernels never land in the checkout's runtime/kernels/store), and a fixed judge key.

Tests that share setup outliving one test (`tests/budget.py` declares it) run on one worker
(`pytest_xdist_make_scheduler`), and every gloo world a test starts is counted against the same registry
(`tests.budget.install`)."""

import os
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("ONBOARD_KERNEL_STORE", tempfile.mkdtemp(prefix="onboard-kernel-store-"))
# plans read inspections from a cache (onboard.inspect.cache): the session's own, never the user's
os.environ.setdefault("ONBOARD_CACHE_DIR", tempfile.mkdtemp(prefix="onboard-cache-"))
# the judge's key keys the inputs the agent's judge draws: a fixed one of the session's own, so the gate draws the same
# inputs on every machine (the user's ~/.cache/onboard/judge.key is neither read nor made)
_key = os.path.join(tempfile.mkdtemp(prefix="onboard-judge-"), "judge.key")
with open(_key, "wb") as _f:
    _f.write(bytes(range(32)))
os.environ.setdefault("ONBOARD_JUDGE_KEY", _key)
# the key that seals inspection-cache entries: the session's own (made on first use in an empty folder)
os.environ.setdefault("ONBOARD_CACHE_KEY", os.path.join(tempfile.mkdtemp(prefix="onboard-cache-key-"), "cache.key"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ["OMP_NUM_THREADS"] = "1"  # two workers share two cores; every process they start inherits it
# OpenMP's threads otherwise spin after each parallel region: on a busy machine (other tests, other processes)
# a thread spins while the one it waits for is off the CPU, and the same test costs up to twice the CPU time
# (measured: 2.9 s of CPU passive, 3.8-8.6 s spinning, for one inspection). Set before torch loads OpenMP, and
# inherited by every process the tests start.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests import budget  # noqa: E402

torch.set_num_threads(1)
budget.install()
warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.fixture(scope="session")
def inspected():
    """Inspect each catalogue model once per session (several test files read the same specs)."""
    from onboard.inspect.inspection import inspect_model

    cache: dict = {}

    def get(ref: str):
        if ref not in cache:
            cache[ref] = inspect_model(ref)
        return cache[ref]

    return get


@pytest.fixture(scope="session")
def mixtral_bundle(tmp_path_factory):
    """An adapted Mixtral bundle, written once per session (training and memory tests read it)."""
    from onboard.bundle.make import adapt
    from onboard.source import resolve

    out = tmp_path_factory.mktemp("bundle") / "mixtral"
    adapt(resolve("mixtral-8x7b"), out)
    return out


@pytest.fixture(scope="session")
def family_bundle(tmp_path_factory):
    """`family_bundle(family) -> (spec, verification, bundle)`: a transformers family at its default config adapted
    as `onboard adapt` does it (twin, capture, decision, verification, bundle written), once per session for
    every test that reads such a bundle (test_families, test_adapt). The bundle is read, never changed: a test
    that edits one copies it first."""
    from onboard.bundle.make import adapt
    from onboard.review.families import default_config
    from onboard.source import from_config

    cache: dict = {}

    def get(family: str):
        if family not in cache:
            out = tmp_path_factory.mktemp(f"family-{family}") / "bundle"
            spec, verification = adapt(from_config(default_config(family), family), out)
            cache[family] = (spec, verification, out)
        return cache[family]

    return get


@pytest.fixture(scope="session")
def zaya_agent_bundle(tmp_path_factory):
    """ZAYA (transformers' default config, saved as a checkpoint folder) adapted by `onboard agent`'s rules policy,
    timing verdicts included: its residual scalings are generated code. Made once per session for the tests that
    read it (test_cheats, test_review_check); a test that edits it copies it first."""
    from onboard.agent.loop import run
    from onboard.review.families import default_config
    from onboard.source import resolve

    folder = tmp_path_factory.mktemp("zaya-agent")
    default_config("zaya").save_pretrained(folder / "model")
    run(resolve(str(folder / "model")), folder / "bundle")
    return folder / "bundle"


@pytest.fixture(scope="session")
def twin_adapter():
    """`adapter(directory, ref=None, family=None) -> (spec, twin, decision, adapt)`: the tiny twin of a catalogue /
    HF `ref` or of a transformers `family` at its default config, adapted as `onboard adapt` does it: spec,
    decision and rendered adapter written to `directory`, and the adapter loaded back from there (no kernels, no
    verification)."""
    from onboard.adapt.codegen import render_adapter
    from onboard.adapt.decision import decide
    from onboard.bundle.files import load_adapter
    from onboard.inspect.capture import capture
    from onboard.inspect.inspection import build_spec
    from onboard.review.families import default_config
    from onboard.source import from_config, resolve
    from onboard.twin import Twin

    def adapter(directory, ref=None, family=None):
        source = resolve(ref) if ref else from_config(default_config(family), family)
        twin = Twin.build(source)
        spec = build_spec(twin, capture(twin))
        decision = decide(spec, twin)
        (directory / "spec.json").write_text(spec.to_json())
        (directory / "decision.json").write_text(decision.to_json())
        (directory / "adapter.py").write_text(render_adapter(spec, decision.taken()))
        return spec, twin, decision, load_adapter(directory).adapt

    return adapter


@pytest.fixture
def forked_torchrun(monkeypatch):
    """`onboard train`'s multi-process runs, for this test, as forks of this process's zygote (tests/parallel/zygote.py)
    instead of through torchrun: the same ranks, environment contract and job file, without each rank importing the
    torch stack again. For tests about the run; tests/runtime/test_train.py keeps the real torchrun path."""
    import sys

    from onboard.train import launch
    from tests.parallel.zygote import Zygote, rank_env

    def forked(job_file, world, env):
        env = {**env, **{k: v for k, v in rank_env().items() if k.startswith(("MASTER_", "GLOO_"))}}
        argv = ["-m", "runtime.train", "--job", str(job_file)]
        started = Zygote.shared().start(world, argv, env=env, logs=Path(job_file).parent / "ranks", cwd=Path.cwd())
        codes = started.wait(timeout=600)
        for rank, code in sorted(codes.items()):
            if code:
                print(f"rank {rank} ended with {code}:\n{started.log(rank)}", file=sys.stderr)
        return 1 if any(codes.values()) else 0

    monkeypatch.setattr(launch, "torchrun", forked)
    return forked


WIDE = ("family", "multiprocess", "interpreter")  # marks whose tests leave the fast lane


def pytest_configure(config):
    budget.DISCOVERY = bool(config.getoption("--discovery", False))


def pytest_addoption(parser):
    parser.addoption("--discovery", action="store_true",
                     help="also run the discovery lane's tests (marked discovery: exhaustive sweeps beyond the gate's "
                          "fixed case of each kind, checks whose outcome rides on the machine's load)")


def pytest_collection_modifyitems(config, items):
    """Family-wide, multi-process and kernel-interpreter tests are slow: `pytest -m "not slow"` is the fast lane,
    `pytest` (the gate, what CI runs) runs everything but the discovery lane, which `--discovery` adds."""
    if not config.getoption("--discovery"):
        apart = [item for item in items if item.get_closest_marker("discovery")]
        if apart:
            config.hook.pytest_deselected(items=apart)
            items[:] = [item for item in items if not item.get_closest_marker("discovery")]
    for item in items:
        if any(item.get_closest_marker(mark) for mark in WIDE) and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's load scheduling, with each unit of `tests.budget.scope_of` sent to one worker whole (a file that asks
    for a module fixture, files sharing a session fixture declared one_worker, the tests of one family where they
    share its bundle): what they share is made once. xdist's `--dist` modes other than the default are left as they
    are."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    groups = budget.worker_groups()

    class SharedSetupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return budget.scope_of(nodeid, groups)

    return SharedSetupScheduling(config, log)
