"""tilesmith.compile: argument validation, fallbacks with diagnostics, registered backend."""

from __future__ import annotations

import re

import pytest
import torch

import tilesmith
from tests.models import TwoLayer
from tests.scripted import ScriptedFactory


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("TILESMITH_CACHE_DIR", str(tmp_path / "ts"))
    monkeypatch.delenv("TILESMITH_ALLOW_CPU", raising=False)
    monkeypatch.delenv("TILESMITH_MODEL", raising=False)
    monkeypatch.setenv("TILESMITH_CLIPROXYAPI_EXECUTABLE", str(tmp_path / "no-such-proxy"))
    monkeypatch.setenv("PATH", _path_without_proxy(tmp_path))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


X = torch.randn(4, 64)


def _path_without_proxy(tmp_path):
    """PATH with the compiler kept but no folder holding a CLIProxyAPI executable."""
    import os

    names = ("cliproxyapi", "cli-proxy-api")
    keep = [d for d in os.environ.get("PATH", "").split(os.pathsep)
            if d and not any(os.path.exists(os.path.join(d, n)) for n in names)]
    return os.pathsep.join(keep)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"agency": "extreme"}, ValueError, "low"),
        ({"agency": 3}, TypeError, "agency"),
        ({"loops": 0}, ValueError, ">= 1"),
        ({"loops": 1.5}, TypeError, "loops"),
        ({"loops": True}, TypeError, "loops"),
        ({"max_model_calls": -1}, ValueError, ">= 0"),
        ({"max_model_calls": "70"}, TypeError, "max_model_calls"),
        ({"agent_model": 42}, TypeError, "agent_model"),
        ({"agent_model": "  "}, ValueError, "agent_model"),
        ({"example_inputs": X}, TypeError, "tuple"),
        ({"backend": "inductor"}, ValueError, "backend"),
        ({"agent_model": "tilesmith/bultin"}, ValueError, "did you mean 'tilesmith/builtin'"),
        ({"agent_model": "builtin"}, ValueError, "did you mean 'tilesmith/builtin'"),
        ({"agent_model": "Tilesmith/Builtin"}, ValueError, "spelled 'tilesmith/builtin' exactly"),
    ],
)
def test_invalid_arguments_raise_naming_allowed_values(kwargs, error, words):
    args = {"example_inputs": (X,), "agent_model": "tilesmith/builtin", **kwargs}
    with pytest.raises(error, match=words):
        tilesmith.compile(TwoLayer(), **args)


def test_invalid_min_improvement_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TILESMITH_MIN_IMPROVEMENT", "2%")
    with pytest.raises(ValueError, match="TILESMITH_MIN_IMPROVEMENT"):
        tilesmith.compile(TwoLayer(), example_inputs=(X,), agent_model="tilesmith/builtin")


@pytest.mark.parametrize(
    ("kwargs", "kind", "remedy"),
    [
        ({"agent_model": "tilesmith/builtin"}, "missing_example_inputs", "example_inputs=(x,)"),
        ({"example_inputs": (X,), "agent_model": "tilesmith/builtin"}, "no_cuda_device", "CUDA"),
        ({"example_inputs": (X,)}, None, None),
    ],
)
def test_fallbacks_return_plain_torch_compile_with_a_diagnostic(kwargs, kind, remedy):
    from tilesmith.errors import TilesmithWarning

    model = TwoLayer().eval()
    with pytest.warns(TilesmithWarning, match="falls back to plain torch.compile"):
        compiled = tilesmith.compile(model, **kwargs)
    with torch.no_grad():
        torch.testing.assert_close(compiled(X), model(X))
    assert tilesmith.benchmarks(compiled) == ()
    diags = tilesmith.diagnostics(compiled)
    assert len(diags) == 1
    if kind is not None:
        assert diags[0].kind == kind and remedy in diags[0].message
    else:  # CPU inputs are reported before the missing model
        assert diags[0].kind == "no_cuda_device"


