"""`onboard report`: what training runs did, from their run logs, as figures, one self-contained HTML page and
a terminal summary; `--follow` re-renders while a log is still being written. onboard/report/runs.py reads and
condenses the logs, onboard/report/figures.py draws; this module writes the report folder, the page and the summary.
"""

from __future__ import annotations

import base64
import functools
import html
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from onboard.errors import OnboardError
from onboard.outputs import writable_folder
from onboard.report.runs import (COLD, HOT, Damage, RunData, hardware_summary, log_files, pick_curves,
                              pick_expert_runs, plan_summary, read_logs)

DEFAULT_OUT = "onboard-report"
MARKER = ".onboard-report"  # lists the files a report wrote: the only ones a later report replaces or removes


# --- writing ---------------------------------------------------------------------------------------------


def check_out(out) -> Path:
    """The report folder, refused before any reading when it is a file or a folder of the user's (one an earlier
    report wrote, or an empty one, is fine); made only when there is a report to put in it."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OnboardError(f"--out {out} is a file; give a folder for the report")
    if out.is_dir() and not (out / MARKER).is_file() and any(out.iterdir()):
        raise OnboardError(f"--out {out} holds files that no onboard report wrote (it has no {MARKER}); give a new "
                           f"or empty folder")
    return out


@functools.cache
def _file_mode() -> int:
    """What open() would give a new file: mkstemp's 0600 would keep the report from whoever serves or shares it."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _write(path: Path, data: bytes) -> None:
    """Readers (a browser refreshing the page) see the old file or the new one, never half of one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, _file_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _written_before(out: Path) -> set[str]:
    try:
        names = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return set()
    # only plain names of the kinds a report writes: a doctored marker cannot point anywhere else
    return {n for n in names if isinstance(n, str) and n == Path(n).name and n.endswith((".png", ".html"))}


def write_report(out: Path, figures: list, page: str) -> None:
    """The figures and the page, then the previous report's files this one did not write again removed."""
    writable_folder(out, "report")
    names = {f.name for f in figures} | {"index.html"}
    before = _written_before(out)
    _write(out / MARKER, json.dumps(sorted(before | names)).encode())  # first, so an interrupted write is tidied
    for f in figures:
        _write(out / f.name, f.png)
    _write(out / "index.html", page.encode())
    for name in sorted(before - names):
        (out / name).unlink(missing_ok=True)
    _write(out / MARKER, json.dumps(sorted(names)).encode())


# --- the page and the summary ----------------------------------------------------------------------------


@dataclass
class Report:
    runs: list[RunData]
    damage: list[Damage]
    curves: list[RunData]
    curves_note: str
    expert_runs: list[RunData]
    expert_note: str
    figures: list = field(default_factory=list)  # run_figures.Figure


def _ep_cell(r: RunData) -> str:
    worst = r.worst_imbalance()
    return "" if worst is None else "ep 1" if r.ep == 1 else f"{worst:.2f}"


def _hot_cell(r: RunData) -> str:
    hottest = r.hottest()
    return "" if hottest is None else f"{hottest[0]:.2f}x (layer {hottest[1]}, e{hottest[2]})"


def _cells(r: RunData) -> dict[str, str]:
    """One run as the table's cells: the page and the terminal say the same things."""
    def num(value, spec):
        return "" if value is None else format(value, spec)

    step = r.median("step_time_s")
    return {"run": r.name, "model": r.model_name, "plan": plan_summary(r.run.plan),
            "hardware": hardware_summary(r.run.hardware), "steps": str(len(r.steps)),
            "median step time": "" if step is None else f"{step:.3g} s",
            "median tokens/s": num(r.median("tokens_per_s"), ",.0f"), "final loss": num(r.final("loss"), ".4f"),
            "final eval loss": num(r.evals()[1][-1] if r.run.evals else None, ".4f"),
            "worst EP max/mean": _ep_cell(r), "hottest expert": _hot_cell(r)}


def _experts_line(r: RunData) -> str:
    hot = sum(len(layer.hot()) for layer in r.layers)
    cold = sum(len(layer.cold()) for layer in r.layers)
    experts = "/".join(sorted({str(layer.experts) for layer in r.layers}))
    text = (f"{r.name}: {hot} hot and {cold} cold experts in {len(r.layers)} MoE layers of {experts} experts; "
            f"hottest {_hot_cell(r)}")
    if r.ep > 1 and r.worst_imbalance() is not None:
        text += f"; busiest of {r.ep} EP ranks {r.worst_imbalance():.2f}x the mean at worst"
        changes = sorted({s for layer in r.layers for s in layer.changes()})
        if changes:
            text += f"; placement changed at step{'s' if len(changes) > 1 else ''} {', '.join(map(str, changes[:8]))}"
    if r.bad_expert_steps:
        text += f"; {r.bad_expert_steps} steps' expert counts or placement unreadable"
    return text


