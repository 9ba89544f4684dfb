"""Each ineligible graph kind stays on ordinary Inductor with a stable diagnostic kind naming the graph."""

from __future__ import annotations

import pytest
import torch

import tilesmith
from tests.models import TwoLayer
from tests.scripted import ScriptedFactory
from tilesmith.capture.eligibility import refusal


@pytest.fixture(autouse=True)
def test_mode(cpu_test_mode):
    return cpu_test_mode


def _kinds(compiled):
    return [d.kind for d in tilesmith.diagnostics(compiled)]


@pytest.fixture(scope="module")
def compiled_graph():
    """A real CompiledFxGraph from a CPU compile, to check refusal() on metadata variations."""
    from tilesmith.capture.backend import TilesmithBackend

    seen = []
    torch._dynamo.reset()
    fn = torch.compile(TwoLayer().eval(), backend=TilesmithBackend(lambda c, fx, ex, kw: seen.append((c, ex, kw))))
    with torch.no_grad():
        fn(torch.randn(4, 64))
    torch._dynamo.reset()
    return seen[0]


def test_input_mutation_is_refused_and_outputs_stay_correct(test_mode):
    def mutate(x):
        x.add_(1)
        return x * 2

    x = torch.randn(8)
    compiled = tilesmith.compile(mutate, example_inputs=(x,), agent_model=ScriptedFactory())
    expected = (x + 1) * 2
    torch.testing.assert_close(compiled(x), expected)
    (diag,) = tilesmith.diagnostics(compiled)
    assert diag.kind == "input_mutation" and "[0]" in diag.message and diag.graph_key and diag.graph_key[:8] in diag.message
    assert not list(test_mode.glob("runs/*/*/track.json"))


def test_dynamic_shapes_are_refused(test_mode):
    compiled = tilesmith.compile(torch.sin, example_inputs=(torch.randn(8),), agent_model=ScriptedFactory(),
                                 dynamic=True)
    x = torch.randn(8)
    torch.testing.assert_close(compiled(x), torch.sin(x))
    assert _kinds(compiled) == ["dynamic_shapes"]
    (diag,) = tilesmith.diagnostics(compiled)
    assert "dynamic=False" in diag.message and "automatic dynamic shapes" in diag.message


def test_a_graph_made_dynamic_by_a_new_shape_names_dynamos_automatic_dynamic_shapes(test_mode):
    """No dynamic=True, no mark_dynamic: the second shape makes Dynamo recompile a dynamic graph, which stays on
    Inductor with a diagnostic that says why it became dynamic (a new user was told to avoid mark_dynamic)."""
    compiled = tilesmith.compile(torch.cos, example_inputs=(torch.randn(8),), agent_model=ScriptedFactory())
    for n in (8, 5):
        x = torch.randn(n)
        torch.testing.assert_close(compiled(x), torch.cos(x))
    dynamic = [d for d in tilesmith.diagnostics(compiled) if d.kind == "dynamic_shapes"]
    assert len(dynamic) == 1 and "changes an input's shape" in dynamic[0].message, tilesmith.diagnostics(compiled)
    # which inputs are symbolic, by index (the size s0 is input 0, the tensor of that size input 1)
    assert f"graph {dynamic[0].graph_key[:8]} (" in dynamic[0].message
    assert ("is dynamic (a symbolic number (a size or a Python int argument) at input 0; symbolic sizes or strides "
            "at input 1)") in dynamic[0].message


def test_cpu_graph_without_test_mode_is_refused_as_no_cuda_device(test_mode, monkeypatch):
    monkeypatch.setenv("TILESMITH_ALLOW_CPU", "0")
    model = TwoLayer().eval()
    compiled = torch.compile(model, backend="tilesmith", options={"agent_model": "tilesmith/builtin"})
    with torch.no_grad():
        compiled(torch.randn(4, 64))
    kinds = _kinds(compiled)
    assert kinds == ["no_cuda_device"], kinds


def test_graph_with_no_operations_is_refused_as_empty():
    # Inductor returns make_boxed_func(gm.forward), a plain function, for a graph with no calls.
    kind, message = refusal(lambda args: args, [], {}, allow_cpu=True, label="0_inference")
    assert kind == "empty_graph" and "0_inference" in message


@pytest.mark.parametrize(
    ("overrides", "kwargs", "kind"),
    [
        ({"device_types": {"cpu", "cuda"}}, {}, "mixed_devices"),
        ({"device_types": {"cuda"}, "device_idxs": {0, 1}}, {}, "multiple_gpus"),
        ({}, {"cudagraphs": True}, "already_wrapped"),
        ({}, {"cpp_wrapper": True}, "already_wrapped"),
        ({}, {"aot_mode": True}, "already_wrapped"),
        ({"source_code": "# tilesmith: replaced wrapper\n"}, {}, "already_wrapped"),
        ({"guards_expr": "2 <= L['s0']"}, {}, "dynamic_shapes"),
        ({"mutated_input_idxs": [1]}, {}, "input_mutation"),
        ({"device_types": {"xpu"}}, {}, "unsupported_device"),
    ],
)
def test_refusal_kinds_from_inductor_metadata(compiled_graph, overrides, kwargs, kind):
    compiled, example_inputs, inner_kwargs = compiled_graph
    saved = {k: getattr(compiled, k) for k in overrides}
    try:
        for k, v in overrides.items():
            setattr(compiled, k, v)
        got = refusal(compiled, example_inputs, {**inner_kwargs, **kwargs}, allow_cpu=True, label="abcd1234 (0_inference)")
    finally:
        for k, v in saved.items():
            setattr(compiled, k, v)
    assert got is not None and got[0] == kind
    assert "abcd1234 (0_inference)" in got[1]
    assert "Remedy" in got[1]


def test_eligible_cpu_graph_in_test_mode(compiled_graph):
    compiled, example_inputs, kwargs = compiled_graph
    assert refusal(compiled, example_inputs, kwargs, allow_cpu=True, label="x") is None
    assert refusal(compiled, example_inputs, kwargs, allow_cpu=False, label="x")[0] == "no_cuda_device"
