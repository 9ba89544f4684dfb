"""``tilesmith show`` and ``tilesmith report`` show every diagnostic kind a run recorded (a failed artifact-cache
re-check included) and name every gate report of a graph, also those no evaluation of ``track.json`` names.

The re-check run is written with the pipeline's own writers in the shape :mod:`tilesmith.optimize` gave it
before the re-check was also recorded in ``track.json``: the ``cache_recheck_failed`` diagnostic only in
``run.json`` (with the graph's key) and the re-check's gate report only on disk. The last test drives
:func:`tilesmith.install.installer.install_hit` with a gate whose re-check fails and checks what it records now.
"""

from __future__ import annotations

import html
import io
import json
import random
import re
from dataclasses import asdict
from pathlib import Path

import pytest
from test_cli_runfolder import RUN_NEW, build_root, evaluate, graph, key_of, timing

from tilesmith.cli.main import main
from tilesmith.records import Diagnostic, Verdict
from tilesmith.track.run import RunFolder, Track

RUN = "20261201T101500Z-0badcafe"


def recheck_failed_run(root: Path) -> Track:
    rng = random.Random(3)
    run = RunFolder(root, RUN, {"created_utc": "2026-12-01T10:15:00Z", "agent_model": "tilesmith/builtin",
                                "agency": "medium", "loops": 1, "max_model_calls": None})
    run.open()
    track = Track(run, graph("mlp_fp32_infer__00", "0_inference", "inference"), key_of("rechecked"), loops=1)
    track.create()
    # The re-check's gate report, as the gate writes it (profiles/<eval-id>.json and .txt), named by no evaluation.
    verdict = Verdict(False, "rejected_slower", ("candidate 4.0 % slower than Inductor on this run's inputs",),
                      timing=timing(rng, 0.090, 0.094), evaluation_id="e0001",
                      report_path=str(track.profiles / "e0001.json"))
    (track.profiles / "e0001.json").write_text(json.dumps({"format": 1, "evaluation_id": "e0001",
                                                           "kind": "recheck", "verdict": asdict(verdict)}))
    (track.profiles / "e0001.txt").write_text("e0001 cache: rejected_slower\n")
    run.add_diagnostic(Diagnostic("cache_recheck_failed", f"graph {track.label}: the cached artifact failed its "
                                  f"re-check on this run's inputs ({verdict.summary()}); optimizing as usual.",
                                  track.key, "0_inference"))
    evaluate(track, "e0002", 1, "builtin:cudagraph", Verdict(False, "rejected_marginal", ("speedup 1.004",),
                                                            timing=timing(rng, 0.090, 0.089)))
    kept = Diagnostic("no_improvement", f"graph {track.label}: no candidate passed the gate.", track.key,
                      "0_inference")
    run.add_diagnostic(kept)
    track.add_diagnostic(kept)
    track.update(status="kept_inductor")
    return track


def cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out=out), out.getvalue()


def run_kinds(root: Path, run_id: str) -> set[str]:
    return {d["kind"] for d in json.loads((root / "runs" / run_id / "run.json").read_text())["diagnostics"]}


def test_show_lists_a_failed_recheck_and_its_gate_report(tmp_path):
    track = recheck_failed_run(tmp_path)
    code, text = cli("--root", str(tmp_path), "show", RUN)
    assert code == 0 and "[cache_recheck_failed] (0_inference)" in text and "[no_improvement]" in text
    assert "1 other gate report(s)" in text
    code, text = cli("--root", str(tmp_path), "show", track.key[:12])
    assert code == 0 and "[cache_recheck_failed]" in text
    assert str(track.profiles / "e0001.json") in text and str(track.profiles / "e0002.json") in text
    code, text = cli("--root", str(tmp_path), "show", track.key[:12], "--json")
    (doc,) = json.loads(text)["tracks"]
    assert [d["kind"] for d in doc["diagnostics"]] == ["no_improvement", "cache_recheck_failed"]
    assert doc["gate_reports"] == [str(track.profiles / "e0001.json"), str(track.profiles / "e0002.json")]


@pytest.mark.parametrize("which", ["recheck", "demo"])
def test_show_and_report_show_every_diagnostic_kind_of_the_run(tmp_path, which):
    run_id = RUN if which == "recheck" else RUN_NEW
    recheck_failed_run(tmp_path) if which == "recheck" else build_root(tmp_path)
    kinds = run_kinds(tmp_path, run_id)
    assert kinds and ("cache_recheck_failed" in kinds or which == "demo")
    code, shown = cli("--root", str(tmp_path), "show", run_id)
    assert code == 0 and all(f"[{k}]" in shown for k in kinds), (kinds, shown)
    code, _ = cli("--root", str(tmp_path), "report", run_id)
    page = (tmp_path / "runs" / run_id / "report.html").read_text()
    assert code == 0 and all(f"<code>{k}</code>" in page for k in kinds)


def test_report_links_every_gate_report_of_each_graph(tmp_path):
    track = recheck_failed_run(tmp_path)
    ids = build_root(tmp_path)
    for run_id, out in ((RUN, None), (RUN_NEW, tmp_path / "elsewhere" / "r.html")):
        argv = ["--root", str(tmp_path), "report", run_id] + (["-o", str(out)] if out else [])
        code, _ = cli(*argv)
        page_path = out or tmp_path / "runs" / run_id / "report.html"
        page = page_path.read_text()
        hrefs = [html.unescape(h) for h in re.findall(r'<a class=gate-report href="([^"]+)"', page)]
        targets = {(page_path.parent / h).resolve() for h in hrefs}
        tracks = [track] if run_id == RUN else [tmp_path / "runs" / RUN_NEW / ids[k] for k in ("installed", "kept")]
        expected = {p.resolve() for t in tracks
                    for p in ((t.profiles if isinstance(t, Track) else t / "profiles").glob("*.json"))}
        assert code == 0 and expected and targets == expected


def test_a_failed_recheck_is_recorded_in_the_track(tmp_path, monkeypatch):
    from tilesmith.install import installer

    run = RunFolder(tmp_path, RUN, {})
    run.open()
    track = Track(run, graph("mlp_fp32_infer__00", "0_inference", "inference"), key_of("x"), loops=1)
    track.create()
    verdict = Verdict(False, "rejected_slower", ("slower here",), evaluation_id="e0001",
                      report_path=str(track.profiles / "e0001.json"))

    class Gate:
        def recheck(self, candidate):
            assert candidate.proposer == "cache"
            return verdict

    class Live:  # the parts of tilesmith.pipeline.LiveRun that install_hit uses
        def diagnose(self, kind, message, key=None, name=None):
            d = Diagnostic(kind, message, key, name)
            run.add_diagnostic(d)
            return d

    class Artifact:
        source = "def call(args):\n    return args\n"

    handle = type("Handle", (), {"graph": track.graph})()
    assert installer.install_hit(Live(), handle, track, Gate(), (None, Artifact())) is False
    doc = json.loads((track.folder / "track.json").read_text())
    assert [(e["id"], e["proposer"], e["status"], e["report"]) for e in doc["evaluations"]] == [
        ("e0001", "cache", "rejected_slower", "profiles/e0001.json")]
    assert [d["kind"] for d in doc["diagnostics"]] == ["cache_recheck_failed"]
    assert doc["loops_accepted"] == 0
