"""The suite's pytest configuration keeps failure reports readable: a failing test that compiled with torch
shows no captured ``torch.__trace`` records (torch keeps that logger at DEBUG for TORCH_TRACE, and pytest 9.2
captures non-propagating loggers too; ``log_level = "WARNING"`` in pyproject.toml drops them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_failing_compiled_test_reports_no_torch_trace_records(tmp_path):
    (tmp_path / "test_probe.py").write_text(
        "import logging\nimport torch\n\n"
        "def test_compiles_then_fails():\n"
        "    torch.compile(lambda x: (x * 2).sum())(torch.randn(8))\n"
        "    logging.getLogger('probe').warning('a warning is still captured')\n"
        "    assert False\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), "--rootdir",
                           str(tmp_path), "-q", "-p", "no:cacheprovider", str(tmp_path / "test_probe.py")],
                          cwd=tmp_path, env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "1 failed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "a warning is still captured" in proc.stdout
    assert "torch.__trace" not in proc.stdout
