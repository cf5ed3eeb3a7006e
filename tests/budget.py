"""The registry of the suite's expensive setup (issue 53): every fixture that outlives one test and every site
that starts gloo worlds, with what it builds and who shares it. `tests/test_budget.py` fails when the code and this
list disagree; `tests/conftest.py` counts gloo worlds as they start (`note_launch`) and refuses one its site has
not declared. Counts, never timings: the gate must not depend on the machine's load.

To add one: build it once where several files can share it (a session fixture in a conftest), and add its line
here saying what it builds and which files use it.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Shared:
    builds: str  # what it makes, once per scope
    shared_by: tuple[str, ...]  # the test files that ask for it
    one_worker: bool = False  # a session fixture made once for all its files: they run on one xdist worker
    # a session fixture that makes one thing per parameter (a family's bundle): the tests of one parameter id run on
    # one worker, in every file that asks for it and is in no group of its own
    by_parameter: bool = False


@dataclass(frozen=True)
class Launch:
    worlds: int  # gloo worlds (a torchrun, or ranks started by hand) the site starts in a run of the gate
    what: str
    discovery: int = 0  # the further worlds it starts with --discovery (the discovery lane's cases)


class UndeclaredLaunch(AssertionError):
    pass


SHARED_FIXTURES: dict[str, Shared] = {
    # session fixtures: made once per worker, for every file below their conftest that asks
    "tests/conftest.py::inspected": Shared(
        "each catalogue model's inspection (spec and twin), on first request",
        ("tests/onboard/test_accounting.py", "tests/onboard/test_catalogue_models.py", "tests/onboard/test_plan.py",
         "tests/onboard/test_spec.py", "tests/predictors/test_pipeline_balance.py", "tests/test_random_input.py")),
    "tests/conftest.py::mixtral_bundle": Shared(
        "Mixtral's adapted bundle", ("tests/runtime/test_memory.py", "tests/runtime/test_train.py")),
    "tests/conftest.py::family_bundle": Shared(
        "each transformers family at its default config adapted and verified, on first request",
        ("tests/onboard/test_adapt.py", "tests/onboard/test_families.py"), by_parameter=True),
    "tests/conftest.py::zaya_agent_bundle": Shared(
        "ZAYA taken on by `onboard agent`'s rules policy (a sandboxed session)",
        ("tests/agent/test_cheats.py", "tests/onboard/test_review_check.py"), one_worker=True),
    "tests/conftest.py::twin_adapter": Shared(
        "a function: a twin adapted and its adapter loaded (nothing made until called)",
        ("tests/onboard/test_adapt_hybrid.py", "tests/onboard/test_adapt_ssm.py", "tests/onboard/test_decision.py",
         "tests/onboard/test_kernels.py", "tests/onboard/test_verify_reproducible.py",
         "tests/runtime/test_sparse_attention_hyv4.py")),
    "tests/agent/conftest.py::zaya": Shared("ZAYA's twin and spec", ("tests/agent/test_agent.py",
                                                                     "tests/agent/test_cheats.py")),
    "tests/agent/conftest.py::longcat": Shared("LongCat-Flash's twin and spec", ("tests/agent/test_llm.py",)),
    "tests/agent/conftest.py::phimoe": Shared("PhiMoE's twin and spec", ("tests/agent/test_agent.py",)),
    "tests/runtime/conftest.py::released_models": Shared(
        "each family's twin saved as a released checkpoint and adapted, on first request",
        ("tests/runtime/test_text_data.py", "tests/runtime/test_weights.py"), one_worker=True),
    # module fixtures: one instance per file that asks (so each such file runs on one worker)
    "tests/agent/test_agent.py::deepseek_v4_bundle": Shared(
        "DeepSeek-V4 taken on by the rules policy", ("tests/agent/test_agent.py",)),
    "tests/agent/test_cheats.py::secret_in_environment": Shared(
        "a password in onboard's environment (autouse)", ("tests/agent/test_cheats.py",)),
    "tests/agent/test_jail.py::inside": Shared("what one probe saw from inside a jail, seccomp loaded",
                                               ("tests/agent/test_jail.py",)),
    "tests/agent/test_jail.py::forked": Shared("what one fork of a zygote saw of the zygote and of a sibling fork",
                                               ("tests/agent/test_jail.py",)),
    "tests/agent/test_graph.py::reference": Shared("the plain module's torch.export capture in each mode, what "
                                                   "every planted graph is read against", ("tests/agent/test_graph.py",)),
    "tests/agent/test_cheats.py::sandbox": Shared("one ZAYA sandbox every cheat is judged in",
                                                  ("tests/agent/test_cheats.py",)),
    "tests/onboard/test_adapt.py::deepseek": Shared("DeepSeek-V3's twin, spec and decision",
                                                    ("tests/onboard/test_adapt.py",)),
    "tests/onboard/test_adapt_hybrid.py::hybrid": Shared("three hybrid twins adapted (a parameter each)",
                                                         ("tests/onboard/test_adapt_hybrid.py",)),
    "tests/onboard/test_adapt_ssm.py::family": Shared("each state-space family's twin adapted (a parameter each)",
                                                      ("tests/onboard/test_adapt_ssm.py",)),
    "tests/onboard/test_decision.py::qwen3_next": Shared("Qwen3-Next's twin adapted", ("tests/onboard/test_decision.py",)),
    "tests/onboard/test_dialects.py::quorum": Shared("the quorum fixture model adapted", ("tests/onboard/test_dialects.py",)),
    "tests/onboard/test_dialects.py::braid": Shared("the braid fixture model adapted", ("tests/onboard/test_dialects.py",)),
    "tests/onboard/test_flagship_model.py::flagship_config": Shared(
        "the flagship's config (its own code)", ("tests/onboard/test_flagship_model.py",)),
    "tests/onboard/test_flat_experts.py::square": Shared("a DBRX config", ("tests/onboard/test_flat_experts.py",)),
    "tests/onboard/test_flat_experts.py::two_norm": Shared("a DBRX config", ("tests/onboard/test_flat_experts.py",)),
    "tests/onboard/test_hostile.py::bundle": Shared("one adapted bundle the cases copy", ("tests/onboard/test_hostile.py",)),
    "tests/onboard/test_plan.py::flagship": Shared("the flagship's spec (from inspected)", ("tests/onboard/test_plan.py",)),
    "tests/onboard/test_plan.py::deepseek": Shared("DeepSeek-V3's spec (from inspected)", ("tests/onboard/test_plan.py",)),
    "tests/onboard/test_review_check.py::made": Shared("an OLMoE bundle", ("tests/onboard/test_review_check.py",)),
    "tests/onboard/test_unseen_family.py::spec": Shared("the novel fixture model's spec",
                                                        ("tests/onboard/test_unseen_family.py",)),
    "tests/onboard/test_verify_truth.py::qwen3_next_bundle": Shared("Qwen3-Next's bundle",
                                                                    ("tests/onboard/test_verify_truth.py",)),
    "tests/predictors/test_imbalance.py::mixtral": Shared("Mixtral's spec", ("tests/predictors/test_imbalance.py",)),
    "tests/predictors/test_retrain.py::world": Shared("a shipped set with one model's CPU runs held back",
                                                      ("tests/predictors/test_retrain.py",)),
    "tests/predictors/test_trees.py::shipped": Shared("the default predictor, its estimator and features",
                                                      ("tests/predictors/test_trees.py",)),
    "tests/runtime/test_context_model.py::results": Shared(
        "every case of a world size in one gloo launch (GLOO_LAUNCHES)", ("tests/runtime/test_context_model.py",)),
    "tests/runtime/test_context_parallel.py::outputs": Shared(
        "every attention kind's case in one gloo launch (GLOO_LAUNCHES)", ("tests/runtime/test_context_parallel.py",)),
    "tests/runtime/test_linear_attention.py::swapped": Shared(
        "a tiny linear-attention model through transformers and swapped (a parameter each)",
        ("tests/runtime/test_linear_attention.py",)),
    "tests/runtime/test_memory.py::bundle": Shared("mixtral_bundle", ("tests/runtime/test_memory.py",)),
    "tests/runtime/test_memory.py::pristine": Shared("Mixtral's model and its loss", ("tests/runtime/test_memory.py",)),
    "tests/runtime/test_parallel.py::models": Shared(
        "catalogue twins written as worker bundles, on first request",
        ("tests/runtime/test_context_model.py", "tests/runtime/test_parallel.py",
         "tests/runtime/test_tensor_parallel_models.py")),
    "tests/runtime/test_parallel.py::results": Shared(
        "every case of a world size in one gloo launch (GLOO_LAUNCHES)", ("tests/runtime/test_parallel.py",)),
    "tests/runtime/test_parallel.py::qwen3": Shared("Qwen3-30B-A3B's worker bundle", ("tests/runtime/test_parallel.py",)),
    "tests/runtime/test_sparse_attention_hyv4.py::bundle": Shared(
        "hy_v4's twin adapted", ("tests/runtime/test_sparse_attention_hyv4.py",)),
    "tests/runtime/test_tensor_parallel_models.py::results": Shared(
        "every case of a world size in one gloo launch (GLOO_LAUNCHES)", ("tests/runtime/test_tensor_parallel_models.py",)),
    "tests/runtime/test_text_data.py::corpus": Shared("a corpus in every format", ("tests/runtime/test_text_data.py",)),
    "tests/runtime/test_text_data.py::models_with_tokenizers": Shared(
        "released models with a tokenizer beside them", ("tests/runtime/test_text_data.py",)),
    "tests/runtime/test_train.py::bundle": Shared("mixtral_bundle", ("tests/runtime/test_train.py",)),
    "tests/runtime/test_train.py::factory": Shared("Mixtral's two-layer model builder", ("tests/runtime/test_train.py",)),
    "tests/runtime/test_weights.py::released": Shared("released_models", ("tests/runtime/test_weights.py",)),
    "tests/runtime/test_weights.py::qwen3_moe": Shared("Qwen3-MoE as a released checkpoint",
                                                       ("tests/runtime/test_weights.py",)),
    "tests/test_random_input.py::spec_dict": Shared("Qwen3-30B-A3B's spec as a dict", ("tests/test_random_input.py",)),
}

# "tests/<file>::<test or fixture>" -> the gloo worlds it starts in a whole run of the suite
GLOO_LAUNCHES: dict[str, Launch] = {
    "tests/runtime/test_parallel.py::test_matches_single_process": Launch(2, "every layout's cases, one launch a world size"),
    "tests/runtime/test_parallel.py::test_a_rank_killed_by_a_signal_is_launched_again_once": Launch(
        2, "a rank that crashes once, and one that always does (each relaunched once)"),
    "tests/runtime/test_context_model.py::test_context_parallel_model_matches_one_process": Launch(
        2, "every context-parallel case, one launch a world size"),
    "tests/runtime/test_context_model.py::test_the_flagship_trains_through_onboard_train_under_cp_as_in_one_process":
        Launch(2, "onboard train under two cp layouts"),
    "tests/runtime/test_context_parallel.py::test_attention_under_context_parallelism_matches_one_process": Launch(
        1, "every attention kind's case in one two-rank world"),
    "tests/runtime/test_tensor_parallel_models.py::test_tensor_parallel_models_match_one_process": Launch(
        2, "every tensor-parallel case, one launch a world size"),
    "tests/runtime/test_rebalance.py::test_rebalancing_changes_nothing_but_speed": Launch(2, "two ep layouts"),
    "tests/runtime/test_runtime_swaps.py::test_the_pipeline_schedule_entry_is_a_swap_that_counts_micro_batches":
        Launch(1, "two pipeline stages"),
    "tests/runtime/test_text_data.py::test_the_whole_job_on_four_processes_reloads_in_transformers_and_peft": Launch(
        1, "onboard train on four processes", discovery=1),
    "tests/runtime/test_train.py::test_cli_launches_torchrun_for_two_processes_with_expert_parallelism": Launch(
        1, "onboard train at ep 2"),
    "tests/runtime/test_train.py::test_memory_policies_compose_with_pipeline_and_tensor_parallelism": Launch(
        1, "pp x tp with recompute and offload"),
    "tests/runtime/test_train.py::test_sigkill_one_rank_then_resume_gives_the_same_losses": Launch(
        9, "three layouts: the whole run, the killed one, the resumed one"),
    "tests/runtime/test_train_ep.py::test_expert_parallel_resume_continues_exactly": Launch(2, "two ep layouts"),
    "tests/runtime/test_weights.py::test_a_fine_tune_on_released_weights_survives_sigkill_and_exports_what_it_trained":
        Launch(3, "the full fine-tune at fsdp2 x ep: straight, resumed, exported", discovery=3),
    "tests/runtime/test_weights.py::"
    "test_four_processes_with_fsdp_expert_parallelism_and_lora_start_from_the_released_loss_and_export_agreeing":
        Launch(1, "four processes on released weights"),
}

DISCOVERY = False  # set by tests/conftest.py: this run includes the discovery lane (pytest --discovery)
_started: dict[str, int] = {}  # site -> gloo worlds started in this session
_relaunches: dict[str, int] = {}  # site -> worlds started again after a rank died of a signal


def _is_world(args, env) -> bool:
    """A new gloo world: torchrun, or rank 0 of ranks started by hand (each rank a process of its own)."""
    argv = [str(a) for a in (args if isinstance(args, (list, tuple)) else [args])]
    if "torch.distributed.run" in argv or any(Path(a).name == "torchrun" for a in argv[:1]):
        return True
    return bool(env) and "WORLD_SIZE" in env and str(env.get("RANK")) == "0"


def site() -> str:
    """"tests/path.py::function": the outermost test or fixture function on the stack (what pytest called)."""
    frame, found = sys._getframe(1), None
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(TESTS) and path.name != "budget.py":
            found = f"tests/{path.relative_to(TESTS).as_posix()}::{frame.f_code.co_name}"
        frame = frame.f_back
    return found or "outside the tests"


def relaunch() -> None:
    """A launch helper starting a world again after a rank died of a signal: one more world allowed."""
    where = site()
    _relaunches[where] = _relaunches.get(where, 0) + 1


def note_launch(args, env) -> None:
    """Count a process start; raise if it starts a gloo world its site has not declared, or more than declared."""
    if not _is_world(args, env):
        return
    where = site()
    declared = GLOO_LAUNCHES.get(where)
    if declared is None:
        raise UndeclaredLaunch(f"{where} starts a gloo world that tests/budget.py does not declare: add it to "
                               "GLOO_LAUNCHES (how many worlds, what they run), or share one already started")
    _started[where] = _started.get(where, 0) + 1
    allowed = declared.worlds + (declared.discovery if DISCOVERY else 0) + _relaunches.get(where, 0)
    if _started[where] > allowed:
        raise UndeclaredLaunch(f"{where} starts {_started[where]} gloo worlds, {declared.worlds} declared in "
                               "tests/budget.py")


def install() -> None:
    """Count every process the tests' own process starts (`subprocess.Popen`, which `subprocess.run` and onboard's
    launcher use); processes started by a child are its own business."""
    if getattr(subprocess.Popen.__init__, "counted", False):
        return
    original = subprocess.Popen.__init__

    def counted(self, args, *rest, **kwargs):
        note_launch(args, kwargs.get("env"))
        original(self, args, *rest, **kwargs)

    counted.counted = True
    subprocess.Popen.__init__ = counted


def _scope(decorator: ast.expr) -> str | None:
    """The scope a `@pytest.fixture(...)` decorator declares (None for a decorator that is not one)."""
    call = decorator if isinstance(decorator, ast.Call) else None
    func = call.func if call else decorator
    if not ast.unparse(func).endswith("fixture"):
        return None
    for keyword in call.keywords if call else ():
        if keyword.arg == "scope":
            return keyword.value.value if isinstance(keyword.value, ast.Constant) else "dynamic"
    return "function"


@functools.lru_cache(maxsize=None)
def _parsed(path: Path, text: str) -> ast.AST:
    return ast.parse(text, str(path))


def _tree(path: Path) -> ast.AST:
    return _parsed(path, path.read_text())


def shared_fixtures(root: Path = TESTS) -> dict[str, str]:
    """"tests/path.py::name" -> scope, for every fixture under `root` that outlives one test."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for decorator in node.decorator_list:
                    scope = _scope(decorator)
                    if scope not in (None, "function"):
                        out[f"{path.relative_to(root.parent).as_posix()}::{node.name}"] = scope
    return out


