"""With nothing installed, a ``tilesmith.compile`` callable runs Inductor's own callable and nothing else (issue
19, item 3): after the first call's optimization the graph's ``current_callable`` is the very object Inductor
compiled, so later calls pass through no Tilesmith frame (CPU test mode; the gate is a stub rejecting all)."""

from __future__ import annotations

import sys

import torch

import tilesmith  # noqa: F401 - tilesmith.compile below
from tests.models import TwoLayer
from tests.scripted import ScriptedFactory, comment


class _RejectAll:
    def __init__(self, problem, reference=None, min_improvement=None, profiles_dir=None, **kwargs):
        pass

    def evaluate(self, candidate, incumbent=None):
        from tilesmith.records import Verdict

        return Verdict(accepted=False, status="rejected_slower", reasons=("stub",), evaluation_id="e0001")

    def recheck(self, candidate):
        return self.evaluate(candidate)

    def close(self):
        pass


def test_kept_inductor_graph_calls_inductors_own_callable_only(cpu_test_mode, monkeypatch):
    import tilesmith.gate
    from tilesmith.api import _run_of

    monkeypatch.setattr(tilesmith.gate, "Gate", _RejectAll)
    torch.manual_seed(0)
    model, x = TwoLayer().eval(), torch.randn(8, 64)
    compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=ScriptedFactory(edits=[comment("noop")]))
    with torch.no_grad():
        first = compiled(x)
    run = _run_of(compiled)
    assert run.handles and all(h.state == "kept_inductor" for h in run.handles)
    for handle in run.handles:
        assert handle.compiled.current_callable is handle.original  # Inductor's object, not a Tilesmith wrapper
    frames: list[str] = []

    def tracer(frame, event, arg):
        if event == "call":
            frames.append(frame.f_code.co_filename)
        return None

    sys.setprofile(tracer)
    try:
        with torch.no_grad():
            again = compiled(x)
    finally:
        sys.setprofile(None)
    torch.testing.assert_close(again, first)
    own = [f for f in frames if "/tilesmith/" in f.replace("\\", "/") and "/tests/" not in f]
    assert own == [], own[:5]
