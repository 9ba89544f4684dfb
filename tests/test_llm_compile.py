"""The LLM agent inside the real pipeline: ``tilesmith.compile`` → proxy → scripted upstream, CPU test mode.

The gate is replaced by :class:`MarkerGate` (deterministic: a candidate carrying the marker line is accepted,
anything else is rejected as slower), so this checks the integration — capture, track, session, the
agent's turns and tools, install, diagnostics — not timing. The proxy is configured only through
TILESMITH_API_KEY + TILESMITH_API_BASE_URL.
"""

from __future__ import annotations

import json

import pytest
import torch
from fake_upstream import (
    MISSING_BINARY,
    ScriptedUpstream,
    TurnScript,
    files_containing,
    final,
    real_proxy_binary,
    tool_call,
    write_standin_executable,
)

import tilesmith
from tests.models import TwoLayer
from tilesmith.records import Timing, Verdict

KEY = "sk-upstream-compile-0123456789"
MODEL = "scripted-model"
MARKER = "# tilesmith-llm-e2e-marker"
_REAL = real_proxy_binary()


class MarkerGate:
    """Stands in for ``tilesmith.gate.Gate``: accepts exactly the candidates that contain MARKER."""

    instances: list[MarkerGate] = []

    def __init__(self, problem, **_):
        self.evaluated = []
        MarkerGate.instances.append(self)

    def evaluate(self, candidate, incumbent=None):
        self.evaluated.append(candidate)
        eid = f"e{len(self.evaluated):04d}"
        if MARKER in candidate.source:
            timing = Timing("host_clock", 10, (1.0,) * 5, (0.5,) * 5, 2.0, 1.9, 2.1)
            return Verdict(True, "accepted", (), timing=timing, confirmation=timing, evaluation_id=eid)
        return Verdict(False, "rejected_slower", ("stub gate: no marker",), evaluation_id=eid)

    def recheck(self, candidate):
        return self.evaluate(candidate)

    def close(self):
        pass


@pytest.fixture(params=["standin", pytest.param("real", marks=[
    pytest.mark.proxy, pytest.mark.skipif(_REAL is None, reason=MISSING_BINARY)])])
def proxy_exe(request, tmp_path_factory) -> str:
    if request.param == "real":
        return str(_REAL)
    return str(write_standin_executable(tmp_path_factory.mktemp("standin")))


def test_compile_runs_the_llm_agent_through_the_proxy_and_installs_the_accepted_candidate(
        tmp_path, monkeypatch, proxy_exe):
    import tilesmith.gate as gate_module

    monkeypatch.setattr(gate_module, "Gate", MarkerGate, raising=False)
    monkeypatch.setattr(gate_module, "GateProblem", lambda **kw: kw, raising=False)
    root = tmp_path / "ts"
    tail = "recursively_apply_fns = runner.recursively_apply_fns"
    script = TurnScript([[
        lambda p: tool_call("edit_file", file_path=p, old_string=tail, new_string=tail + "\n# first idea"),
        lambda p: tool_call("evaluate_attempt", note="first idea"),
        lambda p: tool_call("edit_file", file_path=p, old_string="# first idea", new_string=MARKER),
        lambda p: tool_call("evaluate_attempt", note="second idea"),
        lambda p: final("accepted"),
    ]])
    with ScriptedUpstream(api_key=KEY, models=(MODEL,), responder=script) as upstream:
        for name, value in {"TILESMITH_CACHE_DIR": str(root), "TILESMITH_ALLOW_CPU": "1", "TILESMITH_DEBUG": "1",
                            "TILESMITH_API_KEY": KEY, "TILESMITH_API_BASE_URL": upstream.base_url,
                            "TILESMITH_CLIPROXYAPI_EXECUTABLE": proxy_exe, "HOME": str(tmp_path / "home"),
                            "TILESMITH_ARTIFACT_CACHE": "0"}.items():
            monkeypatch.setenv(name, value)
        torch._dynamo.reset()
        try:
            model = TwoLayer().eval()
            x = torch.randn(8, 64)
            compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=MODEL, loops=1, max_model_calls=20)
            with torch.no_grad():
                torch.testing.assert_close(compiled(x), model(x))
            records = tilesmith.benchmarks(compiled)
            diagnostics = tilesmith.diagnostics(compiled)
        finally:
            torch._dynamo.reset()
    assert [r.source for r in records] == ["optimizer"], diagnostics
    (track,) = sorted(p.parent for p in root.glob("runs/*/*/track.json"))
    state = json.loads((track / "track.json").read_text())
    assert [e["status"] for e in state["evaluations"]] == ["rejected_slower", "accepted"]
    assert {e["proposer"] for e in state["evaluations"]} == {f"llm:{MODEL}"}
    assert state["status"] == "installed" and len(upstream.chat_requests()) == 5
    assert (track / "traces" / "turn_001.jsonl").exists()
    assert files_containing(root, [KEY]) == []
