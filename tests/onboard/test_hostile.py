"""Hostile and unfamiliar input, one case each, through the command line a user types: no code runs without
consent given on that command line, nothing the user had is lost or overwritten, and every mistake is one
line on stderr with a non-zero exit, in bounded time. The remote-code cases use a model folder whose code,
if it ever runs, leaves a marker file.

Most cases run the command in this process (`tests.helpers.run_cli`: `cli.main` with the arguments, its exit code
and output captured, HANG seconds at most); a case runs `onboard` in a process of its own (`cli_process`) where it
needs one: model code that must not run (consent, checked apart from the test's process), a FIFO or a link loop
that could block or loop in a system call, and the concurrent and killed runs."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from onboard.bundle.files import MARKER
from onboard.bundle.target import is_bundle
from runtime.plan import UNFOLDED_VERSION
from tests.helpers import HANG, ROOT, TESTS, run_cli

# a sweep of `onboard` commands, one per case: in CI's full run, not the fast lane
pytestmark = pytest.mark.slow

EVIL = TESTS / "fixtures" / "evil_model"
CATALOGUE = ROOT / "onboard" / "catalogue"


def cli(*args, cwd=None) -> subprocess.CompletedProcess:
    """`onboard ARGS` in this process, HANG seconds at most."""
    return run_cli(*args, cwd=cwd, timeout=HANG)


def cli_process(*args, env=None, timeout=HANG, **popen) -> subprocess.CompletedProcess:
    """`onboard ARGS` in a process of its own, one thread, HANG seconds at most (the case needs the process: see
    the module's docstring)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, **popen)


def refused(result: subprocess.CompletedProcess, *words: str) -> bool:
    """A one-line error on stderr, no traceback, a non-zero exit, saying each of `words`."""
    lines = result.stderr.strip().splitlines()
    return (result.returncode not in (0, 70) and len(lines) == 1 and "Traceback" not in result.stderr
            and all(w in lines[0] for w in words))


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """One adapted bundle (a dense catalogue model: its loss runs in the runtime) the cases copy."""
    from onboard.bundle.make import adapt
    from onboard.source import resolve

    out = tmp_path_factory.mktemp("hostile") / "bundle"
    adapt(resolve("qwen3-8b"), out)
    return out


@pytest.fixture
def copy_of(bundle, tmp_path):
    def make(name="b") -> Path:
        return Path(shutil.copytree(bundle, tmp_path / name))
    return make


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "REMOTE-CODE-RAN"
    return path, {"ONBOARD_TEST_MARKER": str(path)}


def model_folder(tmp_path, slug="qwen3-8b", name="model") -> Path:
    return Path(shutil.copytree(CATALOGUE / slug, tmp_path / name))


# --- consent ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("verb", ["verify", "train"])
def test_a_bundle_never_switches_remote_code_on(verb, copy_of, tmp_path, marker):
    """source.json may name any folder and say trust_remote_code: the model's code still needs the flag."""
    evil = shutil.copytree(EVIL, tmp_path / "evil")
    b = copy_of()
    (b / "source.json").write_text(json.dumps({"ref": str(evil), "kind": "local", "trust_remote_code": True}))
    path, env = marker
    result = cli_process(verb, b, *(["--steps", "1"] if verb == "train" else []), env=env)
    assert refused(result, "--trust-remote-code") and not path.exists()


def test_auto_map_reaching_outside_the_model_folder_is_refused(tmp_path, marker):
    model = shutil.copytree(EVIL, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    config["auto_map"]["AutoConfig"] = f"{tmp_path}/elsewhere--configuration_evil.EvilConfig"
    (model / "config.json").write_text(json.dumps(config))
    path, env = marker
    assert refused(cli_process("inspect", model, "--trust-remote-code", env=env), "outside the model's own folder")
    assert not path.exists()


def test_remote_code_is_refused_without_the_flag(tmp_path, marker):
    path, env = marker
    assert refused(cli_process("inspect", shutil.copytree(EVIL, tmp_path / "m"), env=env), "--trust-remote-code")
    assert not path.exists()


def test_commands_that_run_a_bundles_code_say_so(copy_of):
    for verb in ("verify", "train"):
        assert "adapter.py" in cli(verb, "--help").stdout
    b = copy_of()
    (b / "adapter.py").write_text("this is not python\n")
    result = cli("verify", b)
    assert f"running {b / 'adapter.py'}" in result.stdout and refused(result, "adapter.py does not import")
    (b / "adapter.py").write_text("SPEC = {}\n")
    assert refused(cli("verify", b), "has no adapt(model)")
    assert "pickles" in cli("plan", "--help").stdout


# --- nothing lost -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["the model folder", "its parent"])
def test_force_never_replaces_the_model_being_adapted(target, tmp_path):
    model = model_folder(tmp_path)
    before = (model / "config.json").read_bytes()
    out = model if target == "the model folder" else tmp_path
    assert refused(cli("adapt", model, "--out", out, "--force"), "holds the model being adapted")
    assert (model / "config.json").read_bytes() == before


def test_force_replaces_only_a_bundle(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert refused(cli("adapt", "qwen3-8b", "--out", out, "--force"), "not a bundle")
    assert (out / "notes.txt").read_text() == "keep me"


def _plant_users_files(bundle: Path) -> dict[str, bytes]:
    """What `onboard train` and a user put in a bundle: checkpoints/, runs/, data/, a note. Their bytes by path."""
    planted = {"checkpoints/step-2/model.safetensors": b"weights", "runs/run-1.jsonl": b'{"step": 1}\n',
               "data/corpus.jsonl": b'{"text": "hello"}\n', "NOTES.md": b"my notes\n"}
    for name, data in planted.items():
        (bundle / name).parent.mkdir(parents=True, exist_ok=True)
        (bundle / name).write_bytes(data)
    return planted


def test_force_keeps_what_is_not_onboards_and_says_so(copy_of):
    b = copy_of()
    planted = _plant_users_files(b)
    result = cli("adapt", "qwen3-8b", "--out", b, "--force")
    assert result.returncode == 0, result.stderr
    assert "kept NOTES.md, checkpoints/, data/, runs/ from the bundle it replaced" in result.stdout
    assert all((b / name).read_bytes() == data for name, data in planted.items())
    assert not list(b.parent.glob(f".{b.name}.*"))


def test_check_fix_keeps_what_is_not_onboards_and_a_trained_bundle_is_not_stale(copy_of):
    from onboard.review.check import check_bundle

    b = copy_of()
    planted = _plant_users_files(b)
    assert check_bundle(b).ok  # checkpoints and runs are not "no longer made"
    with open(b / "adapter.py", "a") as f:
        f.write("# edited\n")
    result = check_bundle(b, fix=True)
    assert result.fixed and sorted(result.kept) == ["NOTES.md", "checkpoints/", "data/", "runs/"]
    assert all((b / name).read_bytes() == data for name, data in planted.items())
    assert "# edited" not in (b / "adapter.py").read_text()


def test_a_replacement_killed_halfway_keeps_the_users_files(copy_of, tmp_path):
    """Killed after the new bundle moved into place, before the user's files followed it: the next run moves
    them over (the old bundle is kept aside until then)."""
    from onboard.bundle.target import tidy

    b = copy_of()
    planted = _plant_users_files(b)
    aside = b.with_name(f".{b.name}.old-deadbeef")
    b.rename(aside)
    shutil.copytree(aside, b, ignore=lambda d, names: [n for n in names if d == str(aside) and not n.endswith(
        (".json", ".py", ".md", ".sh", ".slurm", ".onboard-bundle")) or n == "NOTES.md"])
    done = tidy(b)
    assert any("moved" in line and "checkpoints/" in line for line in done), done
    assert all((b / name).read_bytes() == data for name, data in planted.items())
    assert not aside.exists()


@pytest.mark.parametrize("plant", ["a link out", "a link loop", "a FIFO"])
@pytest.mark.parametrize("verb", ["review", "check"])
def test_review_and_check_read_a_bundles_own_regular_files_only(verb, plant, copy_of, tmp_path):
    """A link out of the bundle would put its target into a pull-request comment; a FIFO would block; a loop
    would never end: each is one line naming the entry, and nothing of the target is printed."""
    secret = tmp_path / "secret.txt"
    secret.write_text("sk-do-not-print")
    b = copy_of()
    if plant == "a link out":
        (b / "REVIEW.md").unlink()
        (b / "REVIEW.md").symlink_to(secret)
        culprit = b / "REVIEW.md"
    elif plant == "a link loop":
        (b / "generated").mkdir()
        (b / "generated" / "loop").symlink_to(b / "generated")
        culprit = b / "generated" / "loop"
    else:
        (b / "decision.json").unlink()
        os.mkfifo(b / "decision.json")
        culprit = b / "decision.json"
    # a FIFO or a loop could block or loop in a system call: in a process of its own
    result = cli(verb, b) if plant == "a link out" else cli_process(verb, b)
    assert refused(result, str(culprit)) and "sk-do-not-print" not in result.stdout + result.stderr, result.stderr


def test_a_directory_created_at_out_while_adapt_runs_is_kept(tmp_path, monkeypatch):
    """The target is checked again, under a lock, right before the new bundle moves into place."""
    import onboard.bundle.make
    from onboard.errors import OnboardError
    from onboard.source import resolve

    out = tmp_path / "b"
    real = onboard.bundle.make.write_launcher

    def meanwhile(directory, plan=None):
        real(directory, plan)
        out.mkdir()
        (out / "made-meanwhile.txt").write_text("keep me")

    monkeypatch.setattr(onboard.bundle.make, "write_launcher", meanwhile)
    with pytest.raises(OnboardError, match="already holds files"):
        onboard.bundle.make.adapt(resolve("qwen3-8b"), out)
    assert (out / "made-meanwhile.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]  # no staging folder left behind


@pytest.mark.slow
def test_two_concurrent_adapts_to_one_out_keep_one_bundle(tmp_path):
    out = tmp_path / "b"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "adapt", "qwen3-8b", "--out", str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    results = [p.communicate(timeout=600) + (p.returncode,) for p in procs]
    assert sorted(rc for _, _, rc in results) == [0, 1]
    _, err, _ = next(r for r in results if r[2] == 1)
    assert "already holds files" in err and len(err.strip().splitlines()) == 1
    assert is_bundle(out) and (out / MARKER).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


@pytest.mark.slow
def test_a_killed_adapt_leaves_nothing_the_next_run_does_not_tidy(tmp_path):
    out = tmp_path / "b"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "adapt", "qwen3-8b", "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 300
    while not list(tmp_path.glob(".b.onboard-*")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert list(tmp_path.glob(".b.onboard-*")) and not out.exists()  # killed while staging
    result = cli("adapt", "qwen3-8b", "--out", out)
    assert result.returncode == 0 and "tidied: removed .b.onboard-" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"] and is_bundle(out)


def test_a_staging_folder_without_its_record_is_a_killed_runs(tmp_path):
    """Killed between making its staging folder and writing who writes it (a busy machine hit this window in the
    test above): the folder is made and recorded under the lock `tidy` reads it under, so one without a record
    is a killed run's, and tidied (it was left for good)."""
    from onboard.bundle.target import tidy

    (tmp_path / ".b.onboard-1a2b").mkdir()
    assert tidy(tmp_path / "b") == ["removed .b.onboard-1a2b, left by a killed run"]
    assert not list(tmp_path.iterdir())


def test_a_bundle_moved_aside_by_a_killed_run_is_moved_back(bundle, tmp_path):
    """Killed between moving the old bundle aside and moving the new one in: the next run puts the old one
    back (and then, without --force, keeps it)."""
    aside = shutil.copytree(bundle, tmp_path / ".b.old-1a2b3c4d")
    staging = tmp_path / ".b.onboard-xyz"
    staging.mkdir()
    host = os.uname().nodename  # gate: the staging check compares it with its own reading of this host's name
    (staging / ".onboard-staging").write_text(json.dumps({"pid": 2**22 + 12345, "host": host}))
    result = cli("adapt", "qwen3-8b", "--out", tmp_path / "b")
    assert refused(result, "already holds files") and not aside.exists() and not staging.exists()
    assert is_bundle(tmp_path / "b")


def test_a_staging_folder_of_a_running_adapt_is_left_alone(tmp_path):
    from onboard.bundle.target import staging_for, tidy

    out = tmp_path / "b"
    mine = staging_for(out)  # written by this (running) process
    assert tidy(out) == [] and mine.is_dir()


def test_plan_out_never_overwrites_without_force(tmp_path):
    existing = tmp_path / "config.json"
    existing.write_text('{"mine": true}')
    assert refused(cli("plan", "qwen3-8b", "--devices", 8, "--hardware", "H100", "--out", existing), "--force")
    assert refused(cli("plan", "qwen3-8b", "--devices", 8, "--hardware", "H100", "--out", tmp_path), "directory")
    assert refused(cli("plan", "qwen3-8b", "--devices", 8, "--hardware", "H100", "--out", existing / "p.json"),
                   "is a file")
    assert existing.read_text() == '{"mine": true}'
    assert cli("plan", "qwen3-8b", "--devices", 8, "--hardware", "H100", "--out", existing, "--force").returncode == 0
    # the fastest runnable plan is never MoE-folded, so it is written as a version-3 plan (runtime.plan)
    assert json.loads(existing.read_text())["schema_version"] == UNFOLDED_VERSION


@pytest.mark.parametrize("place", ["--runlog", "--checkpoint-dir"])
def test_training_checks_where_it_writes_before_the_first_step(place, copy_of, tmp_path):
    b = copy_of()
    wrong = tmp_path / ("a-directory" if place == "--runlog" else "a-file")
    wrong.mkdir() if place == "--runlog" else wrong.write_text("keep me")
    result = cli("train", b, "--steps", 1000, place, wrong)  # refused before a step: HANG is far above it
    assert refused(result, str(wrong))
    assert not (b / "checkpoints").exists() and (place == "--runlog" or wrong.read_text() == "keep me")


def test_a_checkpoint_whose_index_names_code_is_refused_before_any_rank(copy_of, tmp_path):
    """Issue 55: DCP's `.metadata` is a pickle. A checkpoint folder handed over whose index names a call (os.system
    here) ran it while train looked for a checkpoint to resume from, then trained from scratch with exit 0. Now
    refused in one line before anything is built, and nothing ran; `--trust-checkpoint` is the user's say-so."""
    import pickle

    b = copy_of()
    ck = tmp_path / "ck"
    ran = tmp_path / "ran"
    planted = type("Planted", (), {"__reduce__": lambda self: (os.system, (f"touch {ran}",))})
    (ck / "step-00000002").mkdir(parents=True)
    (ck / "step-00000002" / ".metadata").write_bytes(pickle.dumps(planted()))
    result = cli("train", b, "--steps", 1, "--checkpoint-dir", ck, "--runlog", tmp_path / "log.jsonl")
    assert refused(result, ".metadata", "posix.system", "--trust-checkpoint"), result.stderr
    assert not ran.exists() and not (tmp_path / "log.jsonl").exists()
    # with the user's say-so torch's own reader reads it, and runs what it names (what the test is there for)
    result = cli("train", b, "--steps", 1, "--checkpoint-dir", ck, "--runlog", tmp_path / "log.jsonl",
                 "--trust-checkpoint")
    assert result.returncode == 0 and ran.exists(), result.stderr[-2000:]


# --- one line, never a traceback ----------------------------------------------------------------------------

def _config(tmp_path, change: dict | str, slug="mixtral-8x7b") -> Path:
    model = model_folder(tmp_path, slug)
    if isinstance(change, str):
        (model / "config.json").write_text(change)
    else:
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, **change}))
    return model


@pytest.mark.parametrize("change, words", [
    ({"model_type": ["mixtral"]}, "model_type must be a string"),
    ({"vocab_size": 0}, "vocab_size is 0"),
    ("[" * 50_000 + "]" * 50_000, "nested too deeply"),
    ({"num_experts_per_tok": 16}, "16 experts per token, and the model has 8 experts"),
    ({"num_key_value_heads": 3}, "must divide num_attention_heads"),
    ({"hidden_size": -64}, "hidden_size is -64"),
    ({"num_hidden_layers": 100_000}, "at most 4096 layers"),
    ({"model_type": "bert"}, "is an encoder"),
], ids=["model_type list", "vocab 0", "deep nesting", "top-k over experts", "kv heads", "negative hidden",
        "100000 layers", "encoder"])
def test_bad_configs_are_one_line(change, words, tmp_path):
    assert refused(cli("inspect", _config(tmp_path, change)), words)


def test_a_huge_config_is_refused_by_its_size(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    with open(model / "config.json", "w") as f:
        f.write('{"model_type": "mixtral", "pad": "' + "x" * (17 * 2**20) + '"}')
    assert refused(cli("inspect", model), "MiB")


def test_a_broken_bundle_is_one_line(copy_of):
    b = copy_of()
    (b / "source.json").write_text('{"kind": "local"}')
    assert refused(cli("verify", b), "source.json")
    (b / "source.json").write_text("{not json")
    assert refused(cli("verify", b), "unreadable bundle")
    c = copy_of("c")
    (c / "verification.json").write_text("{not json")  # rewritten by verify, never read
    (c / "decision.json").write_text('{"schema_version": 99}')
    assert refused(cli("verify", c), "decision")


@pytest.mark.parametrize("out", [".", "link"])
def test_adapt_out_at_the_current_directory_or_a_symlink(out, tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert refused(cli("adapt", "qwen3-8b", "--out", out, "--force", cwd=tmp_path),
                   "current directory" if out == "." else "symlink")


@pytest.mark.parametrize("change, words", [
    ({"peak_tflops": {"bf16": "fast"}}, "peak_tflops.bf16 must be a positive number"),
    ({"memory_gb": 0}, "memory_gb must be a positive number"),
    ({"peak_tflops": None}, "peak_tflops must map"),
    ({"host_gbs": 0}, "host_gbs must be a positive number"),
    ({"memory_bw_gbs": -3350}, "memory_bw_gbs must be a positive number"),
    ({"devices_per_node": 8.5}, "devices_per_node must be a whole number"),
    ({"op_dispatch_us": -1}, "op_dispatch_us must be a number of at least 0"),
    ({"moe_op_dispatch_us": "slow"}, "moe_op_dispatch_us must be a number of at least 0"),
    ({"matmul_efficiency": 1.5}, "matmul_efficiency must be a number above 0 and at most 1"),
    ({"matmul_efficiency": 0}, "matmul_efficiency must be a number above 0 and at most 1"),
    ({"dispatch_overlaps": "yes"}, "dispatch_overlaps must be true or false"),
    ({"layer_overhead_ms": 300}, "layer_overhead_ms is gone: give op_dispatch_us"),
], ids=["non-number peak", "zero memory", "missing peak", "zero host bandwidth", "negative bandwidth",
        "fractional devices", "negative dispatch", "non-number MoE dispatch", "efficiency above 1",
        "zero efficiency", "non-bool overlap", "removed per-layer overhead"])
def test_bad_hardware_files_are_one_line(change, words, tmp_path):
    import yaml

    spec = yaml.safe_load((ROOT / "predictors" / "hardware" / "h100.yaml").read_text())
    path = tmp_path / "hw.yaml"
    path.write_text(yaml.safe_dump({**spec, **change}))
    assert refused(cli("plan", "qwen3-8b", "--devices", 8, "--hardware", path, "--out", tmp_path / "p.json"), words)


@pytest.mark.parametrize("change, words", [
    ({"tp": "2"}, "tp must be a whole number"),
    ({"lora": {"rank": 8, "dropout": 0.1}}, "unknown LoRA field(s): 'dropout'"),
    ({"micro_batch": None}, "micro_batch must be a whole number"),
    ({"dtype": "int3"}, "dtype must be one of"),
    ({"tp": 10**9}, "tp must be a whole number from 1 to"),
], ids=["tp as text", "unknown LoRA key", "micro_batch null", "dtype int3", "tp 1e9"])
def test_bad_plans_are_one_line(change, words, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"schema_version": 2, **change}))
    assert refused(cli("predict", "qwen3-8b", "--plan", path, "--hardware", "H100"), words)


def test_a_bad_spec_is_one_line(tmp_path):
    spec = json.loads(cli("inspect", "qwen3-8b", "--json").stdout)
    spec["hidden_size"] = -64
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    assert refused(cli("plan", path, "--devices", 8, "--hardware", "H100", "--out", tmp_path / "p.json"),
                   "hidden_size must be a whole number")


def test_predictor_train_out_at_an_existing_file_is_one_line(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("keep me")
    assert refused(cli("predictor", "train", "--out", text), "is a file") and text.read_text() == "keep me"


def test_negative_token_ids_are_one_line(copy_of, tmp_path):
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.array([5, -1, 7] * 2000, dtype=np.int64))  # longer than the plan's sequence
    assert refused(cli("train", copy_of(), "--steps", 1, "--data", tokens), "never negative")


@pytest.mark.parametrize("args, words", [
    (["plan", "qwen3-8b", "--devices", 10**12, "--hardware", "H100"], "--devices must be from 1 to"),
    (["plan", "qwen3-8b", "--devices", 8, "--hardware", "H100", "--top", -5], "must be at least 1"),
    (["train", "b", "--checkpoint-every", -1], "must be at least 0"),
    (["inspect", "qwen3-8b", "--seq-len", "many"], "is not a whole number"),
], ids=["devices 1e12", "top -5", "checkpoint-every -1", "seq-len not a number"])
def test_bad_arguments_are_one_line_and_quick(args, words, tmp_path):
    assert refused(cli(*args, cwd=tmp_path), words)  # quick: done within HANG


def test_an_internal_error_is_one_line_with_its_own_exit_code(monkeypatch, capsys):
    """A bug of ours (here planted) is reported in one line with exit 70; --debug shows its traceback."""
    import cli as onboard_cli
    import onboard.source

    def broken(*args, **kwargs):
        raise RuntimeError("planted\nbug")

    monkeypatch.setattr(onboard.source, "catalogue_index", broken)
    assert onboard_cli.main(["catalogue"]) == onboard_cli.INTERNAL_ERROR
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "internal error: RuntimeError: planted bug" in err and "--debug" in err
    with pytest.raises(RuntimeError, match="planted"):
        onboard_cli.main(["--debug", "catalogue"])


@pytest.mark.parametrize("name, text, words", [
    ("provenance.json", "[1, 2]", "provenance.json must be a JSON object"),
    ("provenance.json", '{"files": {}, "source": {}}', "no 'versions'"),
    ("decision.json", '{"schema_version": 1, "generated": 5}', "'generated' must be a list"),
    ("verification.json", "[" * 100000 + "]" * 100000, "nested too deeply"),
], ids=["provenance a list", "provenance without versions", "generated not a list", "deeply nested"])
def test_review_of_malformed_parts_is_one_line(name, text, words, copy_of):
    b = copy_of()
    (b / name).write_text(text)
    assert refused(cli("review", b), str(b / name), words)


@pytest.mark.parametrize("text", ["[1, 2]", '{"versions": 3}', "{not json"])
def test_check_with_a_malformed_provenance_says_it_differs(text, copy_of):
    """check compares a bundle with a fresh one; a provenance record a pull request broke is a difference."""
    b = copy_of()
    (b / "provenance.json").write_text(text)
    result = cli("check", b)
    assert result.returncode == 5 and "Traceback" not in result.stderr, result.stderr  # 5: stale
    assert "provenance.json" in result.stdout


def _log(path, model_change=None, step_time="1.0"):
    header = {"kind": "run", "schema_version": 1, "run_id": "a", "source": "runtime",
              "model": {"name": "m", "layers": 2, "hidden": 32, "experts": 8, "top_k": 2, "moe_layers": 2,
                        **(model_change or {})},
              "plan": {"dtype": "fp32"}, "hardware": {"name": "cpu", "devices": 1}, "precision": "fp32", "meta": {}}
    steps = [f'{{"kind": "step", "run_id": "a", "step": {i}, "step_time_s": {step_time}, "tokens_per_s": 1.0}}'
             for i in range(3)]
    path.write_text("\n".join([json.dumps(header), *steps]) + "\n")
    return path


@pytest.mark.parametrize("model_change, step_time, words", [
    (None, "Infinity", "step_time_s must be a positive finite number, got inf"),
    (None, "NaN", "step_time_s must be a positive finite number, got nan"),
    ({"hidden": 1e308}, "1.0", "hidden 1e+308 is beyond any model's"),
    ({"layers": 10**30}, "1.0", "is beyond any model's"),
], ids=["infinite step time", "NaN step time", "hidden 1e308", "layers 1e30"])
def test_predictor_train_on_unusable_logs_is_one_line(model_change, step_time, words, tmp_path):
    log = _log(tmp_path / "log.jsonl", model_change, step_time)
    result = cli("predictor", "train", "--logs", log, "--only", "--out", tmp_path / "m")
    assert refused(result, str(log), words) and not (tmp_path / "m").exists(), result.stderr


def test_a_run_log_that_is_a_fifo_is_refused_without_waiting(tmp_path):
    """Each command in a process of its own (an open of a FIFO blocks in the system call), HANG seconds at most."""
    os.mkfifo(tmp_path / "log.jsonl")
    assert refused(cli_process("report", tmp_path / "log.jsonl", "--out", tmp_path / "r"), "not a regular file")
    result = cli_process("plan", "mixtral-8x7b", "--devices", 8, "--hardware", "H100", "--runlog",
                         tmp_path / "log.jsonl", "--out", tmp_path / "p.json")
    assert refused(result, "not a regular file")


# -- one bounded reader for every file a verb takes (issue 55) -------------------------------------------------
def _hostile_file(kind: str, folder: Path, suffix: str) -> Path:
    """A file argument that is no bounded regular file: a device that never ends, a FIFO, a folder, a link loop,
    or one JSON line nested 100,000 deep."""
    path = folder / f"{kind}{suffix}"
    if kind == "zero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "loop":
        path.symlink_to(path.name)
    else:
        path.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    return path


HOSTILE_FILES = ("zero", "fifo", "folder", "loop", "deep")


def test_the_bounded_reader_takes_only_a_regular_file_of_its_size_and_depth(tmp_path):
    from runtime import bounded

    for kind in HOSTILE_FILES:
        with pytest.raises(bounded.Refused, match=str(tmp_path)):
            bounded.read_json(_hostile_file(kind, tmp_path, ".json"), "plan")
    big = tmp_path / "big.json"
    big.write_text("[" + "0," * 600_000 + "0]")
    with pytest.raises(bounded.Refused, match="over the 1,048,576"):
        bounded.read_json(big, "plan")
    assert bounded.read_json(big, "run log")[-1] == 0  # the same file within another kind's size
    nested = tmp_path / "nested.json"
    nested.write_text("[" * bounded.MAX_DEPTH + "]" * bounded.MAX_DEPTH)
    assert bounded.depth(bounded.read_json(nested, "plan")) == bounded.MAX_DEPTH
    nested.write_text('{"a": ' * (bounded.MAX_DEPTH + 1) + "1" + "}" * (bounded.MAX_DEPTH + 1))
    with pytest.raises(bounded.Refused, match="nested deeper than 64"):
        bounded.read_json(nested, "plan")


@pytest.mark.parametrize("kind", HOSTILE_FILES)
def test_every_verb_refuses_a_file_argument_that_is_no_bounded_regular_file(kind, copy_of, tmp_path):
    """`train --plan`, `plan --hardware`, `agent --replay`, `report` and a bundle's agent.jsonl under `check`: one
    line and a non-zero exit, at once (a FIFO or /dev/zero hung the first three; a deep line was a RecursionError,
    exit 70, under `check` and `report`)."""
    b = copy_of()
    cases = {
        "train --plan": ("train", b, "--plan", _hostile_file(kind, tmp_path, ".json"), "--steps", 1),
        "plan --hardware": ("plan", "qwen3-8b", "--devices", 8, "--hardware", _hostile_file(kind, tmp_path, ".yaml"),
                            "--out", tmp_path / "p.json"),
        "agent --replay": ("agent", "qwen3-8b", "--replay", _hostile_file(kind, tmp_path, ".jsonl"),
                           "--out", tmp_path / "agent-out"),
        "report": ("report", _hostile_file(kind, tmp_path, ".log.jsonl"), "--out", tmp_path / "r"),
    }
    for verb, args in cases.items():
        result = cli(*args)
        assert refused(result), f"{verb} with a {kind}: {result.returncode} {result.stderr[-400:]}"
    assert not (tmp_path / "p.json").exists() and not (tmp_path / "agent-out").exists()
    if kind == "deep":
        (b / "agent.jsonl").write_text('{"event": "session", "schema_version": 1}\n' + "[" * 100_000 + "]" * 100_000)
        result = cli("check", b)
        assert refused(result, "agent.jsonl:2", "nested deeper"), result.stderr[-400:]


@pytest.mark.parametrize("option, value", [("--clip", "-1"), ("--lr", "inf"), ("--lr", "nan"),
                                           ("--weight-decay", "-0.1")])
def test_values_that_cannot_train_are_refused_before_anything_is_built(option, value, copy_of, tmp_path):
    """A negative clip norm flipped the gradient (the loss rose from 5.49 to 6.50 over 6 steps, exit 0); an
    infinite learning rate made the weights inf / NaN."""
    b = copy_of()
    result = cli("train", b, option, value, "--steps", 1, "--runlog", tmp_path / "log.jsonl")
    assert result.returncode == 2 and f"argument {option}: must be a finite number of at least 0" in result.stderr
    assert not (tmp_path / "log.jsonl").exists() and not (b / "checkpoints").exists()


def test_a_run_log_is_appended_only_to_a_run_log(copy_of, tmp_path):
    """`--runlog notes.txt`, the user's text, is refused and left as it was (train appended JSON lines to it); a new
    file and a run log are written to."""
    from runtime.runlog import RunLogWriter, why_not_appendable

    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    result = cli("train", copy_of(), "--steps", 1, "--runlog", notes)
    assert refused(result, "notes.txt", "not a run log") and notes.read_text() == "my notes\n"
    with pytest.raises(ValueError, match="not a run log"):  # the runtime's own writer refuses it too
        RunLogWriter(notes, model={}, plan={}, hardware={}, precision="fp32")
    log = tmp_path / "runs.jsonl"
    assert why_not_appendable(log) is None
    RunLogWriter(log, model={}, plan={}, hardware={}, precision="fp32").close()
    assert why_not_appendable(log) is None and why_not_appendable(tmp_path) is not None


@pytest.mark.parametrize("store", ["a file", "/proc/self/kernels"])
def test_a_kernel_store_that_is_no_writable_folder_is_an_input_error(store, tmp_path):
    """The message was right, but the exit was 70 (internal error): it is the user's setting to fix, exit 1."""
    if store == "a file":
        store = tmp_path / "store"
        store.write_text("mine\n")
    result = run_cli("adapt", "qwen3-next-80b-a3b", "--out", tmp_path / "b", env={"ONBOARD_KERNEL_STORE": str(store)},
                     timeout=HANG)
    assert result.returncode == 1 and refused(result, "cannot write the kernel store", "writable folder")
    assert not (tmp_path / "b").exists() and (store == "/proc/self/kernels" or store.read_text() == "mine\n")


def _damaged_predictor(folder: Path, damage: str) -> Path:
    """A copy of the shipped predictor (model, trees, reach and metadata) with its metadata or reach damaged."""
    import hashlib

    from predictors import learned

    shipped = learned.load()
    for file in shipped.path.parent.glob(f"{shipped.path.stem}.*"):
        shutil.copy(file, folder / file.name)
    meta_file = folder / f"{shipped.path.stem}.json"
    meta = json.loads(meta_file.read_text())
    if damage == "trees is text":
        meta["trees"] = "trees.npz"
    elif damage == "reach names no file":
        del meta["reach"]["file"]
    elif damage == "reach factor is a word":
        meta["reach"]["factor"] = "big"
    elif damage == "fallback is NaN":
        meta["fallback"] = {"moe": float("nan")}
    elif damage == "reach lacks its mean":
        reach = folder / meta["reach"]["file"]
        with np.load(reach) as z:
            kept = {k: z[k] for k in z.files if k != "mean"}
        with open(reach, "wb") as f:  # np.savez would add .npz to a name without it
            np.savez(f, **kept)
        meta["reach"]["sha256"] = hashlib.sha256(reach.read_bytes()).hexdigest()
    meta_file.write_text(json.dumps(meta))
    return folder / shipped.path.name


@pytest.mark.parametrize("damage", ["trees is text", "reach names no file", "reach factor is a word",
                                    "fallback is NaN", "reach lacks its mean"])
def test_a_damaged_predictor_file_is_one_line_and_writes_no_plan(damage, tmp_path):
    """Each was an internal error (exit 70), or with a NaN fallback, exit 0 and a plan with a NaN step time: the
    metadata is checked against the shape training writes before any field is used."""
    def plan(folder: Path, damage: str):
        folder.mkdir()
        return cli("plan", "qwen3-8b", "--devices", 8, "--hardware", "H100", "--out", folder / "p.json",
                   "--predictor", _damaged_predictor(folder, damage))

    assert plan(tmp_path / "whole", "none").returncode == 0 and (tmp_path / "whole" / "p.json").is_file()
    result = plan(tmp_path / "damaged", damage)
    assert refused(result, "predictor"), (damage, result.returncode, result.stderr[-300:])
    assert not (tmp_path / "damaged" / "p.json").exists()


def test_a_plan_the_models_experts_cannot_split_is_refused_before_any_rank_starts(tmp_path, monkeypatch):
    """ep 3 over a twin's 8 experts: three ranks started, failed, and torchrun printed its own traceback."""
    from onboard.train import launch

    started = []
    monkeypatch.setattr(launch, "torchrun", lambda *a: started.append(a) or 0)
    b = Path(shutil.copytree(ROOT / "bundles" / "qwen3-30b-a3b", tmp_path / "b"))
    plan = json.loads((b / "plan.json").read_text())
    plan.update(ep=3, dp_shard=3, dp_replicate=1, tp=1, pp=1, cp=1, etp=None)
    (tmp_path / "ep3.json").write_text(json.dumps(plan))
    result = cli("train", b, "--plan", tmp_path / "ep3.json", "--steps", 1)
    assert refused(result, "ep=3 must divide the 8 experts") and not started, result.stderr[-300:]
    plan.update(ep=2, dp_shard=2)  # the same model split in two: it reaches the launcher
    (tmp_path / "ep2.json").write_text(json.dumps(plan))
    assert cli("train", b, "--plan", tmp_path / "ep2.json", "--steps", 1).returncode == 0 and len(started) == 1


def test_a_checkpoint_folders_job_file_is_read_bounded(tmp_path):
    """job.json arrives with a checkpoint folder (`onboard export` reads it): a FIFO, /dev/zero, a folder, a link
    loop or a 100,000-deep line is a ValueError naming it, at once."""
    from runtime.train.job import TrainJob

    for kind in HOSTILE_FILES:
        with pytest.raises(ValueError, match=f"{kind}.json"):
            TrainJob.load(_hostile_file(kind, tmp_path, ".json"))
    (tmp_path / "job.json").write_text(TrainJob(steps=3).to_json())
    assert TrainJob.load(tmp_path / "job.json").steps == 3
