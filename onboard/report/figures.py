"""The figures of `onboard report`, drawn with matplotlib's object API on the Agg canvas (no pyplot: no global
state, no display), each returned as PNG bytes with its file name, title and caption.

Comparison figures overlay the runs `run_data.pick_curves` chose, one colour per run in every figure; each run
`run_data.pick_expert_runs` chose gets figures of its MoE layers.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from onboard.errors import OnboardError
from onboard.report.runs import MAX_CURVES, ExpertLayer, RunData

DPI = 100
GIB = 2**30
LAYERS_PER_FIGURE = 4  # heat maps stacked in one image before they get too thin to read
MAX_COLUMNS = 400  # steps are summed into at most this many columns of a heat map
RATIO_RANGE = 8.0  # colour scales of tokens / uniform share run from 1/8 to 8


@dataclass(frozen=True)
class Figure:
    name: str  # file name in the report folder
    title: str
    caption: str
    png: bytes
    section: str = ""  # "" for the comparison, else the run it belongs to ("r3")


def draw(runs: list[RunData], curves: list[RunData], expert_runs: list[RunData]) -> list[Figure]:
    """Every figure of the report, in page order."""
    colors = {r.index: _color(i) for i, r in enumerate(curves)}
    scope = f", {len(curves)} of {len(runs)} runs" if len(curves) < len(runs) else ""
    out = [_loss(curves, colors, scope), _throughput(curves, colors, scope), _communication(curves, colors, scope),
           _memory(curves, colors, scope), _every_run(runs, curves), _ep_imbalance(runs)]
    for r in expert_runs:
        out += _heat_maps(r)
        out += [_ep_load(r), _hot_cold(r)]
    return [f for f in out if f is not None]


def _matplotlib():
    try:
        from matplotlib.figure import Figure as Canvasless
    except ImportError:
        raise OnboardError("onboard report needs matplotlib (pip install 'matplotlib>=3.7')") from None
    return Canvasless


def _figure(width: float, height: float):
    return _matplotlib()(figsize=(width, height), layout="constrained")


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def _color(i: int):
    import matplotlib

    return matplotlib.colormaps["tab10"](i % 10)


def _markers(n: int) -> dict:
    """Points on short runs, where a line between five steps would hide that there are only five."""
    return {"marker": "o", "markersize": 3} if n <= 40 else {}


def _log_if_wide(ax, values) -> None:
    """Log scale when runs differ by more than 20x: otherwise the slow ones lie flat on the axis."""
    values = [v for v in values if v > 0]
    if values and max(values) / min(values) > 20:
        ax.set_yscale("log")
        _plain_log_labels(ax.yaxis)


def _plain_log_labels(axis) -> None:
    """0.2 and 3,000 on a log axis rather than 2x10^-1 and 3x10^3: the numbers are read, not their exponents."""
    from matplotlib.ticker import LogFormatter

    class Plain(LogFormatter):
        def __call__(self, x, pos=None):  # the ticks LogFormatter would label, written out
            return (f"{x:,.0f}" if x >= 1000 else f"{x:.4g}") if super().__call__(x, pos) else ""

    axis.set_major_formatter(Plain())
    axis.set_minor_formatter(Plain(labelOnlyBase=False, minor_thresholds=(2, 0.5)))


def _steps_axis(ax) -> None:
    ax.set_xlabel("step")
    ax.xaxis.get_major_locator().set_params(integer=True)


def _legend(fig, runs: list[RunData], colors: dict, extra=()) -> None:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=colors[r.index], label=r.label) for r in runs] + list(extra)
    fig.legend(handles=handles, loc="outside right upper", fontsize=8, frameon=False)


def _overlay(ax, runs, colors, key: str, scale: float = 1.0) -> list[float]:
    """One line per run of a step field; returns the values drawn."""
    drawn = []
    for r in runs:
        xs, ys = r.series(key)
        ys = [y * scale for y in ys]
        ax.plot(xs, ys, color=colors[r.index], linewidth=1.2, **_markers(len(xs)))
        drawn += ys
    return drawn


def _loss(runs, colors, scope) -> Figure | None:
    if not any(r.series("loss")[0] for r in runs):
        return None
    from matplotlib.lines import Line2D

    fig = _figure(11, 4.2)
    ax = fig.subplots()
    _overlay(ax, runs, colors, "loss")
    held_out = False
    for r in runs:
        xs, ys = r.evals()
        if xs:
            held_out = True
            ax.plot(xs, ys, color=colors[r.index], linestyle="--", marker="s", markersize=4)
    ax.set(ylabel="loss (cross-entropy, nats / token)", title=f"Loss{scope}")
    _steps_axis(ax)
    ax.grid(alpha=0.3)
    styles = [Line2D([], [], color="k", label="training loss (solid)"),
              Line2D([], [], color="k", linestyle="--", marker="s", label="held-out loss (dashed)")] if held_out else []
    _legend(fig, runs, colors, styles)
    return Figure("loss.png", "Loss", "Training loss of every step" + (", held-out loss dashed" if held_out else "")
                  + ", one colour per run.", _png(fig))


def _throughput(runs, colors, scope) -> Figure:
    fig = _figure(11, 6)
    top, bottom = fig.subplots(2, 1, sharex=True)
    _log_if_wide(top, _overlay(top, runs, colors, "tokens_per_s"))
    _log_if_wide(bottom, _overlay(bottom, runs, colors, "step_time_s"))
    top.set(ylabel="tokens / s", title=f"Throughput{scope}")
    bottom.set(ylabel="step time (s)")
    _steps_axis(bottom)
    for ax in (top, bottom):
        ax.grid(alpha=0.3, which="both")
    _legend(fig, runs, colors)
    return Figure("throughput.png", "Throughput", "Tokens per second and step time of every step (the first step "
                  "includes warm-up; the table's medians leave it out).", _png(fig))


def _communication(runs, colors, scope) -> Figure | None:
    if not any(r.series("comm_time_s")[0] for r in runs):
        return None
    fig = _figure(11, 6)
    top, bottom = fig.subplots(2, 1, sharex=True)
    _overlay(top, runs, colors, "comm_time_s")
    for r in runs:
        times = dict(zip(*r.series("step_time_s")))
        xs, comm = r.series("comm_time_s")
        share = [100 * c / times[x] for x, c in zip(xs, comm) if x in times]
        bottom.plot([x for x in xs if x in times], share, color=colors[r.index], **_markers(len(xs)))
    top.set(ylabel="blocked (s)", title=f"Time blocked in communication{scope}")
    bottom.set(ylabel="share of the step (%)")
    _steps_axis(bottom)
    bottom.set_ylim(bottom=0)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    _legend(fig, runs, colors)
    return Figure("communication.png", "Time blocked in communication", "Seconds per step spent waiting in "
                  "collectives (expert-parallel exchanges included), and that time as a share of the step.", _png(fig))


def _memory(runs, colors, scope) -> Figure | None:
    recorded = [(r, *r.memory()) for r in runs]
    recorded = [m for m in recorded if m[1]]
    if not recorded:
        return None
    by_rank = any(m[3] for m in recorded)
    fig = _figure(11, 4.2)
    axes = fig.subplots(1, 2, width_ratios=(3, 2)) if by_rank else [fig.subplots()]
    for r, steps, per_rank, _ in recorded:
        axes[0].plot(steps, [max(p) / GIB for p in per_rank], color=colors[r.index], **_markers(len(steps)))
    _steps_axis(axes[0])
    axes[0].set(ylabel="peak memory (GiB)",
                title=(f"Peak memory, busiest rank{scope}" if by_rank else f"Peak memory{scope} (rank 0: the logs record no other)"))
    if by_rank:
        for r, steps, per_rank, _ in recorded:
            peaks = np.zeros(max(len(p) for p in per_rank))
            for p in per_rank:
                peaks[:len(p)] = np.maximum(peaks[:len(p)], p)
            axes[1].plot(range(len(peaks)), peaks / GIB, color=colors[r.index], marker="o", markersize=4)
        axes[1].set(xlabel="rank", ylabel="peak memory over the run (GiB)", title="Peak memory per rank")
        axes[1].xaxis.get_major_locator().set_params(integer=True)
    for ax in axes:
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    _legend(fig, [m[0] for m in recorded], colors)
    return Figure("memory.png", "Peak memory", "Peak allocated memory per step" + (
        " on the busiest rank, and each rank's peak over the run." if by_rank else "."), _png(fig))


def _every_run(runs, curves) -> Figure | None:
    """When the overlays show only some runs: every run's median tokens/s, one row per model and size."""
    if len(curves) == len(runs):
        return None
    measured = [r for r in runs if r.median("tokens_per_s")]
    rows = sorted({r.label.split(" · ")[0].split(" ", 1)[1] for r in measured})
    eps = sorted({r.ep for r in measured})
    fig = _figure(11, 1.5 + 0.35 * len(rows))
    ax = fig.subplots()
    shown = {r.index for r in curves}
    for k, ep in enumerate(eps):
        group = [r for r in measured if r.ep == ep]
        ys = [rows.index(r.label.split(" · ")[0].split(" ", 1)[1]) + 0.25 * ((r.index % 5) / 4 - 0.5) for r in group]
        ax.scatter([r.median("tokens_per_s") for r in group], ys, s=18, color=_color(k), label=f"ep {ep}",
                   edgecolors=["k" if r.index in shown else "none" for r in group])
        for r, y in zip(group, ys):
            if r.index in shown:
                ax.annotate(r.name, (r.median("tokens_per_s"), y), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ax.invert_yaxis()  # models in reading order, top down
    ax.set_xscale("log")
    _plain_log_labels(ax.xaxis)
    ax.set(xlabel="median tokens / s (log scale)", title=f"Median throughput of every run ({len(runs)} runs)")
    ax.grid(alpha=0.3, axis="x", which="both")
    ax.legend(title="expert parallel", fontsize=8, loc="best")
    return Figure("all-runs.png", "Median throughput of every run", "One point per run, rows by model and size, "
                  "colour by expert-parallel degree; the runs the other figures overlay are ringed and named.", _png(fig))


def _worst_per_step(r: RunData) -> tuple[list[int], list[float]]:
    """Per step: the busiest EP rank over the mean in the run's most imbalanced layer at that step."""
    worst: dict[int, float] = {}
    for layer in r.layers:
        for step, value in zip(layer.steps, layer.imbalance()):
            if value is not None:
                worst[step] = max(worst.get(step, 0.0), value)
    steps = sorted(worst)
    return steps, [worst[s] for s in steps]


def _ep_imbalance(runs) -> Figure | None:
    candidates = [r for r in runs if r.ep > 1 and _worst_per_step(r)[0]]
    if not candidates:
        return None
    chosen = sorted(sorted(candidates, key=lambda r: (-(r.worst_imbalance() or 1.0), r.index))[:MAX_CURVES],
                    key=lambda r: r.index)
    colors = {r.index: _color(i) for i, r in enumerate(chosen)}
    fig = _figure(11, 4.2)
    ax = fig.subplots()
    for r in chosen:
        xs, ys = _worst_per_step(r)
        ax.plot(xs, ys, color=colors[r.index], **_markers(len(xs)))
    ax.axhline(1, color="gray", linewidth=0.8, linestyle=":")
    _steps_axis(ax)
    ax.set(ylabel="busiest EP rank / mean (tokens)",
           title="Expert-parallel load imbalance, worst MoE layer of each step")
    ax.set_ylim(bottom=0.95)
    ax.grid(alpha=0.3)
    _legend(fig, chosen, colors)
    more = f" ({len(chosen)} most imbalanced of {len(candidates)} runs with ep > 1)" if len(chosen) < len(candidates) else ""
    return Figure("ep-imbalance.png", "Expert-parallel load imbalance", "Tokens computed by the busiest "
                  f"expert-parallel rank over the mean rank, in the worst MoE layer of each step{more}; 1 is perfect "
                  "balance, and the slowest rank sets the step time.", _png(fig))


def _ratio_norm():
    from matplotlib.colors import LogNorm

    return LogNorm(vmin=1 / RATIO_RANGE, vmax=RATIO_RANGE)


def _ratio_cmap():
    import matplotlib

    return matplotlib.colormaps["RdBu_r"].with_extremes(bad="#dddddd")


def _columns(layer: ExpertLayer) -> tuple[np.ndarray, float, float]:
    """experts x columns of tokens / uniform share, steps summed into at most MAX_COLUMNS columns; x extent."""
    groups = np.array_split(np.arange(len(layer.steps)), min(len(layer.steps), MAX_COLUMNS))
    counts = np.stack([layer.counts[g].sum(axis=0) for g in groups])
    totals = counts.sum(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(totals > 0, counts * layer.experts / totals, np.nan)
    # zero tokens would be off a log scale: show them as the coldest colour
    ratio = np.where(np.isnan(ratio), np.nan, np.clip(ratio, 1 / RATIO_RANGE, RATIO_RANGE))
    return ratio.T, layer.steps[0] - 0.5, layer.steps[-1] + 0.5


def _changes(ax, layer: ExpertLayer) -> bool:
    for step in layer.changes():
        ax.axvline(step - 0.5, color="k", linestyle="--", linewidth=1)
    return bool(layer.changes())


def _ratio_colorbar(fig, image, axes) -> None:
    bar = fig.colorbar(image, ax=axes, shrink=0.9)
    ticks = [2.0**k for k in range(-3, 4)]
    bar.set_ticks(ticks, labels=[f"1/{round(1 / t)}" if t < 1 else f"{t:g}" for t in ticks])
    bar.minorticks_off()
    bar.set_label("tokens / uniform share (log scale)")


def _heat_maps(r: RunData) -> list[Figure]:
    out = []
    chunks = [r.layers[i:i + LAYERS_PER_FIGURE] for i in range(0, len(r.layers), LAYERS_PER_FIGURE)]
    for k, chunk in enumerate(chunks):
        row = float(np.clip(chunk[0].experts * 0.12, 1.5, 3.5))
        fig = _figure(11, 0.8 + row * len(chunk))
        axes = fig.subplots(len(chunk), 1, sharex=True, squeeze=False)[:, 0]
        changed = False
        for ax, layer in zip(axes, chunk):
            ratio, left, right = _columns(layer)
            image = ax.imshow(ratio, aspect="auto", origin="lower", interpolation="nearest", norm=_ratio_norm(),
                              cmap=_ratio_cmap(), extent=(left, right, -0.5, layer.experts - 0.5))
            changed |= _changes(ax, layer)
            ax.set_ylabel(f"layer {layer.index}\nexpert")
            if layer.experts <= 16:
                ax.set_yticks(range(layer.experts))
        _steps_axis(axes[-1])
        _ratio_colorbar(fig, image, list(axes))
        span = f"MoE layers {chunk[0].index}-{chunk[-1].index}" if len(chunk) > 1 else f"MoE layer {chunk[0].index}"
        fig.suptitle(f"{r.label}: tokens per expert, {span}", fontsize=11)
        suffix = f"-{k + 1:0{len(str(len(chunks)))}d}" if len(chunks) > 1 else ""  # zero-padded: sorts in order
        out.append(Figure(f"{r.name}-tokens-per-expert{suffix}.png", f"{r.name}: tokens per expert, {span}",
                          "Each expert's tokens over its uniform share of the layer, per step: red hot, blue cold, "
                          "white even" + ("; dashed lines where the placement changed." if changed else "."),
                          _png(fig), r.name))
    return out


def _ep_load(r: RunData) -> Figure | None:
    if r.ep == 1:
        return None
    known = [(layer, layer.imbalance()) for layer in r.layers]
    known = [(layer, values) for layer, values in known if any(v is not None for v in values)]
    if not known:
        return None
    fig = _figure(11, 4.2)
    left, right = fig.subplots(1, 2)
    if len(known) <= 6:
        for i, (layer, values) in enumerate(known):
            left.plot(layer.steps, [np.nan if v is None else v for v in values], color=_color(i),
                      label=f"layer {layer.index}", **_markers(len(values)))
    else:
        grid = np.array([[np.nan if v is None else v for v in values] for _, values in known])
        left.fill_between(known[0][0].steps, np.nanmin(grid, axis=0), np.nanmax(grid, axis=0), alpha=0.3,
                          label="range over layers")
        left.plot(known[0][0].steps, np.nanmedian(grid, axis=0), label="median layer")
    worst_layer = max(known, key=lambda lv: np.nanmean([np.nan if v is None else v for v in lv[1]]))[0]
    loads = worst_layer.rank_loads()
    for rank in range(r.ep):
        xs = [s for s, load in zip(worst_layer.steps, loads) if load is not None and len(load) > rank]
        ys = [load[rank] / load.mean() if load.mean() > 0 else 1.0 for load in loads
              if load is not None and len(load) > rank]
        right.plot(xs, ys, linewidth=1, label=f"rank {rank}" if r.ep <= 8 else None, **_markers(len(xs)))
    for ax, layers in ((left, [layer for layer, _ in known]), (right, [worst_layer])):
        for step in sorted({s for layer in layers for s in layer.changes()}):
            ax.axvline(step - 0.5, color="k", linestyle="--", linewidth=1)
        ax.axhline(1, color="gray", linewidth=0.8, linestyle=":")
        ax.grid(alpha=0.3)
        _steps_axis(ax)
    left.set(ylabel="busiest EP rank / mean", title="Busiest expert-parallel rank over the mean, per layer")
    left.set_ylim(bottom=0.95)
    right.set(ylabel="rank's tokens / mean", title=f"Each EP rank in layer {worst_layer.index} (the most imbalanced)")
    right.set_ylim(bottom=0)
    left.legend(fontsize=8, loc="best")
    if r.ep <= 8:
        right.legend(fontsize=8, loc="best", ncols=2)
    fig.suptitle(f"{r.label}: load per expert-parallel rank", fontsize=11)
    moved = "; dashed lines where the placement changed" if any(layer.changes() for layer in r.layers) else ""
    return Figure(f"{r.name}-ep-load.png", f"{r.name}: load per expert-parallel rank",
                  f"Tokens each of the {r.ep} EP ranks computes (an expert's tokens split over its copies), over the "
                  f"mean rank{moved}.", _png(fig), r.name)


def _hot_cold(r: RunData) -> Figure:
    layers = r.layers
    small = len(layers) <= 6 and max(layer.experts for layer in layers) <= 64
    hot, cold = layers[0].hot_factor, layers[0].cold_factor
    fig = _hot_cold_bars(layers) if small else _hot_cold_map(layers)
    fig.suptitle(f"{r.label}: experts that stayed hot or cold", fontsize=11)
    return Figure(f"{r.name}-hot-cold.png", f"{r.name}: experts that stayed hot or cold",
                  f"Each expert's share of its layer's tokens over the run, in uniform shares; hot (red) when above "
                  f"{hot:g}x in most steps, cold (blue) when below {cold:g}x (the percentage: of the steps).", _png(fig), r.name)


def _hot_cold_bars(layers: list[ExpertLayer]):
    fig = _figure(11, 0.8 + 1.9 * len(layers))
    axes = fig.subplots(len(layers), 1, squeeze=False)[:, 0]
    for ax, layer in zip(axes, layers):
        hot, cold = {f.expert: f for f in layer.hot()}, {f.expert: f for f in layer.cold()}
        colors = ["#c0392b" if e in hot else "#2e6fb7" if e in cold else "#999999" for e in range(layer.experts)]
        share = layer.share()
        ax.bar(range(layer.experts), share, color=colors)
        ax.axhline(1, color="k", linewidth=0.8, label="uniform share")
        ax.axhline(layer.hot_factor, color="#c0392b", linewidth=0.8, linestyle="--",
                   label=f"hot: above {layer.hot_factor:g}x in most steps")
        ax.axhline(layer.cold_factor, color="#2e6fb7", linewidth=0.8, linestyle="--",
                   label=f"cold: below {layer.cold_factor:g}x in most steps")
        if layer.experts <= 32:  # the bar is the run's share, the flag is per step: say how many steps it held
            for e, f in (hot | cold).items():
                ax.annotate(f"{f.steps:.0%}", (e, share[e]), xytext=(0, 2), textcoords="offset points",
                            ha="center", va="bottom", fontsize=7)
        ax.set_ylim(0, max(share.max(), layer.hot_factor) * 1.15)
        ax.set_ylabel(f"layer {layer.index}\nshare / uniform")
        ax.set_xticks(range(layer.experts), [str(e) for e in range(layer.experts)],
                      fontsize=8 if layer.experts <= 32 else 6)
        ax.grid(alpha=0.3, axis="y")
    axes[-1].set_xlabel("expert")
    axes[0].legend(fontsize=7, loc="upper left", ncols=3)
    return fig


def _hot_cold_map(layers: list[ExpertLayer]):
    """Many experts: a layers x experts map of each expert's share, and beside it how many experts of each layer
    stayed hot or cold (markers on the cells only while they are large enough to carry one)."""
    widest = max(layer.experts for layer in layers)
    grid = np.full((len(layers), widest), np.nan)
    for i, layer in enumerate(layers):
        grid[i, :layer.experts] = np.clip(layer.share(), 1 / RATIO_RANGE, RATIO_RANGE)
    fig = _figure(11, float(np.clip(1.2 + 0.25 * len(layers), 3, 12)))
    ax, counts = fig.subplots(1, 2, sharey=True, width_ratios=(5, 1))
    image = ax.imshow(grid, aspect="auto", origin="lower", interpolation="nearest", norm=_ratio_norm(),
                      cmap=_ratio_cmap(), extent=(-0.5, widest - 0.5, -0.5, len(layers) - 0.5))
    if len(layers) * widest <= 512:
        for marker, pick, label in (("^", ExpertLayer.hot, "stayed hot"), ("v", ExpertLayer.cold, "stayed cold")):
            points = [(f.expert, i) for i, layer in enumerate(layers) for f in pick(layer)]
            if points:
                ax.scatter(*zip(*points), marker=marker, s=14, color="k", label=label)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper right")
    ax.set(xlabel="expert", ylabel="MoE layer")
    rows = np.arange(len(layers))
    counts.barh(rows, [len(layer.hot()) for layer in layers], color="#c0392b")
    counts.barh(rows, [-len(layer.cold()) for layer in layers], color="#2e6fb7")
    counts.axvline(0, color="k", linewidth=0.8)
    counts.xaxis.set_major_formatter(lambda x, _: f"{abs(x):g}")  # cold counts drawn leftwards, read positive
    counts.set(xlabel="experts: cold | hot", title="stayed cold | hot")
    counts.grid(alpha=0.3, axis="x")
    _ratio_colorbar(fig, image, [ax, counts])
    return fig
