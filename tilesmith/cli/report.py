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

The page is the Jinja2 template ``templates/report.html.j2`` beside this module, rendered with autoescape on:
this module only gathers the values. Every value the template prints is passed through
:func:`tilesmith.secrets.redact` first (the environment's ``finalize``), then HTML-escaped; only the plots'
base64 data is inserted as it is.
"""

from __future__ import annotations

import base64
import os
from datetime import datetime, timezone
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from tilesmith.cli import _format as fmt
from tilesmith.cli.rundata import RunData, TrackData, cpu_gate_text, number
from tilesmith.secrets import redact

TEMPLATE = "report.html.j2"
"""The page's template, in this package's ``templates/`` folder (package data)."""


def _finalize(value: object) -> object:
    """Every printed value is redacted before autoescape escapes it; markup the template or this module made
    (macro output, the plots' base64 data) passes as it is."""
    from markupsafe import Markup

    return value if isinstance(value, Markup) else redact(str(value))


@lru_cache(maxsize=1)
def _template() -> Any:
    import jinja2

    env = jinja2.Environment(autoescape=True, finalize=_finalize, undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    text = (resources.files("tilesmith.cli") / "templates" / TEMPLATE).read_text(encoding="utf-8")
    return env.from_string(text)


def _figure(svg: str, alt: str, caption: str, plot_id: str) -> dict[str, Any]:
    from markupsafe import Markup

    data = Markup(base64.b64encode(svg.encode("utf-8")).decode("ascii"))  # base64: nothing to escape or redact
    return {"id": plot_id, "alt": alt, "caption": caption, "data": data}


def _status(t: TrackData) -> dict[str, str]:
    css = "ok" if t.installed else "bad" if t.status == "kept_inductor" else "muted"
    return {"css": css, "text": t.status}


def _graph_row(t: TrackData) -> dict[str, Any]:
    b = t.benchmark or {}
    floor, tile = number(b.get("roofline_floor_ms")), number(b.get("tilesmith_ms"))
    d = t.doc
    return {"key": t.key[:12], "name": t.name, "kind": d.get("kind", "-"), "status": _status(t),
            "loops_accepted": d.get("loops_accepted", "-"), "loops_requested": d.get("loops_requested", "-"),
            "evaluations": len(t.evaluations()), "inductor_ms": fmt.ms(number(b.get("torch_inductor_ms"))),
            "tilesmith_ms": fmt.ms(tile), "speedup": fmt.speedup(number(b.get("speedup")), b.get("speedup_ci")),
            "floor_ms": fmt.ms(floor), "distance": f"{tile / floor:.1f}x" if floor and tile else "-",
            "source": b.get("source", "-")}


def _evaluation_row(e: Any) -> dict[str, Any]:
    return {"id": e.id, "attempt": "-" if e.attempt is None else e.attempt, "proposer": e.proposer or "-",
            "css": "ok" if e.accepted else "bad", "status": e.status, "speedup": fmt.speedup(e.speedup),
            "confirmed": fmt.speedup(e.confirmation_speedup), "reasons": list(e.reasons)}


def _diagnostics(items: list[dict]) -> list[dict[str, Any]]:
    return [{"kind": d.get("kind", "?"), "graph_name": d.get("graph_name"), "message": d.get("message", "")}
            for d in items]


def _report_links(t: TrackData, base: Path | None) -> list[dict[str, Any]]:
    """Links to every gate report of ``t`` (``profiles/*.json`` and the readable ``.txt`` beside it), relative
    to ``base`` (the report's folder) when given."""

    def href(p: Path) -> str:
        if base is None:
            return p.resolve().as_uri()
        return os.path.relpath(p.resolve(), base).replace(os.sep, "/")

    links = []
    for p in t.gate_reports:
        txt = p.with_suffix(".txt")
        links.append({"href": href(p), "name": p.name, "text_href": href(txt) if txt.is_file() else None})
    return links


def _section(i: int, t: TrackData, run: RunData, base: Path | None) -> dict[str, Any]:
    """One graph's part of the "Evaluations" section."""
    from tilesmith.cli import plots

    cache = None
    if t.cache:
        c = t.cache
        cache = {"artifact_dir": c.get("artifact_dir", "-"), "origin_run_id": c.get("origin_run_id") or "-",
                 "proposer": c.get("proposer") or "-", "content_hash": str(c.get("content_hash"))[:16]}
    evals = t.evaluations(with_timings=True)
    svg = plots.timing_figure(t, evals)
    timing = _figure(svg, f"timing samples of {t.label}",
                     "Raw per-sample times (ms per call) of each evaluation, as the gate measured them in "
                     "alternating pairs: Inductor, the incumbent (in later loops, the candidate to beat) "
                     "and the candidate, in the first measurement and in the fresh confirmation.",
                     f"plot-timings-{i}") if svg else None
    return {"key": t.key[:12], "label": t.label, "status": _status(t), "cache": cache, "timing_figure": timing,
            "evaluations": [_evaluation_row(e) for e in t.evaluations()],
            "broken": [{"id": e.id, "problem": e.report_problem} for e in evals if e.report_problem],
            "reports": _report_links(t, base), "diagnostics": _diagnostics(run.diagnostics_of(t))}


def render(run: RunData, base: Path | None = None) -> str:
    """The report's HTML text for ``run``; links to files are relative to ``base`` (the report's folder)
    when given, else absolute ``file:`` URIs."""
    from tilesmith.cli import plots

    d = run.doc
    tracks = list(run.tracks)
    min_imp = number(d.get("min_improvement"))
    budget = d.get("max_model_calls")
    meta = [f"created {run.created}", f"model {run.model}", f"agency {d.get('agency', '-')}",
            f"loops {d.get('loops', '-')}", f"max_model_calls {'unlimited' if budget is None else budget}"]
    if min_imp is not None:
        meta.append(f"gate threshold {100 * min_imp:g} %")
    cpu_bar = cpu_gate_text(d)
    if cpu_bar:
        meta.append(cpu_bar)
        bar = number(d["cpu_gate_bar"]["median_at_least"])
        if tracks and bar is not None and all(t.device.startswith("cpu") for t in tracks):
            min_imp = bar - 1.0  # the line the plot draws: what these graphs had to clear
    meta += [f"{label} {d[k]}" for k, label in (("torch", "torch"), ("triton", "triton"), ("cuda", "CUDA"),
                                                ("device_name", "device")) if d.get(k)]
    best = run.best_speedup
    speedup = roofline = None
    if tracks:
        speedup = _figure(plots.speedup_figure(tracks, min_imp), "speedup per graph",
                          "Median of per-pair Inductor/Tilesmith time ratios from the gate's confirmation, with its "
                          "95 % bootstrap interval. Grey: the graph kept ordinary Inductor.", "plot-speedup")
        roof = plots.roofline_figure(tracks)
        if roof:
            roofline = _figure(roof, "distance to the roofline floor",
                               "Floor = max(bytes moved / measured bandwidth, FLOPs / measured matmul throughput); "
                               "bars show how far each implementation is from it.", "plot-roofline")
    return _template().render(
        run_id=run.run_id, meta=meta, n_tracks=len(tracks), n_installed=len(run.installed),
        best=f"{best:.2f}" if best else None, problems=list(run.problems),
        graphs=[_graph_row(t) for t in tracks], speedup_figure=speedup, roofline_figure=roofline,
        sections=[_section(i, t, run, base) for i, t in enumerate(tracks)],
        run_diagnostics=_diagnostics(run.untracked_diagnostics),
        generated=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), path=run.path)


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
