"""LLM agent end to end on the H200: tilesmith.compile → real CLIProxyAPI → scripted upstream → real gate.

The scripted "LLM" plays two turns on the 64×1024→4096→1024 fp32 MLP block: turn 1 adds a comment and asks
the gate (rejected: no faster), turn 2 writes the whole-call CUDA-graph version of the wrapper and asks again
(the real gate decides). Configured only through TILESMITH_API_KEY + TILESMITH_API_BASE_URL.

    python -m pytest -q -s -m gpu tests/gpu/test_llm_e2e_gpu.py      (needs .cache/bin/cli-proxy-api)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tilesmith
from tests.fake_upstream import MISSING_BINARY, ScriptedUpstream, TurnScript, files_containing, final, \
    real_proxy_binary, tool_call
from tilesmith.capture.source import strip_fx_header

pytestmark = [pytest.mark.gpu, pytest.mark.proxy,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(real_proxy_binary() is None, reason=MISSING_BINARY)]

KEY = "sk-upstream-gpu-e2e-0123456789abcdef"
MODEL = "scripted-model"


def test_llm_agent_installs_faster_mlp_wrapper_through_real_proxy(tmp_path, monkeypatch):
    from examples.models import MLPBlock, randomize_
    from tilesmith.agent.builtin.cudagraph import cudagraph_source

    root = tmp_path / "ts"

    def newest_attempt_text() -> str:
        newest = max(root.glob("runs/*/*/attempts/attempt_*.py"), key=lambda p: p.stat().st_mtime_ns)
        return newest.read_text()

    def write_cudagraph(path: str):
        text = newest_attempt_text()
        wrapper = strip_fx_header(text)
        return tool_call("write_file", file_path=path,
                         content=text.replace(wrapper, cudagraph_source(wrapper, device="cuda:0")))

    tail = "recursively_apply_fns = runner.recursively_apply_fns"
    script = TurnScript([
        [lambda p: tool_call("edit_file", file_path=p, old_string=tail, new_string=tail + "\n# idea: nothing"),
         lambda p: tool_call("evaluate_attempt", note="comment only"),
         lambda p: final("no gain")],
        [write_cudagraph,
         lambda p: tool_call("evaluate_attempt", note="whole-call CUDA graph"),
         lambda p: final("accepted")],
    ])
    with ScriptedUpstream(api_key=KEY, models=(MODEL,), responder=script) as upstream:
        for name, value in {"TILESMITH_CACHE_DIR": str(root), "TILESMITH_API_KEY": KEY,
                            "TILESMITH_API_BASE_URL": upstream.base_url, "TILESMITH_DEBUG": "1",
                            "TILESMITH_CLIPROXYAPI_EXECUTABLE": real_proxy_binary(),
                            "HOME": str(tmp_path / "home"), "TILESMITH_ARTIFACT_CACHE": "0"}.items():
            monkeypatch.setenv(name, value)
        monkeypatch.delenv("TILESMITH_ALLOW_CPU", raising=False)
        torch._dynamo.reset()
        model = randomize_(MLPBlock()).cuda().eval()
        x = torch.randn(64, 1024, device="cuda")
        compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=MODEL, loops=1, max_model_calls=30)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
            x2 = torch.randn(64, 1024, device="cuda")
            torch.testing.assert_close(compiled(x2), model(x2), rtol=1e-4, atol=1e-4)
        records, diagnostics = tilesmith.benchmarks(compiled), tilesmith.diagnostics(compiled)
        torch._dynamo.reset()
    for r in records:
        print(f"[llm-e2e] benchmark {r.graph_name} {r.graph_key[:8]}: torch_inductor_ms={r.torch_inductor_ms:.4f} "
              f"tilesmith_ms={r.tilesmith_ms:.4f} speedup={r.speedup:.3f} ci={r.speedup_ci}")
    for d in diagnostics:
        print(f"[llm-e2e] diagnostic {d.kind}: {d.message[:300]}")
    (track,) = sorted(p.parent for p in root.glob("runs/*/*/track.json"))
    state = json.loads((track / "track.json").read_text())
    print("[llm-e2e] evaluations", [(e["proposer"], e["status"], e["speedup"]) for e in state["evaluations"]])
    assert [r.source for r in records] == ["optimizer"], diagnostics
    assert state["evaluations"][-1]["status"] == "accepted"
    assert files_containing(root, [KEY]) == []
    assert Path(track / "traces").is_dir()
    assert len(upstream.chat_requests()) >= 6