def test_missing_model_fallback_in_test_mode(monkeypatch):
    monkeypatch.setenv("TILESMITH_ALLOW_CPU", "1")
    model = TwoLayer().eval()
    compiled = tilesmith.compile(model, example_inputs=(X,))
    with torch.no_grad():
        torch.testing.assert_close(compiled(X), model(X))
    (diag,) = tilesmith.diagnostics(compiled)
    assert diag.kind == "missing_model" and "TILESMITH_MODEL" in diag.message and "tilesmith/builtin" in diag.message


def test_missing_proxy_fallback_names_the_executable_setting(monkeypatch):
    monkeypatch.setenv("TILESMITH_ALLOW_CPU", "1")
    model = TwoLayer().eval()
    compiled = tilesmith.compile(model, example_inputs=(X,), agent_model="gpt-5.5")
    with torch.no_grad():
        torch.testing.assert_close(compiled(X), model(X))
    (diag,) = tilesmith.diagnostics(compiled)
    assert diag.kind in {"missing_proxy", "missing_credentials"}
    assert "TILESMITH_CLIPROXYAPI_EXECUTABLE" in diag.message or "cli-proxy-api" in diag.message
    assert tilesmith.benchmarks(compiled) == ()
    assert ".." not in diag.message and re.search(r"[.!?…] The model runs on plain torch.compile", diag.message)


def test_the_no_improvement_message_has_single_periods():
    """The last verdict's reason may end in a period ("too small to confirm."): no "confirm.. The graph"."""
    from types import SimpleNamespace

    from tilesmith.optimize import _no_win_message
    from tilesmith.records import Verdict

    last = Verdict(False, "rejected_marginal", ("speedup 1.0100; the gain (if any) is too small to confirm.",))
    session = SimpleNamespace(verdicts=[last], turns_used=3, stop_reason=lambda: "loops_done",
                              track=SimpleNamespace(label="1a2b3c4d (0_inference)"))
    message = _no_win_message(session)
    assert "too small to confirm. The graph stays on Inductor." in message and ".." not in message


@pytest.mark.parametrize("cpu_mode", [False, True])
def test_a_fallback_compile_writes_no_run_folder(monkeypatch, tmp_path, cpu_mode):
    """0 graphs tracked (no CUDA input; no model in test mode): the diagnostics stay in memory only."""
    if cpu_mode:
        monkeypatch.setenv("TILESMITH_ALLOW_CPU", "1")
    model = TwoLayer().eval()
    compiled = tilesmith.compile(model, example_inputs=(X,))
    with torch.no_grad():
        compiled(X)
    assert [d.kind for d in tilesmith.diagnostics(compiled)] == ["missing_model" if cpu_mode else "no_cuda_device"]
    assert not (tmp_path / "ts" / "runs").exists()


def test_run_folder_keeps_diagnostics_until_its_first_track(tmp_path):
    import json

    from tilesmith.records import Diagnostic
    from tilesmith.track.run import RunFolder

    folder = RunFolder(tmp_path, "r1", {"agent_model": None})
    assert folder.add_diagnostic(Diagnostic("not_eligible", "graph 1: on the CPU")) is None
    assert not (tmp_path / "runs").exists()
    assert folder.open() is None
    doc = json.loads((tmp_path / "runs" / "r1" / "run.json").read_text())
    assert doc["agent_model"] is None and [d["kind"] for d in doc["diagnostics"]] == ["not_eligible"]


def test_a_tracked_graph_writes_the_run_folder(monkeypatch, tmp_path):
    import json

    from tilesmith.pipeline import RunOptions

    assert RunOptions(None, "medium", 1, None, False, 0.02).model_name is None  # never "custom:NoneType"
    monkeypatch.setenv("TILESMITH_ALLOW_CPU", "1")
    factory = ScriptedFactory()
    compiled = tilesmith.compile(TwoLayer().eval(), example_inputs=(X,), agent_model=factory)
    assert not (tmp_path / "ts" / "runs").exists()  # compiled, not yet called: nothing tracked
    with torch.no_grad():
        compiled(X)
    (run_json,) = (tmp_path / "ts").glob("runs/*/run.json")
    doc = json.loads(run_json.read_text())
    assert doc["agent_model"] == f"custom:{getattr(factory, 'name', type(factory).__name__)}"
    assert [d["kind"] for d in doc["diagnostics"]] == [d.kind for d in tilesmith.diagnostics(compiled)]
    assert list(run_json.parent.glob("*/track.json"))
    import os
    import socket

    assert (doc["pid"], doc["host"]) == (os.getpid(), socket.gethostname())  # `tilesmith show`: is it still running


