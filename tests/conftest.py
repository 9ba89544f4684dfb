"""Test-wide settings: one shared Inductor cache, CPU vector-ISA probe skipped, no real keys or network.

TORCHINDUCTOR_VEC_ISA_OK=1 and one TORCHINDUCTOR_CACHE_DIR for every test process (and the gate workers
they spawn, which inherit the environment): the first CPU compile otherwise costs ~40 s per process.
"""

from __future__ import annotations

import os
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_REPO / ".cache" / "inductor"))
os.environ.setdefault("TILESMITH_PROGRESS", "off")
for _name in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY", "GOOGLE_API_KEY", "XAI_API_KEY",
              "VERTEX_API_KEY", "OPENROUTER_API_KEY", "TILESMITH_API_KEY", "TILESMITH_API_BASE_URL",
              "TILESMITH_MODEL", "LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2"):
    os.environ.pop(_name, None)
