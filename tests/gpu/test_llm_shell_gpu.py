"""gpu_shell on the H200: tilesmith.compile(chip=) → real CLIProxyAPI → scripted upstream → sandboxed shell.

The scripted "LLM" works on the 64×1024→4096→1024 fp32 MLP block in one turn: in the bubblewrap shell it lists
the GPU, times the wrapper on the graph's real inputs (``python runner.py --time``), writes and times a Triton
kernel (``triton.testing.do_bench``), writes the whole-call CUDA-graph version of the wrapper, times it in the
shell again, and asks the gate (which decides). bwrap: ``TILESMITH_BWRAP`` (scripts/bwrap-bundle.sh unpacks the
Debian package; scripts/gpu-suite.sh sets it when .device/bwrap-debs is there) or ``bwrap`` on PATH.

    python -m pytest -q -s -m gpu tests/gpu/test_llm_shell_gpu.py      (needs .cache/bin/cli-proxy-api)
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import tilesmith
from tests.fake_upstream import MISSING_BINARY, ScriptedUpstream, TurnScript, files_containing, final, \
    real_proxy_binary, tool_call
from tilesmith.agent.llm.sandbox import prepare
from tilesmith.capture.source import strip_fx_header

_SANDBOX, _STATUS = prepare(os.environ, []) if torch.cuda.is_available() else (None, None)
pytestmark = [pytest.mark.gpu, pytest.mark.proxy,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(real_proxy_binary() is None, reason=MISSING_BINARY),
              pytest.mark.skipif(_SANDBOX is None, reason=f"no bubblewrap sandbox: {_STATUS and _STATUS.reason}")]

KEY = "sk-upstream-gpu-shell-0123456789abcdef"
MODEL = "scripted-model"

TRITON_TIMING = r'''cat > tri.py <<'EOF'
import json, torch, triton, triton.language as tl
from triton.testing import do_bench

@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)

n = 1 << 24
x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
out = torch.empty_like(x)
run = lambda: add_kernel[(triton.cdiv(n, 1024),)](x, y, out, n, BLOCK=1024)
run()
torch.testing.assert_close(out, x + y)
ms = do_bench(run)
print(json.dumps({"triton_ms": ms, "gbps": 3 * 4 * n / ms / 1e6, "gpu": torch.cuda.get_device_name(0),
                  "triton": triton.__version__}))
EOF
python tri.py'''


def test_agent_uses_the_sandboxed_gpu_shell_to_time_triton_and_the_wrapper_then_gets_accepted(tmp_path, monkeypatch):
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

    def shell(command: str):
        return lambda p: tool_call("gpu_shell", command=command, timeout_seconds=600)

    script = TurnScript([[
        shell("(nvidia-smi -L || true) && python -c 'import torch; print(\"GPU 0:\", torch.cuda.get_device_name(0))' "
              "&& python runner.py --time --iters 20"),
        shell(TRITON_TIMING),
        write_cudagraph,
        shell("python runner.py --time --iters 20"),
        lambda p: tool_call("evaluate_attempt", note="whole-call CUDA graph, timed in the shell first"),
        lambda p: final("accepted"),
    ]])
    device_name = torch.cuda.get_device_name(0)
    chip = "H200" if "H200" in device_name else device_name
    with ScriptedUpstream(api_key=KEY, models=(MODEL,), responder=script) as upstream:
        for name, value in {"TILESMITH_CACHE_DIR": str(root), "TILESMITH_API_KEY": KEY,
                            "TILESMITH_API_BASE_URL": upstream.base_url, "TILESMITH_DEBUG": "1",
                            "TILESMITH_CLIPROXYAPI_EXECUTABLE": real_proxy_binary(), "TILESMITH_SKILLS": "",
                            "HOME": str(tmp_path / "home"), "TILESMITH_ARTIFACT_CACHE": "0"}.items():
            monkeypatch.setenv(name, value)
        monkeypatch.delenv("TILESMITH_ALLOW_CPU", raising=False)
        torch._dynamo.reset()
        model = randomize_(MLPBlock()).cuda().eval()
        x = torch.randn(64, 1024, device="cuda")
        compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=MODEL, loops=1, max_model_calls=30,
                                     sandbox="local", chip=chip)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
        records, diagnostics = tilesmith.benchmarks(compiled), tilesmith.diagnostics(compiled)
        torch._dynamo.reset()
        messages = upstream.chat_requests()[-1]["messages"]
    shell_ids = {c["id"] for m in messages for c in m.get("tool_calls") or [] if c["function"]["name"] == "gpu_shell"}
    outputs = [m["content"] for m in messages if m["role"] == "tool" and m.get("tool_call_id") in shell_ids]
    for text in outputs:
        print("[llm-shell-gpu] gpu_shell:", text[:1500].replace("\n", " | "))
    for d in diagnostics:
        print(f"[llm-shell-gpu] diagnostic {d.kind}: {d.message[:300]}")
    for r in records:
        print(f"[llm-shell-gpu] benchmark {r.graph_key[:8]}: inductor {r.torch_inductor_ms:.4f} ms, tilesmith "
              f"{r.tilesmith_ms:.4f} ms, speedup {r.speedup:.3f}")

    def report(text: str, key: str) -> dict:
        return json.loads(next(x for x in text.splitlines() if x.startswith("{") and key in x))

    assert len(outputs) == 3 and all(t.startswith("exit code 0") for t in outputs), outputs
    assert f"GPU 0: {device_name}" in outputs[0]
    first, triton_run, graphed = report(outputs[0], '"device"'), report(outputs[1], "triton_ms"), \
        report(outputs[2], '"device"')
    assert first["device"] == "cuda" and first["clock"] == "cuda_event" and first["baseline_ms"] > 0
    assert triton_run["triton_ms"] > 0 and triton_run["gpu"] == device_name
    assert graphed["matches_baseline"] is True and graphed["candidate_ms"] > 0
    print(f"[llm-shell-gpu] shell: baseline {first['baseline_ms']:.4f} ms, cuda-graph candidate "
          f"{graphed['candidate_ms']:.4f} ms (x{graphed['speedup']:.2f}), triton add {triton_run['triton_ms']:.4f} ms "
          f"({triton_run['gbps']:.0f} GB/s)")
    (track,) = sorted(p.parent for p in root.glob("runs/*/*/track.json"))
    state = json.loads((track / "track.json").read_text())
    assert state["agent"]["gpu_shell"]["offered"] is True
    assert [r.source for r in records] == ["optimizer"], diagnostics
    assert state["evaluations"][-1]["status"] == "accepted"
    assert files_containing(root, [KEY]) == []
