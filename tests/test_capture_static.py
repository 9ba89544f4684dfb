"""``CapturedGraph.static_input_idxs``: Inductor's parameter/buffer indices, recorded for forward and
inference graphs only, exposed to the gate by ``GateProblem.static_input_idxs`` (CPU compiles)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tilesmith.capture.backend import TilesmithBackend
from tilesmith.capture.graph import captured_graph, static_inputs
from tilesmith.gate.host.problem import GateProblem
from tilesmith.records import CapturedGraph, ScalarSpec, TensorSpec


class _WithParams(torch.nn.Module):
    """Linear(16 → 8) plus a registered buffer: three static inputs (weight, bias, buffer) and one activation."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(16, 8)
        self.register_buffer("shift", torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) + self.shift


def _compile(model: torch.nn.Module, x: torch.Tensor, grad: bool) -> list[tuple[CapturedGraph, dict[str, Any]]]:
    from tests.gate_support import fast_probe, no_compile_caches

    fast_probe()
    seen: list[tuple[CapturedGraph, dict[str, Any]]] = []

    def sink(compiled: Any, fx: str, example_inputs: Any, kwargs: dict[str, Any]) -> None:
        seen.append((captured_graph(compiled, fx, example_inputs, kwargs), dict(kwargs)))

    torch._dynamo.reset()
    try:
        fn = torch.compile(model, backend=TilesmithBackend(sink))
        with no_compile_caches():
            if grad:
                fn(x.requires_grad_()).sum().backward()
            else:
                with torch.no_grad():
                    fn(x)
    finally:
        torch._dynamo.reset()
    return seen


def _param_like(graph: CapturedGraph, model: torch.nn.Module) -> set[int]:
    """Input indices whose shape is a parameter's or buffer's and not the activation's (4×16)."""
    shapes = {tuple(t.shape) for t in [*model.parameters(), *model.buffers()]}
    return {i for i, s in enumerate(graph.inputs) if isinstance(s, TensorSpec) and tuple(s.shape) in shapes}


@pytest.fixture(scope="module")
def training_graphs():
    model = _WithParams()
    return model, _compile(model, torch.randn(4, 16), grad=True)


def test_inference_graph_records_the_parameter_and_buffer_inputs_as_static():
    model = _WithParams().eval()
    (graph, kwargs), = _compile(model, torch.randn(4, 16), grad=False)
    assert graph.kind == "inference"
    assert graph.static_input_idxs, "Inductor's static_input_idxs were not recorded"
    assert set(graph.static_input_idxs) == _param_like(graph, model) and len(graph.static_input_idxs) == 3
    activation = [i for i, s in enumerate(graph.inputs) if isinstance(s, TensorSpec) and tuple(s.shape) == (4, 16)]
    assert activation and not set(activation) & set(graph.static_input_idxs)
    assert tuple(sorted(int(i) for i in kwargs["static_input_idxs"])) == graph.static_input_idxs


def test_training_forward_records_static_inputs_and_backward_records_none(training_graphs):
    model, seen = training_graphs
    by_kind = {g.kind: (g, kw) for g, kw in seen}
    forward, _ = by_kind["forward"]
    backward, bw_kwargs = by_kind["backward"]
    assert set(forward.static_input_idxs) == _param_like(forward, model) and forward.static_input_idxs
    assert list(bw_kwargs.get("static_input_idxs") or ()), "Inductor marks backward inputs static (tangents)"
    assert backward.static_input_idxs == ()


def test_static_inputs_drops_backward_freezing_and_out_of_range_entries():
    spec = TensorSpec((2,), (1,), "torch.float32", "cpu")
    specs = (spec, ScalarSpec(3), spec)
    assert static_inputs({"static_input_idxs": [2, 0, 0, 1, 7, -1]}, specs) == (0, 2)
    assert static_inputs({"static_input_idxs": [0, 2], "is_backward": True}, specs) == ()
    from torch._inductor import config

    with config.patch(freezing=True):  # not monkeypatch: its undo deletes the attribute, which hides the option
        assert static_inputs({"static_input_idxs": [0, 2], "is_inference": True}, specs) == ()
    assert getattr(config, "freezing", None) is False


def _graph(kind: str, **extra: Any) -> CapturedGraph:
    spec = TensorSpec((4, 4), (4, 1), "torch.float32", "cpu")
    return CapturedGraph(name=f"0_{kind}", kind=kind, source="", canonical_source="", fx_program="",
                         inputs=(spec, spec, ScalarSpec(2), spec), output_strides=(), mutated_input_idxs=(3,),
                         inputs_to_check=(), device="cpu", inductor_key=None, **extra)


def test_gate_problem_keeps_static_tensor_inputs_that_are_not_mutated(tmp_path: Path):
    old = _graph("inference")  # a record written before the field existed
    assert old.static_input_idxs == ()
    assert GateProblem("k", old, tmp_path, "").static_input_idxs == ()
    graph = _graph("forward", static_input_idxs=(0, 2, 3))
    assert GateProblem("k", graph, tmp_path, "").static_input_idxs == (0,)  # 2: a scalar, 3: mutated
    backward = _graph("backward", static_input_idxs=(0, 1))
    assert GateProblem("k", backward, tmp_path, "").static_input_idxs == ()