def test_model_from_environment_is_used_and_argument_overrides_it(monkeypatch):
    monkeypatch.setenv("TILESMITH_ALLOW_CPU", "1")
    monkeypatch.setenv("TILESMITH_MODEL", "gpt-5.5")
    factory = ScriptedFactory()
    compiled = tilesmith.compile(TwoLayer().eval(), example_inputs=(X,), agent_model=factory)
    with torch.no_grad():
        compiled(X)
    assert len(factory.sessions) == 1  # the argument won over TILESMITH_MODEL (which has no proxy here)


def test_extra_torch_compile_arguments_pass_through(monkeypatch):
    monkeypatch.setenv("TILESMITH_ALLOW_CPU", "1")
    model = TwoLayer().eval()
    compiled = tilesmith.compile(model, example_inputs=(X,), agent_model=ScriptedFactory(), fullgraph=True,
                                 dynamic=False, options={"max_autotune": False})
    with torch.no_grad():
        torch.testing.assert_close(compiled(X), model(X))


def test_registered_backend_captures_graphs(monkeypatch, tmp_path):
    monkeypatch.setenv("TILESMITH_ALLOW_CPU", "1")
    model = TwoLayer().eval()
    compiled = torch.compile(model, backend="tilesmith", options={"agent_model": "tilesmith/builtin", "loops": 1})
    with torch.no_grad():
        torch.testing.assert_close(compiled(X), model(X))
    assert list((tmp_path / "ts").glob("runs/*/*/track.json")), "the graph reached Tilesmith"
    assert tilesmith.diagnostics(compiled), "diagnostics are found from the compiled module"


def test_a_misspelt_builtin_agent_in_the_environment_is_a_settings_error(monkeypatch):
    from tilesmith.errors import SettingsError

    monkeypatch.setenv("TILESMITH_MODEL", "builtin")
    with pytest.raises(SettingsError, match="TILESMITH_MODEL.*did you mean 'tilesmith/builtin'"):
        tilesmith.compile(TwoLayer(), example_inputs=(X,))


def test_asking_about_an_object_tilesmith_did_not_compile_warns():
    """The eager model, or a plain torch.compile result: empty answers, but a warning that says what to pass (a new
    user read the empty tuple as 'nothing to report')."""
    from tilesmith.errors import TilesmithWarning

    model = TwoLayer().eval()
    for ask, empty in ((tilesmith.diagnostics, ()), (tilesmith.benchmarks, ()), (tilesmith.wait, True)):
        with pytest.warns(TilesmithWarning, match=f"tilesmith.{ask.__name__}\\(\\) got a TwoLayer that Tilesmith did "
                                                  "not compile"):
            assert ask(model) == empty
    with pytest.warns(TilesmithWarning):
        compiled = tilesmith.compile(model, agent_model="tilesmith/builtin")  # falls back: no example_inputs
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", TilesmithWarning)
        assert [d.kind for d in tilesmith.diagnostics(compiled)] == ["missing_example_inputs"]



def test_wait_rejects_a_timeout_that_is_not_seconds():
    """tilesmith.wait(m, "5") failed inside the run with "unsupported operand type(s) for +: 'float' and 'str'"."""
    with pytest.warns(tilesmith.errors.TilesmithWarning):
        compiled = tilesmith.compile(TwoLayer().eval(), agent_model="tilesmith/builtin")  # falls back: no inputs
    with pytest.raises(TypeError, match=r"tilesmith.wait: timeout_s must be None \(no limit\) or a number of "
                                        r"seconds, got str '5'"):
        tilesmith.wait(compiled, "5")
    with pytest.raises(TypeError, match="got bool"):
        tilesmith.wait(compiled, True)
    for bad in (-1, float("nan")):
        with pytest.raises(ValueError, match="timeout_s must be >= 0 seconds"):
            tilesmith.wait(compiled, bad)
    assert tilesmith.wait(compiled, 0) is True and tilesmith.wait(compiled, 2.5) is True
    assert tilesmith.wait(compiled) is True
