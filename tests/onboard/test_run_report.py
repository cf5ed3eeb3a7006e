"""`onboard report`: figures and one self-contained page from run logs. The CPU sweep logs render and the page
embeds and titles every figure; EP-rank loads follow the placement each step names; hot and cold experts are
the ones that stayed so; damaged logs are read up to (and past) the damage with one warning per file; --follow
picks up steps written while it runs; bad input is one line and a non-zero exit."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

import cli
from onboard.report import page as run_report
from onboard.report.figures import Figure
from onboard.report.runs import log_files, pick_curves, read_logs
from runtime.moe.placement import Placement, imbalance, rank_loads
from tests.helpers import ROOT

SWEEP = ROOT / "predictors" / "data" / "runlogs" / "cpu_sweep.jsonl"
PLAN = {"cp": 1, "dp_replicate": 1, "dp_shard": 4, "dtype": "fp32", "ep": 4, "grad_accum": 1, "lora": None,
        "loss_chunk": None, "micro_batch": 1, "pp": 1, "recompute": "none", "schema_version": 1, "seq_len": 64,
        "tp": 1}


def header(run_id="a", ep=4, name="tiny-moe") -> dict:
    return {"kind": "run", "schema_version": 1, "run_id": run_id, "source": "runtime",
            "model": {"name": name, "layers": 2, "hidden": 32}, "plan": {**PLAN, "ep": ep},
            "hardware": {"name": "cpu", "devices": 4}, "precision": "fp32", "meta": {}}


def step(n, run_id="a", **extra) -> dict:
    return {"kind": "step", "run_id": run_id, "step": n, "step_time_s": 0.5 + 0.01 * n, "tokens_per_s": 1000.0 - n,
            "peak_memory_bytes": 2**30, "loss": 5.0 - 0.1 * n, "expert_tokens": None, "comm_time_s": 0.05, **extra}


def write_log(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


class Page(HTMLParser):
    """The figures of a report page (id, caption, img src, alt) and its table rows."""

    def __init__(self, text: str):
        super().__init__()
        self.figures, self.rows, self.refresh = [], [], False
        self._in, self._text = None, []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "figure":
            self.figures.append({"id": attrs.get("id"), "caption": ""})
        elif tag == "img" and self.figures:
            self.figures[-1].update(src=attrs.get("src", ""), alt=attrs.get("alt", ""))
        elif tag == "figcaption":
            self._in, self._text = "caption", []
        elif tag == "tr":
            self.rows.append([])
        elif tag == "td":
            self._in, self._text = "cell", []
        elif tag == "meta" and attrs.get("http-equiv") == "refresh":
            self.refresh = True

    def handle_data(self, data):
        if self._in:
            self._text.append(data)

    def handle_endtag(self, tag):
        if tag == "figcaption" and self._in == "caption":
            self.figures[-1]["caption"] = "".join(self._text)
            self._in = None
        elif tag == "td" and self._in == "cell":
            self.rows[-1].append("".join(self._text))
            self._in = None


def check_page(out: Path) -> Page:
    """Every PNG in `out` is in the page, embedded byte for byte and titled, and every figure is a PNG in `out`."""
    page = Page((out / "index.html").read_text())
    pngs = {p.name: p.read_bytes() for p in out.glob("*.png")}
    assert pngs and sorted(f["id"] for f in page.figures) == sorted(pngs)
    for f in page.figures:
        assert f["src"].startswith("data:image/png;base64,")
        assert base64.b64decode(f["src"].split(",", 1)[1]) == pngs[f["id"]]
        assert pngs[f["id"]][:8] == b"\x89PNG\r\n\x1a\n"
        assert f["alt"] and f["caption"].startswith(f["alt"]) and len(f["caption"]) > len(f["alt"]) + 20
    return page


def sweep_slice(tmp_path, keep) -> Path:
    """The sweep runs whose header satisfies `keep`, in a file of their own (rendering all 119 is the slow test)."""
    chosen, lines = set(), []
    for line in SWEEP.read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "run" and keep(record, len(chosen)):
            chosen.add(record["run_id"])
        if record["run_id"] in chosen:
            lines.append(line)
    path = tmp_path / "slice.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_sweep_slice_renders_every_figure_into_the_page(tmp_path, capsys):
    ep_runs = []

    def keep(record, n):  # the first run, and the first run at ep 2 and at ep 4
        ep = record["plan"]["ep"]
        if n == 0 or ep > 1 and ep not in ep_runs:
            ep_runs.append(ep)
            return True
        return False

    log, out = sweep_slice(tmp_path, keep), tmp_path / "report"
    assert cli.main(["report", str(log), "--out", str(out)]) == 0
    page = check_page(out)
    names = {f["id"] for f in page.figures}
    assert {"loss.png", "throughput.png", "communication.png", "memory.png", "ep-imbalance.png"} <= names
    for run in ("r1", "r2", "r3"):
        assert {f"{run}-tokens-per-expert.png", f"{run}-hot-cold.png"} <= names
    assert "r1-ep-load.png" not in names and {"r2-ep-load.png", "r3-ep-load.png"} <= names  # r1 has ep 1
    assert [row[0] for row in page.rows if row] == ["r1", "r2", "r3"]
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in printed[1:4]] == ["r1", "r2", "r3"]
    assert printed[-1] == f"report: {out / 'index.html'} and {len(names)} figures"


@pytest.mark.slow
def test_whole_sweep_renders_and_compares_a_chosen_few(tmp_path):
    out = tmp_path / "report"
    assert cli.main(["report", str(SWEEP), "--out", str(out)]) == 0
    page = check_page(out)
    assert "all-runs.png" in {f["id"] for f in page.figures}
    assert len([row for row in page.rows if row]) == 119


def test_many_runs_are_compared_through_a_spread_of_distinct_ones():
    runs, damage = read_logs(log_files([SWEEP]))
    assert len(runs) == 119 and not damage
    chosen, note = pick_curves(runs)
    speeds = sorted(r.median("tokens_per_s") for r in runs)
    picked = [r.median("tokens_per_s") for r in chosen]
    assert len(chosen) == 8 and "8 of 119" in note
    assert max(picked) == speeds[-1] and min(picked) == speeds[0]
    assert len({json.dumps([r.run.model, r.run.plan], sort_keys=True) for r in chosen}) == 8  # no repeats


def skewed_log(tmp_path) -> Path:
    """ep 4, 8 experts: experts 0 and 1 (both on rank 0 in the contiguous layout) take most tokens; expert 7 is
    hot in two steps only; from step 5 a placement spreads 0 and 1 and replicates them."""
    spread = Placement(8, ((0, 2), (1, 3), (4, 5), (6, 7)), ((), (), (0,), (1,)), spare=1).to_dict()
    records = [header()]
    for n in range(10):
        counts = [400, 400, 50, 50, 50, 50, 100, 400 if n < 2 else 20]
        records.append(step(n, expert_tokens=[counts, counts[::-1]],
                            expert_placement=[spread, None] if n >= 5 else None,
                            peak_memory_bytes_by_rank=[2**30 + r * 2**28 for r in range(4)] if n else None))
    return write_log(tmp_path / "skewed.jsonl", records)


def test_imbalance_follows_the_placement_of_each_step(tmp_path):
    (run,), damage = read_logs([skewed_log(tmp_path)])
    assert not damage and run.ep == 4 and len(run.layers) == 2
    first, second = run.layers
    values = first.imbalance()
    counts = first.counts
    contiguous, spread = Placement.contiguous(8, 4), Placement.from_dict(run.steps[5]["expert_placement"][0])
    # the module's own answer, and by hand: rank 0 holds 0 and 1 (800 of 1100 + x tokens) before the change
    assert values[2] == pytest.approx(imbalance(counts[2], contiguous)) == pytest.approx(800 / (1120 / 4))
    assert values[7] == pytest.approx(imbalance(counts[7], spread)) == pytest.approx(320 / (1120 / 4))
    assert min(values[:5]) > 2.0 and max(values[5:]) < 1.2
    assert first.changes() == [5] and second.changes() == []
    assert list(first.rank_loads()[7]) == pytest.approx(rank_loads(counts[7], spread))
    # the second layer (counts reversed) stays on the contiguous layout: its hot experts 6 and 7 share rank 3
    assert second.imbalance()[7] == pytest.approx(imbalance(counts[7][::-1], contiguous))
    assert run.worst_imbalance() == pytest.approx(max(v for layer in run.layers for v in layer.imbalance()))


def test_hot_and_cold_experts_are_the_ones_that_stayed_so(tmp_path):
    (run,), _ = read_logs([skewed_log(tmp_path)])
    layer = run.layers[0]
    assert [f.expert for f in layer.hot()] == [0, 1]  # 7 was hot in 2 of 10 steps: not flagged
    assert sorted(f.expert for f in layer.cold()) == [2, 3, 4, 5, 7]  # 6 (0.7x) is neither
    assert layer.hot()[0].steps == 1.0 and layer.hot()[0].ratio == pytest.approx(
        8 * 4000 / layer.counts.sum())
    stricter = read_logs([skewed_log(tmp_path)], hot=3.0, cold=0.2)[0][0].layers[0]
    assert stricter.hot() == [] and sorted(f.expert for f in stricter.cold()) == [7]


def test_a_rebalanced_run_renders_its_expert_figures(tmp_path, capsys):
    out = tmp_path / "report"
    assert cli.main(["report", str(skewed_log(tmp_path)), "--out", str(out)]) == 0
    figures = {f["id"]: f["caption"] for f in check_page(out).figures}
    assert {"r1-tokens-per-expert.png", "r1-ep-load.png", "r1-hot-cold.png", "ep-imbalance.png"} <= figures.keys()
    assert "where the placement changed" in figures["r1-ep-load.png"]
    assert "placement changed at step 5" in capsys.readouterr().out


def test_memory_per_rank_falls_back_to_the_single_figure(tmp_path):
    (run,), _ = read_logs([skewed_log(tmp_path)])
    steps, per_rank, by_rank = run.memory()
    assert by_rank and steps == list(range(10))
    assert per_rank[0] == [2**30] and per_rank[1] == [2**30 + r * 2**28 for r in range(4)]


def test_a_step_with_an_unreadable_placement_has_no_load_and_is_counted(tmp_path):
    bad = {"experts": 8, "spare": 0, "owners": [[0, 0], [1, 2], [3, 4], [5, 6]], "replicas": [[], [], [], []]}
    records = [header(), step(0, expert_tokens=[[10] * 8]), step(1, expert_tokens=[[10] * 8],
                                                                    expert_placement=[bad]),
               step(2, expert_tokens=[[10] * 7]), step(3, expert_tokens=[[10, "x"] + [1] * 6])]
    (run,), _ = read_logs([write_log(tmp_path / "bad.jsonl", records)])
    assert run.layers[0].steps == [0, 1] and run.bad_expert_steps == 3
    assert run.layers[0].imbalance() == [1.0, None]


def test_damaged_logs_are_read_past_the_damage_with_one_warning_each(tmp_path, capsys):
    good = [header(ep=1), step(0), step(1), step(2)]
    first = tmp_path / "cut.jsonl"
    first.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in good) + b"not json at all\n"
                      + b"\xff\xfe\x00binary\n" + json.dumps(step(3)).encode() + b"\n"
                      + json.dumps(step(4)).encode()[:40])
    second = write_log(tmp_path / "other.jsonl", [header("b", ep=1), step(0, "b"), step(1, "zzz"), step(2, "b")])
    out = tmp_path / "report"
    assert cli.main(["report", str(first), str(second), "--out", str(out)]) == 0
    warnings = capsys.readouterr().err.splitlines()
    assert warnings == [
        f"warning: {first}: 3 damaged lines skipped (first at line 5: not valid JSON (Expecting value))",
        f"warning: {second}: 1 damaged line skipped (first at line 3: no header for run 'zzz')"]
    page = check_page(out)
    assert [row[:1] + row[4:5] for row in page.rows if row] == [["r1", "4"], ["r2", "2"]]
    assert "3 damaged lines skipped" in (out / "index.html").read_text()


def test_follow_renders_steps_written_while_it_runs(tmp_path, capsys):
    log = tmp_path / "live.jsonl"
    write_log(log, [header(ep=1), step(0)])

    def writer():  # the training run: a step every 0.15 s, one of them in two halves
        with log.open("a") as f:
            for n in range(1, 6):
                time.sleep(0.15)
                text = json.dumps(step(n)) + "\n"
                f.write(text[:30])
                f.flush()
                time.sleep(0.15)
                f.write(text[30:])
                f.flush()

    thread = threading.Thread(target=writer)
    thread.start()
    out = tmp_path / "report"
    try:
        assert run_report.report([log], out, follow=True, interval=0.1, idle_exit=1.5) == 0
    finally:
        thread.join()
    captured = capsys.readouterr()
    assert captured.err == ""  # a line caught half-written is unfinished, not damage
    page = check_page(out)
    assert [row[4] for row in page.rows if row] == ["6"] and not page.refresh
    renders = [line for line in captured.out.splitlines() if line.endswith("index.html") and " steps: " in line]
    assert len(renders) >= 2 and renders[-1].split(" ", 1)[1].startswith("1 run, 6 steps")


def test_follow_ends_cleanly_on_ctrl_c(tmp_path, monkeypatch):
    log = write_log(tmp_path / "live.jsonl", [header(ep=1), step(0), step(1)])
    sleeps = []

    def interrupted(seconds):
        sleeps.append(seconds)
        if len(sleeps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(run_report.time, "sleep", interrupted)
    out = tmp_path / "report"
    assert run_report.report([log], out, follow=True, interval=0.5) == 0
    page = Page((out / "index.html").read_text())
    assert sleeps == [0.5, 0.5] and not page.refresh


def test_follow_says_it_waits_for_a_log_with_no_steps_yet(tmp_path, capsys):
    log = write_log(tmp_path / "live.jsonl", [header(ep=1)])
    with pytest.raises(run_report.OnboardError, match="no runs"):
        run_report.report([log], tmp_path / "report", follow=True, interval=0.05, idle_exit=0.2)
    assert capsys.readouterr().out.startswith(f"waiting for steps in {log} (Ctrl-C to stop, or 0.2 s without")


def cli_run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), "report", *map(str, args)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("case", ["missing", "empty", "header only", "out is a file", "out is a folder of yours",
                                  "a FIFO", "a FIFO in a folder"])
def test_bad_input_is_one_line_and_a_nonzero_exit(tmp_path, case):
    log = write_log(tmp_path / "run.jsonl", [header(), step(0)])
    out = tmp_path / "report"
    if case == "missing":
        log = tmp_path / "nope.jsonl"
    elif case == "empty":
        log.write_text("")
    elif case == "header only":
        write_log(log, [header()])
    elif case == "out is a file":
        out.write_text("mine")
    elif case.startswith("a FIFO"):  # no writer: reading it would block for ever
        log.unlink()
        os.mkfifo(log)
        log = log.parent if case.endswith("folder") else log
    else:
        out.mkdir()
        (out / "index.html").write_text("mine")
    result = cli_run(log, "--out", out)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and lines[0].startswith("onboard: error: ")
    assert "Traceback" not in result.stderr and result.stdout == ""
    word = {"missing": "no such file", "empty": "no runs", "header only": "no runs", "out is a file": "is a file",
            "out is a folder of yours": "no onboard report wrote", "a FIFO": "not a regular file",
            "a FIFO in a folder": "not a regular file"}.get(case)
    assert word in lines[0]
    if case == "out is a file":
        assert out.read_text() == "mine"
    elif case == "out is a folder of yours":
        assert [p.name for p in out.iterdir()] == ["index.html"] and (out / "index.html").read_text() == "mine"
    else:
        assert not out.exists()  # nothing made for a report that was not written


def test_a_report_replaces_only_its_own_files(tmp_path):
    out = tmp_path / "report"
    run_report.write_report(out, [Figure("a.png", "A", "a", b"1"), Figure("b.png", "B", "b", b"2")], "one")
    (out / "notes.txt").write_text("mine")
    run_report.write_report(out, [Figure("a.png", "A", "a", b"3")], "two")
    assert sorted(p.name for p in out.iterdir()) == [".onboard-report", "a.png", "index.html", "notes.txt"]
    assert (out / "a.png").read_bytes() == b"3" and (out / "index.html").read_text() == "two"
    (out / run_report.MARKER).write_text(json.dumps(["../outside.png", "notes.txt", "a.png"]))
    (tmp_path / "outside.png").write_bytes(b"keep")
    run_report.write_report(out, [], "three")
    assert (tmp_path / "outside.png").read_bytes() == b"keep" and (out / "notes.txt").read_text() == "mine"
    assert not (out / "a.png").exists()
