"""Matplotlib figures of a run, returned as SVG text (no pyplot: no global backend state is touched).

Every number plotted comes from files the host wrote: ``track.json``'s ``benchmark`` (confirmation medians,
speedup and its bootstrap interval, roofline floor) and the raw paired samples in the gate's reports.
"""

from __future__ import annotations

import io
import math
import random

from tilesmith.cli.rundata import Evaluation, TrackData, number

BASELINE = "#8c8c8c"
INCUMBENT = "#8ab6d6"
ACCEPTED = "#2a9d8f"
REJECTED = "#e76f51"
FLOOR = "#264653"
MAX_EVALS_PER_FIGURE = 24


def _svg(fig) -> str:
    import matplotlib

    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "tilesmith"}):
        fig.savefig(buffer, format="svg", bbox_inches="tight")
    return buffer.getvalue()


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    return fig


def speedup_figure(tracks: list[TrackData], min_improvement: float | None) -> str:
    """Horizontal bars: speedup over Inductor per graph with its 95 % interval; graphs that kept Inductor
    are drawn at 1.0 in grey."""
    fig = _figure(9, 0.55 * len(tracks) + 1.4)
    ax = fig.add_subplot(1, 1, 1)
    labels, values, colors, lows, highs = [], [], [], [], []
    for t in tracks:
        labels.append(t.label)
        value = t.speedup if t.installed and t.speedup else 1.0
        values.append(value)
        colors.append(ACCEPTED if t.installed else BASELINE)
        ci = (t.benchmark or {}).get("speedup_ci") or [None, None]
        lo, hi = number(ci[0]) if len(ci) == 2 else None, number(ci[1]) if len(ci) == 2 else None
        lows.append(max(0.0, value - lo) if t.installed and lo is not None else 0.0)
        highs.append(max(0.0, hi - value) if t.installed and hi is not None else 0.0)
    y = list(range(len(tracks)))
    ax.barh(y, values, color=colors, xerr=[lows, highs], capsize=4, height=0.6)
    ax.set_yticks(y, labels)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=1)
    if min_improvement:
        ax.axvline(1.0 + min_improvement, color="black", linewidth=1, linestyle="--",
                   label=f"gate threshold (+{100 * min_improvement:g} %)")
        ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    for yi, t, v, hi in zip(y, tracks, values, highs):
        text = f"{v:.2f}x" if t.installed else "kept Inductor"
        x = v + hi if t.installed else 1.0 + (min_improvement or 0.0)
        ax.text(x, yi, "  " + text, va="center", fontsize=9)
    ax.set_xlabel("speedup over Inductor (median of paired ratios, 95 % bootstrap interval)")
    ax.set_xlim(0, max([v + h for v, h in zip(values, highs)] + [1.0 + (min_improvement or 0)]) * 1.3)
    return _svg(fig)


def roofline_figure(tracks: list[TrackData]) -> str | None:
    """Per graph with a recorded floor: floor, Tilesmith and Inductor time on a log axis. ``None`` if no
    graph has a floor."""
    rows = []
    for t in tracks:
        b = t.benchmark or {}
        floor = number(b.get("roofline_floor_ms"))
        if floor and floor > 0:
            rows.append((t.label, floor, number(b.get("tilesmith_ms")), number(b.get("torch_inductor_ms"))))
    if not rows:
        return None
    fig = _figure(9, 0.9 * len(rows) + 1.4)
    ax = fig.add_subplot(1, 1, 1)
    height = 0.25
    for i, (label, floor, tile, ind) in enumerate(rows):
        for offset, value, color, name in ((-height, floor, FLOOR, "roofline floor"),
                                           (0.0, tile, ACCEPTED, "Tilesmith"),
                                           (height, ind, BASELINE, "Inductor")):
            if value:
                ax.barh(i + offset, value, height=height, color=color, label=name if i == 0 else None)
        if tile:
            ax.text(tile, i, f"  {tile / floor:.1f}x the floor", va="center", fontsize=9)
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.invert_yaxis()
    ax.set_xscale("log")
    values = [v for r in rows for v in r[1:] if v]
    ax.set_xlim(min(values) / 1.6, max(values) * 2.2)
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_minor_locator(LogLocator(base=10, subs="auto"))
    formatter = ScalarFormatter()
    formatter.set_scientific(False)
    ax.xaxis.set_major_formatter(formatter)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("ms per call (log scale)")
    ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=3, fontsize=8, frameon=False)
    return _svg(fig)


def timing_figure(track: TrackData, evaluations: list[Evaluation]) -> str | None:
    """A grid of panels, one per evaluation with timing samples: the raw per-sample times of Inductor, the
    incumbent (the candidate to beat in later loops) and the candidate, for the first measurement and the
    confirmation. ``None`` when no evaluation has samples."""
    from matplotlib.patches import Patch

    timed = [e for e in evaluations if e.timings][-MAX_EVALS_PER_FIGURE:]
    if not timed:
        return None
    cols = min(3, len(timed))
    rows = math.ceil(len(timed) / cols)
    fig = _figure(3.6 * cols, 2.8 * rows + 0.8)
    rng = random.Random(0)  # jitter only; deterministic output
    for index, e in enumerate(timed):
        ax = fig.add_subplot(rows, cols, index + 1)
        data, colors, groups = [], [], []
        candidate_color = ACCEPTED if e.accepted else REJECTED
        for block in e.timings:
            first = len(data) + 1
            if block.original_ms:
                data.append(block.original_ms)
                colors.append(BASELINE)
            data.append(block.baseline_ms)
            colors.append(INCUMBENT if block.baseline_label == "incumbent" else BASELINE)
            data.append(block.candidate_ms)
            colors.append(candidate_color)
            groups.append(((first + len(data)) / 2, "measurement" if block.label == "measurement" else "confirmation"))
            data.append(None)  # a gap between the measurement and the confirmation
            colors.append(None)
        positions = [i + 1 for i, d in enumerate(data) if d is not None]
        colors = [c for c in colors if c is not None]
        data = [d for d in data if d is not None]
        box = ax.boxplot(data, positions=positions, widths=0.6, patch_artist=True, showfliers=False)
        for patch, color in zip(box["boxes"], colors):
            patch.set_facecolor(color)
            patch.set_alpha(0.55)
        for pos, samples, color in zip(positions, data, colors):
            xs = [pos + rng.uniform(-0.18, 0.18) for _ in samples]
            ax.scatter(xs, samples, s=6, color=color, edgecolors="none", zorder=3)
        ax.set_xticks([g[0] for g in groups], [g[1] for g in groups], fontsize=7)
        ax.tick_params(axis="y", labelsize=7)
        ax.set_ylabel("ms per call", fontsize=8)
        result = f"{e.speedup:.2f}x" if e.speedup is not None else ""
        ax.set_title(f"{e.id} {e.proposer}\n{e.status} {result}", fontsize=8,
                     color=ACCEPTED if e.accepted else "black")
    handles = [Patch(color=BASELINE, alpha=0.7, label="Inductor"),
               Patch(color=INCUMBENT, alpha=0.7, label="incumbent (earlier accepted candidate)"),
               Patch(color=ACCEPTED, alpha=0.7, label="candidate, accepted"),
               Patch(color=REJECTED, alpha=0.7, label="candidate, rejected")]
    fig.legend(handles=handles, loc="upper center", ncol=4, fontsize=7, frameon=False, bbox_to_anchor=(0.5, 1.0))
    fig.suptitle(f"Paired timing samples, {track.label}", fontsize=10, y=1.06)
    fig.tight_layout()
    return _svg(fig)
