"""gpu_shell in the real pipeline, CPU test mode: tilesmith.compile → proxy → scripted upstream → shell → install.

The scripted agent works on MulSum's Inductor wrapper (a C++ multiply-sum loop): in the shell it writes a variant
(BLAS mm instead of the loop, tests/models.py) and times it against baseline.py on the graph's real snapshot
(inputs and constants bound read-only from the gate's private folder), then reads the loop's call line exactly,
edits it, and asks the gate. The gate is :class:`LoopGoneGate` (accepts exactly the candidates without the loop
call): on this shared 2-core machine the real gate's CPU timing of this pair swings between 0.5x and 2.8x under
other processes' load, and acceptance by the real gate is what tests/gpu/test_llm_shell_gpu.py shows on the H200.
Slow (~1 min): every CPU-mode Python process in the sandbox re-runs Inductor's vector-ISA probe. Needs bubblewrap;
skips with the sandbox's reason otherwise.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from fake_upstream import (
    ScriptedUpstream,
    TurnScript,
    files_containing,
    final,
    real_proxy_binary,
    tool_call,
    write_standin_executable,
)

import tilesmith
from tests.models import MulSum, has_mulsum_loop, mm_instead_of_loop
from tilesmith.agent.llm.sandbox import prepare
from tilesmith.records import Timing, Verdict

KEY = "sk-upstream-shell-compile-0123456789"
MODEL = "scripted-model"
_REAL = real_proxy_binary()
_SANDBOX, _STATUS = prepare(os.environ, [])

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(_SANDBOX is None, reason=f"no working bubblewrap sandbox: {_STATUS.reason}")]


@pytest.fixture
def proxy_exe(tmp_path_factory) -> str:
    """The real CLIProxyAPI when built (``make proxy``), else the stand-in: one run, the test is slow."""
    if _REAL is not None:
        return str(_REAL)
    return str(write_standin_executable(tmp_path_factory.mktemp("standin")))


class LoopGoneGate:
    """Stands in for ``tilesmith.gate.Gate`` (keeps its ``problem``, hence the snapshot the shell shows): accepts
    exactly the candidates whose wrapper no longer calls the C++ multiply-sum loop."""

    def __init__(self, problem, **_):
        self.problem = problem

    def evaluate(self, candidate, incumbent=None):
        if has_mulsum_loop(candidate.source):
            return Verdict(False, "rejected_slower", ("stub gate: the loop is still there",), evaluation_id="e0001")
        timing = Timing("host_clock", 10, (1.0,) * 5, (0.25,) * 5, 4.0, 3.9, 4.1)
        return Verdict(True, "accepted", (), timing=timing, confirmation=timing, evaluation_id="e0002")

    def recheck(self, candidate):
        return self.evaluate(candidate)

    def close(self):
        pass


def _report(text: str) -> dict:
    return json.loads(next(x for x in text.splitlines() if x.startswith("{") and '"device"' in x))


def test_shell_times_a_variant_of_the_real_wrapper_on_the_snapshot_and_the_edit_is_installed(tmp_path, monkeypatch,
                                                                                            proxy_exe):
    import types

    import tilesmith.gate as gate_module

    monkeypatch.setattr(gate_module, "Gate", LoopGoneGate, raising=False)
    monkeypatch.setattr(gate_module, "GateProblem", lambda **kw: types.SimpleNamespace(**kw), raising=False)
    root = tmp_path / "ts"
    skill = tmp_path / "skill" / "SKILL.md"
    skill.parent.mkdir()
    skill.write_text("SKILL-BODY-7788: prefer library matmuls for reductions over a product.\n")

    def newest() -> Path:
        return max(root.glob("runs/*/*/attempts/attempt_*.py"), key=lambda p: p.stat().st_mtime_ns)

    def write_variant(path: str):
        text = mm_instead_of_loop(newest().read_text())
        assert "EOF_VARIANT" not in text
        return tool_call("gpu_shell", command=f"cat > variant.py <<'EOF_VARIANT'\n{text}EOF_VARIANT\n"
                         "python runner.py variant.py --time --iters 10", timeout_seconds=300)

    def read_loop_line(path: str):
        lines = newest().read_text().splitlines()
        number = next(i for i, line in enumerate(lines, 1) if has_mulsum_loop(line))
        return tool_call("read_exact_source", file_path=path, start_line=number, line_count=1)

    def edit_loop_line(path: str):
        exact = [m["content"] for m in upstream.chat_requests()[-1]["messages"] if m["role"] == "tool"][-1]
        assert has_mulsum_loop(exact) and exact.endswith("\n") and not exact[0].isdigit()
        return tool_call("edit_file", file_path=path, old_string=exact, new_string=mm_instead_of_loop(exact))

    script = TurnScript([[
        write_variant, read_loop_line, edit_loop_line,
        lambda p: tool_call("evaluate_attempt", note="BLAS mm instead of the C++ loop"),
        lambda p: final("accepted"),
    ]])
    with ScriptedUpstream(api_key=KEY, models=(MODEL,), responder=script) as upstream:
        for name, value in {"TILESMITH_CACHE_DIR": str(root), "TILESMITH_ALLOW_CPU": "1", "TILESMITH_DEBUG": "1",
                            "TILESMITH_API_KEY": KEY, "TILESMITH_API_BASE_URL": upstream.base_url,
                            "TILESMITH_CLIPROXYAPI_EXECUTABLE": proxy_exe, "HOME": str(tmp_path / "home"),
                            "TILESMITH_ARTIFACT_CACHE": "0", "TILESMITH_SKILLS": str(skill.parent)}.items():
            monkeypatch.setenv(name, value)
        torch._dynamo.reset()
        try:
            model = MulSum().eval()
            x = torch.randn(64, 512)
            compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=MODEL, max_model_calls=20,
                                         sandbox="local")
            with torch.no_grad():
                torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
            records, diagnostics = tilesmith.benchmarks(compiled), tilesmith.diagnostics(compiled)
        finally:
            torch._dynamo.reset()
        turn1 = [r for r in upstream.chat_requests() if "Turn 1." in json.dumps(r["messages"][:2])][-1]["messages"]
        shell_ids = {c["id"] for m in turn1 for c in m.get("tool_calls") or [] if c["function"]["name"] == "gpu_shell"}
        shell_results = [m["content"] for m in turn1 if m["role"] == "tool" and m.get("tool_call_id") in shell_ids]
        system = upstream.chat_requests()[0]["messages"][0]["content"]
    tools_said = [m["content"][:1500] for m in turn1 if m["role"] == "tool"]
    assert [r.source for r in records] == ["optimizer"], (diagnostics, tools_said)
    (variant,) = (_report(t) for t in shell_results)  # timed against baseline.py on the real snapshot inputs
    assert variant["file"] == "variant.py" and variant["device"] == "cpu" and variant["matches_baseline"] is True
    assert variant["baseline_ms"] > 0 and variant["candidate_ms"] > 0 and variant["iters"] == 10
    (track,) = sorted(p.parent for p in root.glob("runs/*/*/track.json"))
    state = json.loads((track / "track.json").read_text())
    assert [e["status"] for e in state["evaluations"]] == ["accepted"] and state["status"] == "installed"
    assert state["agent"]["gpu_shell"]["offered"] is True and state["agent"]["gpu_shell"]["sandbox"]
    import hashlib

    assert state["agent"]["skills"] == [{"name": "skill/SKILL.md", "bytes": skill.stat().st_size,
                                         "sha256": hashlib.sha256(skill.read_bytes()).hexdigest()}]
    assert "SKILL-BODY-7788" in system
    assert files_containing(root, ["SKILL-BODY-7788", KEY]) == []
    assert (track / "shell" / "variant.py").is_file() and (track / "shell" / "baseline.py").is_file()
