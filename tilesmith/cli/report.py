"""``tilesmith report <run>``: one self-contained HTML file describing a run, with plots.

Contents: run metadata and diagnostics; a table of graphs (status, Inductor and Tilesmith ms, speedup with
its 95 % interval, roofline floor and distance to it); plots — speedup per graph, distance to the roofline
floor, and per track the raw paired timing samples of every evaluation (baseline vs candidate, first
measurement and confirmation); every evaluation's verdict and reasons; per graph, every diagnostic about it
(of any kind, from ``track.json`` and ``run.json``) and a link to each of its gate reports on disk.

Plots are matplotlib SVG embedded as ``data:`` URIs, styles are inline, and nothing is fetched from the
network, so the file can be mailed or attached to an issue as is. A tiny inline script records on
``<body>`` how many plots the browser decoded (``data-plots-loaded`` / ``data-plots-total``); the test
suite reads it back from headless Chromium.

All text from the run folder is HTML-escaped and passed through :func:`tilesmith.secrets.redact`.
"""

from __future__ import annotations

import base64
import html
import os
from datetime import datetime, timezone
from pathlib import Path

from tilesmith.cli import _format as fmt
from tilesmith.cli.rundata import RunData, TrackData, number
from tilesmith.secrets import redact

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:2rem auto;max-width:1100px;
 color:#1d1d1d;padding:0 1rem;line-height:1.4}
