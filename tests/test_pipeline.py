"""End-to-end pipeline in CPU test mode: capture → track → gate → install, through tilesmith.compile."""

from __future__ import annotations

import json

import pytest
import torch

import tilesmith
from tests.models import MulSum, TwoLayer, graph_break_fn, has_mulsum_loop, mm_instead_of_loop
from tests.scripted import ScriptedFactory, comment


@pytest.fixture(autouse=True)
def test_mode(cpu_test_mode):
    return cpu_test_mode


def _tracks(root):
    return sorted(p.parent for p in root.glob("runs/*/*/track.json"))


def _track_json(track):
    return json.loads((track / "track.json").read_text())


def test_inference_graph_gets_one_track_with_attempt_and_fx_program(test_mode):
    model = TwoLayer().eval()
    x = torch.randn(8, 64)
    factory = ScriptedFactory()
    compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=factory)
    with torch.no_grad():
        out = compiled(x)
        torch.testing.assert_close(out, model(x))
    tracks = _tracks(test_mode)
    assert len(tracks) == 1
    state = _track_json(tracks[0])
    assert state["kind"] == "inference" and state["status"] == "kept_inductor"
    assert len(tracks[0].name) == 64 and all(c in "0123456789abcdef" for c in tracks[0].name)
    attempt = (tracks[0] / "attempts" / "attempt_00.py").read_text()
    assert attempt.startswith("# ---- FX program")
    assert "def call(self, args):" in attempt and "# kernel path:" not in attempt
    assert (tracks[0] / "program.fx.txt").read_text().strip()
    assert [d.kind for d in tilesmith.diagnostics(compiled)] == ["no_improvement"]
    assert tilesmith.benchmarks(compiled) == ()


def test_training_gets_forward_and_backward_tracks(test_mode):
    model = TwoLayer()
    x = torch.randn(8, 64)
    compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=ScriptedFactory())
    out = compiled(x)
    assert len(_tracks(test_mode)) == 1  # the backward is compiled lazily, at the first .backward()
    out.sum().backward()
    kinds = sorted(_track_json(t)["kind"] for t in _tracks(test_mode))
    assert kinds == ["backward", "forward"]


def test_graph_break_gives_two_tracks(test_mode):
    x = torch.randn(16)
    compiled = tilesmith.compile(graph_break_fn, example_inputs=(x,), agent_model=ScriptedFactory())
    torch.testing.assert_close(compiled(x), graph_break_fn(x))
    assert len(_tracks(test_mode)) == 2


def test_installed_graph_matches_plain_torch_compile_forward_and_gradients(test_mode):
    torch.manual_seed(0)
    model = MulSum()
    reference = MulSum()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(64, 512)
    factory = ScriptedFactory(edits=[lambda t: mm_instead_of_loop(t) if has_mulsum_loop(t) else comment("noop")(t)])
    compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=factory, loops=1)
    plain = torch.compile(reference)
    out = compiled(x)
    records = tilesmith.benchmarks(compiled)
    assert [r.kind for r in records] == ["forward"], tilesmith.diagnostics(compiled)
    assert records[0].speedup > 1.02 and records[0].tilesmith_ms < records[0].torch_inductor_ms
    # Later calls use the installed module: same values as plain torch.compile, and gradients flow.
    x2 = torch.randn(64, 512, requires_grad=True)
    x3 = x2.detach().clone().requires_grad_(True)
    out2, ref2 = compiled(x2), plain(x3)
    torch.testing.assert_close(out2, ref2, rtol=1e-5, atol=1e-5)
    out2.square().sum().backward()
    ref2.square().sum().backward()
    torch.testing.assert_close(x2.grad, x3.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model.w.grad, reference.w.grad, rtol=1e-4, atol=1e-5)
    forward_track = next(t for t in _tracks(test_mode) if t.name == records[0].graph_key)
    state = _track_json(forward_track)
    assert state["status"] == "installed" and state["benchmark"]["speedup"] == pytest.approx(records[0].speedup)
    assert state["evaluations"][0]["accepted"] and (forward_track / state["evaluations"][0]["report"]).exists()
    del out


class _RejectingGate:
    """Stands in for the gate where only the ring is under test (every candidate rejected, instantly)."""

    def __init__(self, problem, **_):
        self.evaluated = []

    def evaluate(self, candidate, incumbent=None):
        from tilesmith.records import Verdict

        self.evaluated.append(candidate)
        return Verdict(accepted=False, status="rejected_slower", reasons=("stub",), evaluation_id=f"e{len(self.evaluated)}")

    def recheck(self, candidate):
        return self.evaluate(candidate)

    def close(self):
        pass


def test_attempt_ring_keeps_five_rolling_files_after_six_turns(test_mode, monkeypatch):
    import tilesmith.gate

    monkeypatch.setattr(tilesmith.gate, "Gate", _RejectingGate)
    model = TwoLayer().eval()
    x = torch.randn(8, 64)
    edits = [comment(f"turn {i}") for i in range(1, 7)]
    factory = ScriptedFactory(edits=edits)
    compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=factory)
    with torch.no_grad():
        compiled(x)
    (track,) = _tracks(test_mode)
    files = sorted(p.name for p in (track / "attempts").iterdir())
    assert files == [f"attempt_{i:02d}.py" for i in range(5)]
    texts = [(track / "attempts" / f).read_text() for f in files]
    # Six turns after attempt_00: turns 2..6 remain, oldest first; each turn started from the previous one.
    for i, text in enumerate(texts, start=2):
        assert text.rstrip().endswith(f"# turn {i}")
        assert all(f"# turn {j}" in text for j in range(1, i + 1))
    assert _track_json(track)["turns"] == 6


