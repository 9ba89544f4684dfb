"""Test-wide settings: one shared Inductor cache, CPU vector-ISA probe skipped, no real keys or network, and
nothing written under the user's home.

TORCHINDUCTOR_VEC_ISA_OK=1 and one TORCHINDUCTOR_CACHE_DIR for every test process (and the gate workers
they spawn, which inherit the environment): the first CPU compile otherwise costs ~40 s per process. It is
the Makefile's (the repository's ``.cache/inductor``) when set, unless it points into the real home.
TILESMITH_PRESTART_WORKER=0 unless a test turns it on.

Home: the session fixture :func:`_caches_outside_home` points ``TILESMITH_CACHE_DIR``, ``XDG_CACHE_HOME`` and
``TRITON_CACHE_DIR`` at folders outside the home for the whole session (tests that need their own root
still set it), and :func:`pytest_sessionfinish` fails the session when anything under the real home's
Tilesmith or Triton caches is new or changed (tests/home_guard.py says which folders).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import home_guard  # noqa: E402

_USER_ENV = dict(os.environ)  # before anything below changes it
_GUARDED = home_guard.guarded_roots(_USER_ENV, _REPO)
_BEFORE = home_guard.snapshot(_GUARDED)

os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
_inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
if not _inductor or Path(_inductor).expanduser().resolve().is_relative_to(home_guard.real_home().resolve()):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(_REPO / ".cache" / "inductor")
os.environ.setdefault("TILESMITH_PROGRESS", "off")
# No standby gate worker per tilesmith.compile() (tilesmith.gate.host.standby): on 2 cores its torch import would
# compete with the tests that time candidates; tests/test_gate_standby.py turns it on where it is the subject.
os.environ.setdefault("TILESMITH_PRESTART_WORKER", "0")
for _name in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY", "GOOGLE_API_KEY", "XAI_API_KEY",
              "VERTEX_API_KEY", "OPENROUTER_API_KEY", "TILESMITH_API_KEY", "TILESMITH_API_BASE_URL",
              "TILESMITH_MODEL", "LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2"):
    os.environ.pop(_name, None)


import pytest  # noqa: E402 - after the environment above, which must be set before anything imports torch


@pytest.fixture(scope="session", autouse=True)
def _caches_outside_home(tmp_path_factory):
    """Every Tilesmith cache root and Triton's cache outside the home for the whole session (yields the
    temporary folder). Triton's goes beside Inductor's shared cache, where Inductor would put it anyway."""
    caches = tmp_path_factory.mktemp("caches")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TILESMITH_CACHE_DIR", str(caches / "tilesmith"))
        mp.setenv("XDG_CACHE_HOME", str(caches / "xdg"))
        mp.setenv("TRITON_CACHE_DIR", str(Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / "triton"))
        yield caches


def pytest_sessionfinish(session, exitstatus):
    """Fail the session when a test wrote under the real home's caches (tests/home_guard.py)."""
    written = home_guard.changes(_BEFORE, home_guard.snapshot(_GUARDED))
    if not written:
        return
    shown = "\n  ".join(written[:20]) + (f"\n  … and {len(written) - 20} more" if len(written) > 20 else "")
    message = (f"\nthe test session wrote under the user's home ({', '.join(map(str, _GUARDED))}):\n  {shown}\n"
               "Remedy: give the test its own TILESMITH_CACHE_DIR (tmp_path) and keep the environment it passes "
               "to subprocesses (the session points every cache at a temporary folder).\n")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(message, red=True)
    else:
        sys.stderr.write(message)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def cpu_test_mode(tmp_path, monkeypatch):
    """Tilesmith's CPU test mode with a private cache root (yielded) and a fresh Dynamo before and after."""
    import torch

    monkeypatch.setenv("TILESMITH_CACHE_DIR", str(tmp_path / "ts"))
    monkeypatch.setenv("TILESMITH_ALLOW_CPU", "1")
    torch._dynamo.reset()
    yield tmp_path / "ts"
    torch._dynamo.reset()


@pytest.fixture(scope="session", autouse=True)
def _forkserver_warm(_caches_outside_home):
    """With ``TILESMITH_GATE_FORKSERVER=1`` in the environment (running existing suites against the fork server),
    start the CPU zygote once and wait for it, so that the gates' workers are forked rather than started while it
    warms up. Nothing otherwise."""
    if os.environ.get("TILESMITH_GATE_FORKSERVER", "0") not in ("1", "true", "yes", "on"):
        yield
        return
    from tilesmith.gate.host import forkserver

    assert forkserver.prepare("cpu", timeout_s=600), "the fork server's zygote did not start"
    yield
    forkserver.shutdown()