def _imports(tree: ast.AST, module: str, name: str) -> bool:
    """`tree` imports `name` from `module` ("tests.runtime.test_parallel", or "test_parallel" from beside it)."""
    return any(isinstance(n, ast.ImportFrom) and n.module in (module, module.rsplit(".", 1)[-1])
               and name in [a.name for a in n.names] for n in ast.walk(tree))


def _defines(tree: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.FunctionDef) and n.name == name and any(_scope(d) for d in n.decorator_list)
               for n in ast.walk(tree))


def _autouse(tree: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.FunctionDef) and n.name == name and any(
        isinstance(d, ast.Call) and any(k.arg == "autouse" and getattr(k.value, "value", False) for k in d.keywords)
        for d in n.decorator_list) for n in ast.walk(tree))


def users(fixture: str, root: Path = TESTS) -> set[str]:
    """The test files that ask for `fixture` ("path::name"): by a parameter of a test or fixture, `usefixtures`,
    or autouse, in a file that sees it (its own file, a file that imports it, a file below its conftest's folder
    that does not define its own)."""
    where, name = fixture.split("::")
    home = (root.parent / where).parent
    module = where[:-3].replace("/", ".")
    out = set()
    for path in sorted(root.rglob("*.py")):
        tree = _tree(path)
        rel = path.relative_to(root.parent).as_posix()
        if rel == where:
            if _autouse(tree, name):
                out.add(rel)
        elif not (_imports(tree, module, name) or (where.endswith("conftest.py") and path.is_relative_to(home)
                                                   and not _defines(tree, name))):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name != name:
                if name in [a.arg for a in node.args.args + node.args.kwonlyargs]:
                    out.add(rel)
            elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("usefixtures") and any(
                    isinstance(a, ast.Constant) and a.value == name for a in node.args):
                out.add(rel)
    return out