def summary(report: Report, out: Path) -> list[str]:
    """The terminal summary: one line per run, one more per run whose experts were drawn, where the page is."""
    columns = ("run", "model", "plan", "steps", "median step time", "median tokens/s", "final loss",
               "worst EP max/mean", "hottest expert")
    rows = [{**_cells(r), "model": r.label.split(" · ")[0].split(" ", 1)[1]} for r in report.runs]
    widths = {c: max(len(c), *(len(row[c]) for row in rows)) for c in columns}
    right = {"steps", "median step time", "median tokens/s", "final loss", "worst EP max/mean"}
    lines = ["  ".join(c.rjust(widths[c]) if c in right else c.ljust(widths[c]) for c in columns).rstrip()]
    for row in rows:
        lines.append("  ".join(row[c].rjust(widths[c]) if c in right else row[c].ljust(widths[c])
                               for c in columns).rstrip())
    lines += [_experts_line(r) for r in report.expert_runs]
    lines += [f"({note})" for note in (report.curves_note, report.expert_note) if note]
    lines.append(f"report: {out / 'index.html'} and {len(report.figures)} figures")
    return lines


STYLE = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222}
table{border-collapse:collapse;font-size:13px}th,td{border-bottom:1px solid #ddd;padding:3px 8px;text-align:left}
td.n{text-align:right;font-variant-numeric:tabular-nums}figure{margin:1.5em 0}img{max-width:100%}
figcaption{font-size:14px;color:#444}.warn{color:#a40}p.note{color:#555;font-size:14px}"""
NUMERIC = {"steps", "median step time", "median tokens/s", "final loss", "final eval loss", "worst EP max/mean"}


def _figure_html(f) -> str:
    data = base64.b64encode(f.png).decode()
    return (f'<figure id="{html.escape(f.name)}"><figcaption><b>{html.escape(f.title)}</b>. '
            f'{html.escape(f.caption)} <code>{html.escape(f.name)}</code></figcaption>'
            f'<img src="data:image/png;base64,{data}" alt="{html.escape(f.title)}"></figure>')


def _flags_html(r: RunData) -> str:
    items = []
    for layer in r.layers:
        words = []
        for kind, flags in (("hot", layer.hot()), ("cold", layer.cold())):
            if flags:
                shown = ", ".join(f"e{f.expert} {f.ratio:.2f}x" for f in flags[:12])
                words.append(f"{kind}: {shown}" + (f" and {len(flags) - 12} more" if len(flags) > 12 else ""))
        items.append(f"<li>layer {layer.index}: {html.escape('; '.join(words) or 'none stayed hot or cold')}</li>")
    hot, cold = (r.layers[0].hot_factor, r.layers[0].cold_factor) if r.layers else (HOT, COLD)
    return (f"<p>{html.escape(_experts_line(r))}.</p><p class=note>Hot: above {hot:g}x the uniform share of the "
            f"layer's tokens in most steps; cold: below {cold:g}x; the number is the share over the whole run.</p>"
            f"<ul>{''.join(items)}</ul>")


def page(report: Report, refresh: float | None = None) -> str:
    """The whole report as one HTML file: the figures are inside it, so it can be mailed or attached."""
    columns = list(_cells(report.runs[0]))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td{' class=n' if c in NUMERIC else ''}>{html.escape(v)}</td>"
                                    for c, v in _cells(r).items()) + "</tr>" for r in report.runs)
    files = sorted({str(r.path) for r in report.runs})
    parts = ["<!doctype html><html><head><meta charset=utf-8>",
             f'<meta http-equiv="refresh" content="{max(2, round(refresh))}">' if refresh else "",
             f"<title>onboard report: {len(report.runs)} run{'s' if len(report.runs) > 1 else ''}</title>",
             f"<style>{STYLE}</style></head><body><h1>Training runs</h1>",
             f"<p>{len(report.runs)} runs from {html.escape(', '.join(files))}; written "
             f"{time.strftime('%Y-%m-%d %H:%M:%S')}{' (following: the page reloads itself)' if refresh else ''}.</p>"]
    parts += [f"<p class=warn>{html.escape(d.warning())}</p>" for d in report.damage]
    parts.append(f"<h2>Runs</h2><table><tr>{head}</tr>{body}</table>")
    parts.append("<h2>Compared</h2>" + (f"<p class=note>{html.escape(report.curves_note)}</p>"
                                         if report.curves_note else ""))
    parts += [_figure_html(f) for f in report.figures if not f.section]
    if report.expert_runs:
        parts.append("<h2>Experts</h2>" + (f"<p class=note>{html.escape(report.expert_note)}</p>"
                                            if report.expert_note else ""))
    for r in report.expert_runs:
        parts.append(f"<h3>{html.escape(r.label)}</h3>{_flags_html(r)}")
        parts += [_figure_html(f) for f in report.figures if f.section == r.name]
    parts.append("</body></html>\n")
    return "\n".join(p for p in parts if p)