h1{font-size:1.5rem;margin-bottom:.2rem} h2{font-size:1.2rem;margin-top:2rem;border-bottom:1px solid #ddd}
h3{font-size:1rem;margin-top:1.4rem} code{font-size:.9em}
table{border-collapse:collapse;margin:.6rem 0;font-size:.88rem;width:100%}
th,td{border-bottom:1px solid #e6e6e6;padding:.3rem .5rem;text-align:left;vertical-align:top}
th{background:#f6f6f6} td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.meta{color:#555;font-size:.9rem} .ok{color:#1f7a6f;font-weight:600} .bad{color:#b4462b;font-weight:600}
.muted{color:#777} figure{margin:1rem 0} img.plot{max-width:100%;height:auto;border:1px solid #eee}
figcaption{font-size:.85rem;color:#555} ul.diag li{margin:.2rem 0} .reason{font-size:.85rem;color:#444}
"""

_SCRIPT = """
window.addEventListener('load', function () {
  var plots = Array.prototype.slice.call(document.querySelectorAll('img.plot'));
  var loaded = plots.filter(function (img) { return img.complete && img.naturalWidth > 0; });
  document.body.setAttribute('data-plots-total', String(plots.length));
  document.body.setAttribute('data-plots-loaded', String(loaded.length));
});
"""


def _e(value: object) -> str:
    return html.escape(redact(str(value)), quote=True)


def _img(svg: str, alt: str, caption: str, plot_id: str) -> str:
    data = base64.b64encode(svg.encode("utf-8")).decode("ascii")
    return (f'<figure><img class="plot" id="{_e(plot_id)}" alt="{_e(alt)}" src="data:image/svg+xml;base64,{data}">'
            f"<figcaption>{_e(caption)}</figcaption></figure>")


def _status(t: TrackData) -> str:
    cls = "ok" if t.installed else "bad" if t.status == "kept_inductor" else "muted"
    return f'<span class="{cls}">{_e(t.status)}</span>'


def _graph_table(tracks: list[TrackData]) -> str:
    rows = []
    for t in tracks:
        b = t.benchmark or {}
        floor, tile = number(b.get("roofline_floor_ms")), number(b.get("tilesmith_ms"))
        distance = f"{tile / floor:.1f}x" if floor and tile else "-"
        d = t.doc
        rows.append(
            f"<tr><td><code>{_e(t.key[:12])}</code></td><td>{_e(t.name)}</td><td>{_e(d.get('kind', '-'))}</td>"
            f"<td>{_status(t)}</td><td class=num>{_e(d.get('loops_accepted', '-'))}/{_e(d.get('loops_requested', '-'))}</td>"
            f"<td class=num>{len(t.evaluations())}</td>"
            f"<td class=num>{_e(fmt.ms(number(b.get('torch_inductor_ms'))))}</td><td class=num>{_e(fmt.ms(tile))}</td>"
            f"<td class=num>{_e(fmt.speedup(number(b.get('speedup')), b.get('speedup_ci')))}</td>"
            f"<td class=num>{_e(fmt.ms(floor))}</td><td class=num>{_e(distance)}</td><td>{_e(b.get('source', '-'))}</td></tr>")
    head = ("<tr><th>key</th><th>graph</th><th>kind</th><th>status</th><th>loops</th><th>evals</th>"
            "<th>Inductor ms</th><th>Tilesmith ms</th><th>speedup [95 %]</th><th>floor ms</th>"
            "<th>vs floor</th><th>source</th></tr>")
    return f"<table id=graphs>{head}{''.join(rows)}</table>"


def _evaluation_table(t: TrackData) -> str:
    evals = t.evaluations()
    if not evals:
        return '<p class="muted">no evaluations recorded for this graph.</p>'
    rows = []
    for e in evals:
        reasons = "".join(f'<div class="reason">{_e(r)}</div>' for r in e.reasons) or '<span class="muted">-</span>'
        cls = "ok" if e.accepted else "bad"
        rows.append(f"<tr><td>{_e(e.id)}</td><td class=num>{_e('-' if e.attempt is None else e.attempt)}</td>"
                    f"<td>{_e(e.proposer or '-')}</td><td><span class={cls}>{_e(e.status)}</span></td>"
                    f"<td class=num>{_e(fmt.speedup(e.speedup))}</td><td class=num>{_e(fmt.speedup(e.confirmation_speedup))}</td>"
                    f"<td>{reasons}</td></tr>")
    head = ("<tr><th>eval</th><th>attempt</th><th>proposer</th><th>verdict</th><th>speedup</th>"
            "<th>confirmed</th><th>reasons</th></tr>")
    return f"<table class=evals>{head}{''.join(rows)}</table>"


def _diagnostics(items: list[dict]) -> str:
    if not items:
        return '<p class="muted">none.</p>'
    lis = []
    for d in items:
        where = f" ({_e(d['graph_name'])})" if d.get("graph_name") else ""
        lis.append(f"<li><code>{_e(d.get('kind', '?'))}</code>{where}: {_e(d.get('message', ''))}</li>")
    return f"<ul class=diag>{''.join(lis)}</ul>"


def _report_links(t: TrackData, base: Path | None) -> str:
    """Links to every gate report of ``t`` (``profiles/*.json`` and the readable ``.txt`` beside it), relative
    to ``base`` (the report's folder) when given."""
    reports = t.gate_reports
    if not reports:
        return ""

    def href(p: Path) -> str:
        if base is None:
            return p.resolve().as_uri()
        return os.path.relpath(p.resolve(), base).replace(os.sep, "/")

    items = []
    for p in reports:
        txt = p.with_suffix(".txt")
        extra = f' (<a href="{_e(href(txt))}">text</a>)' if txt.is_file() else ""
        items.append(f'<li><a class=gate-report href="{_e(href(p))}"><code>{_e(p.name)}</code></a>{extra}</li>')
    return f"<p>Gate reports of this graph:</p><ul class=reports>{''.join(items)}</ul>"


def render(run: RunData, base: Path | None = None) -> str:
    """The report's HTML text for ``run``; links to files are relative to ``base`` (the report's folder)
    when given, else absolute ``file:`` URIs."""
    from tilesmith.cli import plots

    d = run.doc
    tracks = list(run.tracks)
    min_imp = number(d.get("min_improvement"))
    parts = [f"<!doctype html><html lang=en><head><meta charset=utf-8>"
             f"<meta name=viewport content='width=device-width, initial-scale=1'>"
             f"<title>Tilesmith run {_e(run.run_id)}</title><style>{_CSS}</style></head><body>"]
    parts.append(f"<h1>Tilesmith run <code>{_e(run.run_id)}</code></h1>")
    budget = d.get("max_model_calls")
    meta = [f"created {run.created}", f"model {run.model}", f"agency {d.get('agency', '-')}",
            f"loops {d.get('loops', '-')}", f"max_model_calls {'unlimited' if budget is None else budget}"]
    if min_imp is not None:
        meta.append(f"gate threshold {100 * min_imp:g} %")
    meta += [f"{label} {d[k]}" for k, label in (("torch", "torch"), ("triton", "triton"), ("cuda", "CUDA"),
                                                ("device_name", "device")) if d.get(k)]
    parts.append(f"<p class=meta>{' · '.join(_e(m) for m in meta)}</p>")
    installed = len(run.installed)
    best = run.best_speedup
    parts.append(f"<p>{len(tracks)} eligible graph(s), {installed} installed"
                 + (f", best speedup <b>{best:.2f}x</b>" if best else "") + ".</p>")
    for problem in run.problems:
        parts.append(f'<p class="bad">{_e(problem)}</p>')

    parts.append("<h2>Graphs</h2>")
    parts.append(_graph_table(tracks) if tracks else '<p class="muted">no eligible graph was optimized.</p>')
    if tracks:
        parts.append("<h2>Speedup per graph</h2>")
        parts.append(_img(plots.speedup_figure(tracks, min_imp), "speedup per graph",
                          "Median of per-pair Inductor/Tilesmith time ratios from the gate's confirmation, with its "
                          "95 % bootstrap interval. Grey: the graph kept ordinary Inductor.", "plot-speedup"))
        parts.append("<h2>Distance to the roofline floor</h2>")
        roof = plots.roofline_figure(tracks)
        if roof:
            parts.append(_img(roof, "distance to the roofline floor",
                              "Floor = max(bytes moved / measured bandwidth, FLOPs / measured matmul throughput); "
                              "bars show how far each implementation is from it.", "plot-roofline"))
        else:
            parts.append('<p class="muted">no roofline floor recorded (CPU test mode, or no graph installed).</p>')

    parts.append("<h2>Evaluations</h2>")
    for i, t in enumerate(tracks):
        parts.append(f"<h3 id=track-{_e(t.key[:12])}>{_e(t.label)} · {_status(t)}</h3>")
        if t.cache:
            c = t.cache
            parts.append(f"<p>Artifact-cache hit: reused <code>{_e(c.get('artifact_dir', '-'))}</code> "
                         f"(accepted in run {_e(c.get('origin_run_id') or '-')} by {_e(c.get('proposer') or '-')}, "
                         f"content hash <code>{_e(str(c.get('content_hash'))[:16])}</code>).</p>")
        evals = t.evaluations(with_timings=True)
        figure = plots.timing_figure(t, evals)
        if figure:
            parts.append(_img(figure, f"timing samples of {t.label}",
                              "Raw per-sample times (ms per call) of each evaluation, as the gate measured them in "
                              "alternating pairs: Inductor, the incumbent (in later loops, the candidate to beat) "
                              "and the candidate, in the first measurement and in the fresh confirmation.",
                              f"plot-timings-{i}"))
        parts.append(_evaluation_table(t))
        broken = [e for e in evals if e.report_problem]
        for e in broken:
            parts.append(f'<p class="bad">{_e(e.id)}: report unreadable ({_e(e.report_problem)})</p>')
        parts.append(_report_links(t, base))
        graph_diagnostics = run.diagnostics_of(t)
        if graph_diagnostics:
            parts.append(_diagnostics(graph_diagnostics))
    parts.append("<h2>Run diagnostics</h2>")
    parts.append('<p class="muted">Graphs left on Inductor before a track was created, and run-level notes '
                 '(diagnostics of the graphs above are listed with them).</p>')
    parts.append(_diagnostics(run.untracked_diagnostics))
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts.append(f"<p class=meta>Generated by <code>tilesmith report</code> at {_e(now)} from "
                 f"<code>{_e(run.path)}</code>. Every number was measured by the host gate.</p>")
    parts.append(f"<script>{_SCRIPT}</script></body></html>\n")
    return "".join(parts)


def write_report(run: RunData, output: Path) -> Path:
    """Render ``run`` and write it to ``output`` (atomically); return the path.

    Raises:
        ImportError: matplotlib is missing (the report extra: ``pip install '<checkout>[report]'``).
        OSError: ``output`` cannot be written.
    """
    from tilesmith._atomic import write_text_atomic

    output = Path(output)
    text = render(run, base=output.resolve().parent)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(output, text)
    return output
