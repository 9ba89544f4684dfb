"""Test-wide settings: one shared Inductor cache, CPU vector-ISA probe skipped, no real keys or network.

TORCHINDUCTOR_VEC_ISA_OK=1 and one TORCHINDUCTOR_CACHE_DIR for every test process (and the gate workers
they spawn, which inherit the environment): the first CPU compile otherwise costs ~40 s per process.
TILESMITH_PRESTART_WORKER=0 unless a test turns it on.
"""

from __future__ import annotations

import os
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_REPO / ".cache" / "inductor"))
os.environ.setdefault("TILESMITH_PROGRESS", "off")
# No standby gate worker per tilesmith.compile() (tilesmith.gate.host.standby): on 2 cores its torch import would
# compete with the tests that time candidates; tests/test_gate_standby.py turns it on where it is the subject.
os.environ.setdefault("TILESMITH_PRESTART_WORKER", "0")
for _name in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY", "GOOGLE_API_KEY", "XAI_API_KEY",
              "VERTEX_API_KEY", "OPENROUTER_API_KEY", "TILESMITH_API_KEY", "TILESMITH_API_BASE_URL",
              "TILESMITH_MODEL", "LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2"):
    os.environ.pop(_name, None)


import pytest  # noqa: E402 - after the environment above, which must be set before anything imports torch


@pytest.fixture
def cpu_test_mode(tmp_path, monkeypatch):
    """Tilesmith's CPU test mode with a private cache root (yielded) and a fresh Dynamo before and after."""
    import torch

    monkeypatch.setenv("TILESMITH_CACHE_DIR", str(tmp_path / "ts"))
    monkeypatch.setenv("TILESMITH_ALLOW_CPU", "1")
    torch._dynamo.reset()
    yield tmp_path / "ts"
    torch._dynamo.reset()
