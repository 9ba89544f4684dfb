"""Build the frozen :class:`~tilesmith.records.CapturedGraph` from what ``inner_compile`` saw."""

from __future__ import annotations

import dataclasses
from typing import Any

from tilesmith.capture.backend import AOT_CACHE_HIT
from tilesmith.capture.fxgraph import FX_MODULE_KEY
from tilesmith.capture.source import canonicalize, graph_name
from tilesmith.records import CapturedGraph, GraphKind, InputSpec, ScalarSpec, TensorSpec


def captured_graph(compiled: Any, fx_program: str, example_inputs: Any, kwargs: dict[str, Any],
                   *, compile_mode: str | None = None) -> CapturedGraph:
    """Describe an eligible ``CompiledFxGraph`` (checked by :mod:`tilesmith.capture.eligibility` first).

    For a graph an AOTAutograd cache hit loaded (``kwargs[AOT_CACHE_HIT]``), ``example_inputs`` are not the
    graph's own inputs: the record then has ``inputs=()`` and ``static_input_idxs=()`` until
    :func:`with_real_inputs` fills them from the graph's first real call.
    """
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
    inputs = () if kwargs.get(AOT_CACHE_HIT) else tuple(input_spec(x) for x in example_inputs)
    return CapturedGraph(
        name=name,
        kind=kind,
        source=source,
        canonical_source=canonicalize(source),
        fx_program=fx_program,
        inputs=inputs,
        output_strides=strides,
        mutated_input_idxs=tuple(sorted(int(i) for i in (getattr(compiled, "mutated_input_idxs", None) or ()))),
        inputs_to_check=tuple(int(i) for i in (getattr(compiled, "inputs_to_check", None) or ())),
        device=device,
        inductor_key=getattr(compiled, "_fx_graph_cache_key", None),
        compile_mode=compile_mode,
        constant_names=tuple(sorted(str(k) for k in constants)),
        static_input_idxs=static_inputs(kwargs, inputs),
        fx_module=kwargs.get(FX_MODULE_KEY),
    )


def with_real_inputs(graph: CapturedGraph, args: Any, kwargs: dict[str, Any]) -> CapturedGraph:
    """``graph`` with ``inputs`` (and ``static_input_idxs``) taken from the tensors and scalars of a real call.

    For static-shape graphs (the only eligible ones) Dynamo guards sizes, strides and dtypes, so a real call's
    specs equal the fake example inputs' ``inner_compile`` would have seen; the storage offset is the real one.

    Args:
        graph: the record built by :func:`captured_graph` for an AOTAutograd cache hit (``inputs=()``).
        args: the graph's real arguments, in ``call(args)`` order (tensors of any shape/dtype/device, or numbers).
        kwargs: the kwargs the capture hook reported (Inductor's stored ``fx_kwargs``; ``static_input_idxs``).

    Raises:
        TypeError: an argument is neither a tensor nor convertible to ``int`` (the caller,
            ``LiveRun._inputs_from_call``, accepts tensor-only argument lists and catches the rest).
    """
    inputs = tuple(input_spec(x) for x in args)
    return dataclasses.replace(graph, inputs=inputs, static_input_idxs=static_inputs(kwargs, inputs))


def static_inputs(kwargs: dict[str, Any], inputs: tuple[InputSpec, ...] | list[Any]) -> tuple[int, ...]:
    """The ``static_input_idxs`` Inductor passed to ``inner_compile`` for a forward or inference graph.

    ``kwargs`` are the ``inner_compile`` keyword arguments (on torch 2.11
    ``compile_fx_forward`` and the inference path pass the parameter/buffer indices from
    ``fw_metadata.static_input_indices``, ``torch/_inductor/compile_fx.py:get_static_input_idxs``);
    ``inputs`` the graph's input specs (or example values), used to keep only indices of tensor inputs.

    Returns ``()`` for backward graphs (``compile_fx_backward`` passes ``range(count_tangents)``: saved
    activations whose addresses change between training steps, so treating them as static would overstate
    a CUDA-graph candidate's gain) and when Inductor's ``freezing`` is on (``fw_compiler_freezing`` passes
    indices into the argument list *before* frozen parameters were dropped, which do not match the
    wrapper's inputs). Out-of-range, duplicate and non-integer entries are dropped.
    """
    if graph_kind(kwargs) == "backward":
        return ()
    try:
        from torch._inductor import config as inductor_config

        if bool(getattr(inductor_config, "freezing", False)):
            return ()
    except ImportError:  # pragma: no cover - torch without Inductor
        return ()
    found: set[int] = set()
    for i in kwargs.get("static_input_idxs") or ():
        try:
            idx = int(i)
        except (TypeError, ValueError):
            continue
        if 0 <= idx < len(inputs) and _is_tensor(inputs[idx]):
            found.add(idx)
    return tuple(sorted(found))


def _is_tensor(value: Any) -> bool:
    if isinstance(value, TensorSpec):
        return True
    import torch

    return isinstance(value, torch.Tensor)


def graph_kind(kwargs: dict[str, Any]) -> GraphKind:
    """``inference``/``forward``/``backward`` from the ``inner_compile`` kwargs (``is_backward``, ``is_inference``: ``torch/_inductor/compile_fx.py``)."""
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
