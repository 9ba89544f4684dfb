"""``tilesmith report``: one self-contained HTML file whose plots a real browser decodes and draws."""

from __future__ import annotations

import base64
import io
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from test_cli_runfolder import RUN_NEW, build_root

from tilesmith.cli.main import main

CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium absent (apt-get install chromium)")
TEAL = (0x2A, 0x9D, 0x8F)  # tilesmith.cli.plots.ACCEPTED


@pytest.fixture
def report(tmp_path):
    ids = build_root(tmp_path)
    out = io.StringIO()
    code = main(["--root", str(tmp_path), "report", RUN_NEW], out=out)
    path = tmp_path / "runs" / RUN_NEW / "report.html"
    assert code == 0 and out.getvalue() == f"wrote {path}\n"
    return path, ids


def plot_images(text: str) -> list[str]:
    return re.findall(r'<img class="plot" id="[^"]+" alt="[^"]*" src="data:image/svg\+xml;base64,([^"]+)">', text)


def test_report_is_one_self_contained_file_with_decodable_svg_plots(report):
    path, _ = report
    text = path.read_text()
    images = plot_images(text)
    # speedup, roofline, and timing panels for the two tracks that have timed evaluations
    assert len(images) == 4
    for data in images:
        root = ET.fromstring(base64.b64decode(data))
        assert root.tag.endswith("svg")
    assert not re.search(r'(src|href)="(https?:)?//', text) and "<link" not in text and "@import" not in text
    assert [p.name for p in path.parent.iterdir() if p.suffix in {".png", ".svg", ".css", ".js"}] == []


def test_report_lists_graphs_verdicts_reasons_and_diagnostics(report):
    path, ids = report
    text = path.read_text()
    for key in (ids["installed"], ids["kept"], ids["cached"]):
        assert f"<code>{key[:12]}</code>" in text
    assert '<span class="ok">installed</span>' in text and '<span class="bad">kept_inductor</span>' in text
    assert "rejected_incorrect" in text and "worker died with SIGSEGV" in text
    assert "Artifact-cache hit" in text and "dynamic_shape" in text
    assert "2.4x" in text  # distance to the roofline floor of the installed graph


def test_report_escapes_text_from_the_run_folder(report):
    text = report[0].read_text()
    assert "<script>alert(1)</script>" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert text.count("<script>") == 1  # only the report's own plot counter


def test_report_redacts_provider_keys(tmp_path, monkeypatch):
    secret = "sk-report-0123456789abcdef"
    ids = build_root(tmp_path)
    track = tmp_path / "runs" / RUN_NEW / ids["kept"] / "track.json"
    track.write_text(track.read_text().replace("worker died with SIGSEGV", f"upstream refused {secret}"))
    monkeypatch.setenv("ANTHROPIC_API_KEY", secret)
    out_file = tmp_path / "r.html"
    assert main(["--root", str(tmp_path), "report", "latest", "-o", str(out_file)], out=io.StringIO()) == 0
    text = out_file.read_text()
    assert secret not in text and "upstream refused &lt;redacted&gt;" in text


def test_report_of_a_run_without_eligible_graphs_has_no_plots(tmp_path):
    from tilesmith.records import Diagnostic
    from tilesmith.track.run import RunFolder

    run = RunFolder(tmp_path, "20261201T000000Z-00000000", {"created_utc": "2026-12-01T00:00:00Z",
                                                              "agent_model": "tilesmith/builtin"})
    run.open()  # a live run writes no folder without a tracked graph; older folders may still be like this
    run.add_diagnostic(Diagnostic("mixed_device", "graph ab12cd34 (0_inference) mixes cuda:0 and cpu tensors"))
    out = io.StringIO()
    assert main(["--root", str(tmp_path), "report", "latest"], out=out) == 0
    text = (run.folder / "report.html").read_text()
    assert plot_images(text) == [] and "no eligible graph was optimized" in text and "mixed_device" in text


def test_report_unknown_run_exits_2(tmp_path):
    build_root(tmp_path)
    out = io.StringIO()
    assert main(["--root", str(tmp_path), "report", "nope"], out=out) == 2
    assert "no run or graph matches 'nope'" in out.getvalue()


def _chromium(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           f"--user-data-dir={cwd / 'chromium-profile'}", *args],
                          capture_output=True, text=True, timeout=120, cwd=cwd)


@needs_chromium
def test_headless_chromium_decodes_every_plot(report, tmp_path):
    path, _ = report
    proc = _chromium("--virtual-time-budget=10000", "--dump-dom", path.as_uri(), cwd=tmp_path)
    body = re.search(r"<body[^>]*>", proc.stdout)
    assert body, proc.stderr[-2000:]
    assert 'data-plots-total="4"' in body[0] and 'data-plots-loaded="4"' in body[0]


@needs_chromium
def test_headless_chromium_screenshot_shows_the_plots(report, tmp_path):
    import numpy as np
    from matplotlib import image

    path, _ = report
    shot = tmp_path / "shot.png"
    _chromium("--window-size=1280,2400", f"--screenshot={shot}", path.as_uri(), cwd=tmp_path)
    pixels = (image.imread(shot)[..., :3] * 255).round().astype(int)
    teal = np.all(np.abs(pixels - np.array(TEAL)) <= 12, axis=-1).sum()
    assert teal > 5000  # the speedup and roofline bars are drawn, not just the page text
