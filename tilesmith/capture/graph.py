"""Build the frozen :class:`~tilesmith.records.CapturedGraph` from what ``inner_compile`` saw."""

from __future__ import annotations

from typing import Any

from tilesmith.capture.source import canonicalize, graph_name
from tilesmith.records import CapturedGraph, GraphKind, InputSpec, ScalarSpec, TensorSpec


def captured_graph(compiled: Any, fx_program: str, example_inputs: Any, kwargs: dict[str, Any],
                   *, compile_mode: str | None = None) -> CapturedGraph:
    """Describe an eligible ``CompiledFxGraph`` (checked by :mod:`tilesmith.capture.eligibility` first)."""
    source = str(compiled.source_code)
    kind = graph_kind(kwargs)
    name = graph_name(source) or f"{kwargs.get('graph_id', '?')}_{kind}"
    device_types = sorted(str(d) for d in (getattr(compiled, "device_types", None) or ()))
    device_idxs = sorted(int(i) for i in (getattr(compiled, "device_idxs", None) or ()))
    device = device_types[0] if device_types else "cpu"
    if device == "cuda":
        device = f"cuda:{device_idxs[0] if device_idxs else 0}"
    strides = tuple(None if s is None else tuple(str(x) for x in s)
                    for s in (getattr(compiled, "output_strides", None) or ()))
    constants = getattr(compiled, "constants", None) or {}
    return CapturedGraph(
        name=name,
        kind=kind,
        source=source,
        canonical_source=canonicalize(source),
        fx_program=fx_program,
        inputs=tuple(input_spec(x) for x in example_inputs),
        output_strides=strides,
        mutated_input_idxs=tuple(sorted(int(i) for i in (getattr(compiled, "mutated_input_idxs", None) or ()))),
        inputs_to_check=tuple(int(i) for i in (getattr(compiled, "inputs_to_check", None) or ())),
        device=device,
        inductor_key=getattr(compiled, "_fx_graph_cache_key", None),
        compile_mode=compile_mode,
        constant_names=tuple(sorted(str(k) for k in constants)),
    )


def graph_kind(kwargs: dict[str, Any]) -> GraphKind:
    """``inference``/``forward``/``backward`` from the ``inner_compile`` kwargs (research/inductor.md §1.2)."""
    if kwargs.get("is_backward"):
        return "backward"
    if kwargs.get("is_inference"):
        return "inference"
    return "forward"


def input_spec(value: Any) -> InputSpec:
    """Spec of one (fake or real) input: a tensor's size/stride/dtype/device, or a Python scalar."""
    import torch

    if isinstance(value, torch.Tensor):
        return TensorSpec(shape=tuple(int(s) for s in value.shape), stride=tuple(int(s) for s in value.stride()),
                          dtype=str(value.dtype), device=str(value.device),
                          storage_offset=int(value.storage_offset()))
    if isinstance(value, bool | int | float):
        return ScalarSpec(value=value)
    return ScalarSpec(value=int(value))