# --- the command -----------------------------------------------------------------------------------------


def render(runs: list[RunData], damage: list[Damage], out: Path, refresh: float | None = None) -> Report:
    from onboard.report.figures import draw

    curves, curves_note = pick_curves(runs)
    expert_runs, expert_note = pick_expert_runs(runs)
    report = Report(runs, damage, curves, curves_note, expert_runs, expert_note)
    report.figures = draw(runs, curves, expert_runs)
    write_report(out, report.figures, page(report, refresh))
    return report


def _no_runs(paths, damage: list[Damage]) -> OnboardError:
    """One line, the damage folded in: when nothing could be read, the damage is the story."""
    first = damage[0] if damage else None
    why = (f" ({sum(d.lines for d in damage)} damaged lines skipped, first at {first.path} line {first.first}: "
           f"{first.why})") if first else ""
    return OnboardError(f"no runs with steps in {', '.join(map(str, paths))}{why}")


def report(paths, out=DEFAULT_OUT, *, follow: bool = False, interval: float = 2.0, idle_exit: float | None = None,
           hot: float = HOT, cold: float = COLD) -> int:
    """`onboard report`: write the figures and the page into `out`, print the summary; 0 when written."""
    if not hot > 1 or not 0 <= cold < 1:
        raise OnboardError(f"--hot must be above 1 and --cold from 0 to below 1 (got {hot:g} and {cold:g})")
    files = log_files(paths)
    out = check_out(out)
    if follow:
        return _follow(paths, out, interval, idle_exit, hot, cold)
    runs, damage = read_logs(files, hot=hot, cold=cold)
    if not runs:
        raise _no_runs(paths, damage)
    for d in damage:
        print(d.warning(), file=sys.stderr)
    print("\n".join(summary(render(runs, damage, out), out)))
    return 0


def _stamp(paths) -> tuple:
    """What changes when a log grows, is replaced or appears in a folder being followed."""
    out = []
    for path in log_files(paths):
        try:
            st = path.stat()
            out.append((str(path), st.st_size, st.st_mtime_ns))
        except OSError:
            out.append((str(path), -1, -1))
    return tuple(out)


def _follow(paths, out: Path, interval: float, idle_exit: float | None, hot: float, cold: float) -> int:
    """Re-read and re-render whenever a log changes, until the logs stay unchanged for `idle_exit` seconds or the
    user interrupts; then the page stops reloading itself and the summary is printed."""
    seen, changed_at, done, said = None, time.monotonic(), None, {}

    def warn(damage: list[Damage]):
        for d in damage:  # once per file, and again only when its damage changes
            if said.get(d.path) != d:
                said[d.path] = d
                print(d.warning(), file=sys.stderr, flush=True)

    try:
        while True:
            stamp = _stamp(paths)
            if stamp != seen:
                seen, changed_at = stamp, time.monotonic()
                runs, damage = read_logs(log_files(paths), growing=True, hot=hot, cold=cold)
                warn(damage)
                if not runs and not said.get("waiting"):
                    said["waiting"] = True
                    print(f"waiting for steps in {', '.join(map(str, paths))} (Ctrl-C to stop"
                          f"{f', or {idle_exit:g} s without a change' if idle_exit is not None else ''})", flush=True)
                if runs:
                    done = render(runs, damage, out, refresh=interval)
                    print(f"{time.strftime('%H:%M:%S')} {len(runs)} run{'s' if len(runs) > 1 else ''}, "
                          f"{sum(len(r.steps) for r in runs)} steps: {out / 'index.html'}", flush=True)
            elif idle_exit is not None and time.monotonic() - changed_at >= idle_exit:
                break
            time.sleep(interval)
    except KeyboardInterrupt:
        pass
    if done is None:
        raise _no_runs(paths, read_logs(log_files(paths), hot=hot, cold=cold)[1])
    warn(read_logs(log_files(paths), hot=hot, cold=cold)[1])  # a line left unfinished is damage now
    _write(out / "index.html", page(done).encode())
    print("\n".join(summary(done, out)))
    return 0
