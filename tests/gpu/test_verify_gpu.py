"""Production verification on CUDA (H200): CUDA-graph candidates keep replaying while checked, bombs are caught,
training graphs are verified, a user's own CUDA-graph capture is not disturbed.

Candidates are installed by the stand-in gate of tests/verify_support.py (accepts everything); what is under
test is the user's process after install. Run on a CUDA machine::

    python -m pytest -q -s -m gpu tests/gpu/test_verify_gpu.py
"""

from __future__ import annotations

import time

import pytest
import torch

import tilesmith
from tests import verify_support as vs
from tests.scripted import ScriptedFactory
from tilesmith.install import verify

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(autouse=True)
def stand_in_gate(tmp_path, monkeypatch):
    import tilesmith.gate

    monkeypatch.setenv("TILESMITH_CACHE_DIR", str(tmp_path / "ts"))
    monkeypatch.delenv("TILESMITH_ALLOW_CPU", raising=False)
    monkeypatch.setattr(tilesmith.gate, "Gate", vs.AcceptingGate)
    torch._dynamo.reset()
    yield tmp_path / "ts"
    torch._dynamo.reset()


def cudagraph_edit(text: str) -> str:
    from tilesmith.agent.builtin.cudagraph import cudagraph_source
    from tilesmith.capture.source import strip_fx_header

    wrapper = strip_fx_header(text)
    return text.replace(wrapper, cudagraph_source(wrapper, device="cuda:0"))


class Block(torch.nn.Module):
    def __init__(self, d=512, h=2048):
        super().__init__()
        self.fc1, self.fc2, self.ln = torch.nn.Linear(d, h), torch.nn.Linear(h, d), torch.nn.LayerNorm(d)

    def forward(self, x):
        return self.ln(x + self.fc2(torch.nn.functional.gelu(self.fc1(x))))


def _pair():
    torch.manual_seed(0)
    ours, theirs = Block().cuda(), Block().cuda()
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def _kinds(compiled):
    return [d.kind for d in tilesmith.diagnostics(compiled)]


def _handles(compiled):
    return tilesmith.api._run_of(compiled).handles


def _infer(compiled, plain, calls):
    worst = []
    with torch.no_grad():
        for _ in range(calls):
            x = torch.randn(64, 512, device="cuda")
            worst.append(float((compiled(x) - plain(x)).abs().max()))
    return worst


def test_cudagraph_candidate_is_checked_and_keeps_replaying(monkeypatch):
    monkeypatch.setenv("TILESMITH_VERIFY", "first=6,every=off,interval=off")
    ours, theirs = _pair()
    compiled = tilesmith.compile(ours.eval(), example_inputs=(torch.randn(64, 512, device="cuda"),),
                                 agent_model=ScriptedFactory(edits=[cudagraph_edit]))
    worst = _infer(compiled, torch.compile(theirs.eval()), 1 + 12)
    (handle,) = _handles(compiled)
    v = verify.verifier_of(handle)
    assert v is not None and v.checks == 6 and not v.failed, _kinds(compiled)
    runtime = v.module._tilesmith_cudagraph
    assert runtime.status.startswith("graph:") and runtime.replays >= 8, runtime.status
    assert max(worst) < 1e-3, worst
    print(f"\ncudagraph candidate: {runtime.status}, {runtime.replays} replays, pinned {runtime.pinned}; check "
          f"{v.check_cost_s * 1e6:.0f} us over a {v.call_s * 1e6:.0f} us call; mean gap after: {v.gap:.0f} calls")


def test_count_bomb_on_cuda_is_caught_and_outputs_stay_the_originals(monkeypatch):
    monkeypatch.setenv("TILESMITH_VERIFY", "first=20,every=off,interval=off")
    ours, theirs = _pair()
    compiled = tilesmith.compile(ours.eval(), example_inputs=(torch.randn(64, 512, device="cuda"),),
                                 agent_model=ScriptedFactory(edits=[vs.count_bomb_itertools(4)]))
    worst = _infer(compiled, torch.compile(theirs.eval()), 1 + 8)
    assert max(worst) < 1e-3, worst
    (diag,) = [d for d in tilesmith.diagnostics(compiled) if d.kind == "verification_failed"]
    assert "call 5 since install" in diag.message, diag.message
    assert _handles(compiled)[0].state == "uninstalled"


def test_training_forward_and_backward_are_checked_on_cuda(monkeypatch):
    monkeypatch.setenv("TILESMITH_VERIFY", "first=50,every=off,interval=off")
    ours, theirs = _pair()
    compiled = tilesmith.compile(ours, example_inputs=(torch.randn(64, 512, device="cuda"),),
                                 agent_model=ScriptedFactory(edits=[vs.honest()]))
    plain = torch.compile(theirs)
    for _ in range(5):
        x = torch.randn(64, 512, device="cuda")
        for model in (compiled, plain):
            model.zero_grad()
            model(x).square().sum().backward()
        worst = max(float((a.grad - b.grad).abs().max()) for a, b in zip(ours.parameters(), theirs.parameters()))
        assert worst < 1e-3
    checked = {h.graph.kind: verify.verifier_of(h).checks for h in _handles(compiled)}
    assert checked == {"forward": 4, "backward": 4}, (checked, _kinds(compiled))
    assert "verification_failed" not in _kinds(compiled)


def test_a_users_cuda_graph_capture_skips_the_check(monkeypatch):
    monkeypatch.setenv("TILESMITH_VERIFY", "first=50,every=off,interval=off")
    ours, theirs = _pair()
    static = torch.randn(64, 512, device="cuda")
    compiled = tilesmith.compile(ours.eval(), example_inputs=(static,), agent_model=ScriptedFactory(
        edits=[vs.honest()]))
    plain = torch.compile(theirs.eval())
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                compiled(static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = compiled(static)
        static.copy_(torch.randn_like(static))
        graph.replay()
        torch.cuda.synchronize()
        assert float((out - plain(static)).abs().max()) < 1e-3
    assert "verification_skipped" in _kinds(compiled) and "verification_failed" not in _kinds(compiled)


def test_cost_of_checks_is_printed():
    """Prints a checked and an unchecked call's time for the record (bench/verify_cost.py measures properly)."""
    ours, _ = _pair()
    compiled = tilesmith.compile(ours.eval(), example_inputs=(torch.randn(64, 512, device="cuda"),),
                                 agent_model=ScriptedFactory(edits=[vs.honest()]))
    x = torch.randn(64, 512, device="cuda")
    with torch.no_grad():
        for _ in range(50):
            compiled(x)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            compiled(x)
        torch.cuda.synchronize()
    v = verify.verifier_of(_handles(compiled)[0])
    print(f"\ndefault policy: {(time.perf_counter() - t0) / 200 * 1e6:.1f} us/call over 200 calls, {v.checks} checks "
          f"so far, mean gap {v.gap:.0f}, check {v.check_cost_s * 1e6:.0f} us, call {v.call_s * 1e6:.1f} us")