def test_identical_wrapper_recompiled_in_one_run_reuses_the_first_outcome(test_mode):
    torch.manual_seed(0)
    model = MulSum().eval()
    x = torch.randn(64, 512)
    factory = ScriptedFactory(edits=[mm_instead_of_loop])
    compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=factory)
    with torch.no_grad():
        first = compiled(x)
    with torch.inference_mode():  # a Dynamo guard fails: recompile, the very same Inductor wrapper again
        second = compiled(x)
    torch.testing.assert_close(first, second, rtol=1e-5, atol=1e-5)
    kinds = [d.kind for d in tilesmith.diagnostics(compiled)]
    records = tilesmith.benchmarks(compiled)
    assert len(factory.sessions) == 1, "the optimizer ran once"
    assert kinds.count("duplicate_graph") == 1 and len(records) == 2
    assert records[0].graph_key == records[1].graph_key and records[0].speedup == records[1].speedup
    assert len(_tracks(test_mode)) == 1


def test_an_unwritable_cache_root_still_optimizes_and_installs(test_mode, monkeypatch, tmp_path):
    """``TILESMITH_CACHE_DIR`` names a regular file (a new user's mistake, or a read-only mount): the run's records
    go to a temporary folder instead, one ``disk_unwritable`` diagnostic says so, and the graph is still optimized
    and installed — no ``internal_error``, no traceback into the user's call (new-user trial, session 19)."""
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("TILESMITH_CACHE_DIR", str(blocked))
    torch.manual_seed(0)
    model = MulSum()
    x = torch.randn(64, 512)
    factory = ScriptedFactory(edits=[lambda t: mm_instead_of_loop(t) if has_mulsum_loop(t) else comment("noop")(t)])
    compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=factory, loops=1)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    kinds = [d.kind for d in tilesmith.diagnostics(compiled)]
    assert "internal_error" not in kinds and kinds.count("disk_unwritable") == 1, tilesmith.diagnostics(compiled)
    unwritable = next(d for d in tilesmith.diagnostics(compiled) if d.kind == "disk_unwritable")
    assert "temporary folder" in unwritable.message and "TILESMITH_CACHE_DIR" in unwritable.message
    assert [r.kind for r in tilesmith.benchmarks(compiled)] == ["inference"], tilesmith.diagnostics(compiled)
    assert blocked.read_text() == "not a folder"


def test_show_and_report_state_the_cpu_gates_own_bar(test_mode):
    """In CPU test mode the gate asks more than min_improvement (a per-process allowance): `tilesmith show` and the
    report say what, and the report's threshold line is drawn there for CPU-only runs (new-user trial 19: a 1.14×
    rejection looked wrong next to a '+2 %' line)."""
    import io

    from tilesmith.cli.main import main
    from tilesmith.gate.host.stats import CPU_PROCESS_ALLOWANCE

    model = TwoLayer().eval()
    x = torch.randn(8, 64)
    compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=ScriptedFactory())
    with torch.no_grad():
        compiled(x)
    (run,) = [p.name for p in (test_mode / "runs").iterdir()]
    doc = json.loads((test_mode / "runs" / run / "run.json").read_text())
    assert doc["cpu_gate_bar"] == {"median_at_least": 1 + max(0.02, CPU_PROCESS_ALLOWANCE),
                                   "ci_low_above": 1 + CPU_PROCESS_ALLOWANCE / 2}
    out = io.StringIO()
    assert main(["--root", str(test_mode), "show", run], out=out) == 0
    assert f"median speedup >= {1 + CPU_PROCESS_ALLOWANCE:g}x" in out.getvalue()
    out = io.StringIO()
    assert main(["--root", str(test_mode), "report", run], out=out) == 0
    html = (test_mode / "runs" / run / "report.html").read_text()
    assert "CPU test-mode graphs: the gate accepts a median speedup &gt;= 1.15x" in html


def test_ctrl_c_during_first_call_optimization_leaves_a_diagnostic_and_a_decided_track(test_mode):
    """Ctrl-C in the first call propagates, and the graph's fate is said: before, diagnostics() was empty for
    the rest of the process and track.json kept ``status: optimizing`` (``tilesmith show`` said "optimizing")."""
    def interrupt(text):
        raise KeyboardInterrupt

    model = TwoLayer().eval()
    x = torch.randn(8, 64)
    compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=ScriptedFactory(edits=[interrupt]))
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        compiled(x)
    (track,) = _tracks(test_mode)
    assert _track_json(track)["status"] == "kept_inductor"
    (diagnostic,) = tilesmith.diagnostics(compiled)
    assert diagnostic.kind == "optimization_interrupted"
    assert f"graph {track.name[:8]} (" in diagnostic.message and "Remedy:" in diagnostic.message
    assert [d["kind"] for d in _track_json(track)["diagnostics"]] == ["optimization_interrupted"]
    with torch.no_grad():  # the graph runs on Inductor from here on; no second optimization
        torch.testing.assert_close(compiled(x), model(x))
    assert [d.kind for d in tilesmith.diagnostics(compiled)] == ["optimization_interrupted"]
