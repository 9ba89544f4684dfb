"""The command line on a run folder produced by the real pipeline and gate in CPU test mode."""

from __future__ import annotations

import io
import json
import re

import pytest
import torch

import tilesmith
from tilesmith.cli.main import main
from tilesmith.cli.rundata import list_runs


def _gate_available() -> bool:
    try:
        from tilesmith.gate import Gate  # noqa: F401
    except ImportError:
        return False
    return True


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not _gate_available(), reason="the host gate (tilesmith.gate.Gate) has not landed")]


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    from tests.models import MulSum, has_mulsum_loop, mm_instead_of_loop
    from tests.scripted import ScriptedFactory, comment

    root = tmp_path_factory.mktemp("ts")
    mp = pytest.MonkeyPatch()
    mp.setenv("TILESMITH_CACHE_DIR", str(root))
    mp.setenv("TILESMITH_ALLOW_CPU", "1")
    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        model = MulSum().eval()
        x = torch.randn(64, 512)
        factory = ScriptedFactory(edits=[comment("a harmless edit the gate rejects"),
                                         lambda t: mm_instead_of_loop(t) if has_mulsum_loop(t) else t])
        compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=factory, loops=1)
        with torch.no_grad():
            compiled(x)
        records = tilesmith.benchmarks(compiled)
    finally:
        torch._dynamo.reset()
        mp.undo()
    assert len(records) == 1, tilesmith.diagnostics(compiled)
    return root, records[0]


def cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out=out), out.getvalue()


def test_runs_and_show_describe_the_real_run(cpu_run):
    root, record = cpu_run
    (run,) = list_runs(root)
    code, text = cli("--root", str(root), "runs", "--json")
    (summary,) = json.loads(text)
    assert code == 0 and summary["installed"] == 1 and summary["best_speedup"] == pytest.approx(record.speedup)
    code, text = cli("--root", str(root), "show", record.graph_key[:10])
    assert code == 0 and f"graph {record.graph_key[:8]} ({record.graph_name})" in text and "installed" in text
    assert re.search(r"e\d+\s+\d+\s+scripted\s+accepted", text)
    assert "rejected_" in text  # the harmless edit's verdict and its reasons are listed


def test_report_reads_the_gate_reports_of_a_real_run(cpu_run):
    root, record = cpu_run
    (run,) = list_runs(root)
    (track,) = run.tracks
    accepted = [e for e in track.evaluations(with_timings=True) if e.accepted]
    assert accepted and accepted[0].report is not None and accepted[0].report.is_file()
    labels = [t.label for t in accepted[0].timings]
    assert "measurement" in labels and "confirmation" in labels, f"timing blocks not found in {accepted[0].report}"
    assert all(len(t.baseline_ms) == len(t.candidate_ms) > 0 for t in accepted[0].timings)
    code, _ = cli("--root", str(root), "report", "latest")
    assert code == 0
    html = (run.path / "report.html").read_text()
    assert html.count('<img class="plot"') == 2  # speedup and timing panels (no roofline floor on CPU)
    assert "no roofline floor recorded" in html