def worker_groups(root: Path = TESTS) -> dict[str, str]:
    """test file -> the group whose tests run on one xdist worker: a file that asks for a fixture of module scope
    is a group (its instance is the file's); files that share a session fixture declared `one_worker` join one.
    Files in no group have their tests sent one by one to whichever worker is free."""
    parent: dict[str, str] = {}

    def find(name: str) -> str:
        while parent.setdefault(name, name) != name:
            name = parent[name]
        return name

    for fixture, scope in shared_fixtures(root).items():
        entry = SHARED_FIXTURES.get(fixture)
        files = entry.shared_by if entry else ()
        if scope == "session" and not (entry and entry.one_worker):
            continue
        for file in files:
            find(file)
        if scope == "session":
            for file in files[1:]:
                parent[find(file)] = find(files[0])
    return {file: find(file) for file in parent}


def scope_of(nodeid: str, groups: dict[str, str]) -> str:
    """The unit xdist sends to one worker: the test's file group (`worker_groups`), else its parameter id in a file
    that asks for a fixture declared `by_parameter`, else the test alone."""
    file = nodeid.split("::", 1)[0]
    if file in groups:
        return groups[file]
    if "[" in nodeid and file in _by_parameter_files():
        return f"{file}[{nodeid[nodeid.index('[') + 1:nodeid.rindex(']')]}]"
    return nodeid


@functools.lru_cache(maxsize=None)
def _by_parameter_files() -> frozenset[str]:
    return frozenset(f for entry in SHARED_FIXTURES.values() if entry.by_parameter for f in entry.shared_by)
