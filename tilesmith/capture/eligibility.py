"""Which Inductor graphs Tilesmith optimizes, and a stable diagnostic ``kind`` for each refusal.

Eligible: a raw single-GPU CUDA Python wrapper, whatever it embeds (Triton kernels, CUDA
templates, extern calls). Refused, each with the kind below and a message naming the graph and the remedy:

==================  ==========================================================================
kind                when
==================  ==========================================================================
empty_graph         Inductor returned a plain function (the graph has no calls to compile)
already_wrapped     AOTInductor, ``cpp_wrapper``, CUDA graphs / ``reduce-overhead``, or a wrapper
                    Tilesmith already replaced
dynamic_shapes      a SymInt/symbolic size among the inputs, or Inductor recorded shape guards (for a
                    graph an AOTAutograd cache hit loaded: also any non-tensor input at its first
                    call, see ``LiveRun._inputs_from_call``)
mixed_devices       more than one device type in one graph
multiple_gpus       more than one CUDA device index in one graph
input_mutation      the graph mutates its inputs (``mutated_input_idxs`` non-empty)
no_cuda_device      a CPU-only graph (eligible only in test mode, ``TILESMITH_ALLOW_CPU=1``)
unsupported_device  any other device type (xpu, mps, …)
==================  ==========================================================================

Detection reads ``CompiledFxGraph``'s fields (``torch/_inductor/output_code.py``, torch 2.11: ``device_types``,
``device_idxs``, ``mutated_input_idxs``, ``guards_expr``, ``cudagraph_info``, ...) and the ``inner_compile``
keyword arguments, all with ``getattr`` defaults.
"""

from __future__ import annotations

import weakref
from typing import Any

from tilesmith.capture.source import is_tilesmith_source

_PROGRAM = "tilesmith.compile"

#: ``id(compiled) → weakref`` of every ``CompiledFxGraph`` a run has taken over. Kept outside the object: an
#: attribute on it would travel into AOTAutograd's bundled cache entry (``pre_save`` copies the object) and make
#: that entry unpicklable.
_CLAIMED: dict[int, weakref.ref[Any]] = {}


def claim(compiled: Any) -> None:
    """Mark ``compiled`` as taken over by a Tilesmith run (so it is never captured twice)."""
    key = id(compiled)
    try:
        _CLAIMED[key] = weakref.ref(compiled, lambda _ref, k=key: _CLAIMED.pop(k, None))
    except TypeError:  # not weak-referenceable: remember it for the life of the process
        _CLAIMED[key] = lambda compiled=compiled: compiled  # type: ignore[assignment]


def claimed(compiled: Any) -> bool:
    """Whether :func:`claim` was called on this very object."""
    ref = _CLAIMED.get(id(compiled))
    return ref is not None and ref() is compiled


def refusal(compiled: Any, example_inputs: Any, kwargs: dict[str, Any], *, allow_cpu: bool,
            label: str) -> tuple[str, str] | None:
    """Return ``(kind, message)`` when ``compiled`` must stay on ordinary Inductor, else ``None``.

    Args:
        compiled: what ``compile_fx_inner`` returned (a ``CompiledFxGraph`` when eligible).
        example_inputs: the (fake) inputs ``inner_compile`` received.
        kwargs: the ``inner_compile`` keyword arguments (``cudagraphs``, ``cpp_wrapper`` …).
        allow_cpu: ``TILESMITH_ALLOW_CPU`` (CPU graphs become eligible; test mode).
        label: how messages name the graph (its name and, when known, cache-key prefix).
    """
    from tilesmith._compat import compiled_fx_graph_type

    cfx = compiled_fx_graph_type()
    if cfx is None or not isinstance(compiled, cfx):
        if type(compiled).__name__ == "CompiledAOTI" or kwargs.get("aot_mode"):
            return ("already_wrapped",
                    f"graph {label} is an AOTInductor artifact; Tilesmith optimizes Python wrappers only. "
                    f"Remedy: use {_PROGRAM} (or torch.compile) without AOTInductor for this model.")
        return ("empty_graph",
                f"graph {label} has no operations for Inductor to compile (it returned a plain function); "
                "nothing to optimize.")
    source = str(getattr(compiled, "source_code", "") or "")
    wrapped = _wrapped_reason(compiled, source, kwargs)
    if wrapped:
        return ("already_wrapped", f"graph {label} is already wrapped ({wrapped}); it stays on Inductor. "
                "Remedy: compile without mode='reduce-overhead'/'max-autotune' CUDA graphs and without "
                "cpp_wrapper (e.g. mode='max-autotune-no-cudagraphs') to let Tilesmith optimize it.")
    dynamic = _dynamic_inputs(compiled, example_inputs)
    if dynamic:
        return ("dynamic_shapes", f"graph {label} is dynamic ({dynamic}): "
                "Dynamo makes a graph dynamic when a call changes an input's shape or a Python int argument "
                "(automatic dynamic shapes), or because of dynamic=True or torch._dynamo.mark_dynamic. "
                "Tilesmith optimizes static graphs only; it stays on Inductor. Remedy: compile with "
                "dynamic=False, so each shape gets its own static graph (each then pays its own first-call "
                "optimization: TILESMITH_OPTIMIZE=background keeps those calls on Inductor meanwhile).")
    device_types = sorted(str(d) for d in (getattr(compiled, "device_types", None) or ()))
    if len(device_types) > 1:
        return ("mixed_devices", f"graph {label} mixes devices {device_types}; Tilesmith optimizes "
                "single-device graphs. Remedy: move every input of this region to one CUDA device.")
    device_idxs = sorted(int(i) for i in (getattr(compiled, "device_idxs", None) or ()))
    if len(device_idxs) > 1:
        return ("multiple_gpus", f"graph {label} spans CUDA devices {device_idxs}; Tilesmith optimizes "
                "single-GPU graphs. Remedy: keep each compiled region on one GPU.")
    mutated = sorted(int(i) for i in (getattr(compiled, "mutated_input_idxs", None) or ()))
    if mutated:
        return ("input_mutation", f"graph {label} mutates its inputs at indices {mutated} (e.g. in-place "
                "updates or BatchNorm running stats); it stays on Inductor. Remedy: move the in-place "
                "update out of the compiled region, or use eval() mode for BatchNorm inference.")
    device = device_types[0] if device_types else "cpu"
    if device == "cpu" and not allow_cpu:
        return ("no_cuda_device", f"graph {label} runs on the CPU; Tilesmith optimizes CUDA graphs. "
                "Remedy: pass CUDA tensors (and a CUDA model); TILESMITH_ALLOW_CPU=1 enables the CPU test "
                "mode, which is for testing Tilesmith only.")
    if device not in {"cuda", "cpu"}:
        return ("unsupported_device", f"graph {label} runs on '{device}'; Tilesmith optimizes CUDA "
                "graphs only. Remedy: run this model on an NVIDIA GPU.")
    return None


def _wrapped_reason(compiled: Any, source: str, kwargs: dict[str, Any]) -> str | None:
    if kwargs.get("cpp_wrapper") or "cpp_wrapper_src" in source:
        return "cpp_wrapper"
    if kwargs.get("aot_mode"):
        return "AOTInductor"
    if bool(kwargs.get("cudagraphs")) or getattr(compiled, "cudagraph_info", None) is not None:
        return "CUDA graphs (mode='reduce-overhead' or triton.cudagraphs)"
    if is_tilesmith_source(source) or claimed(compiled):
        return "a wrapper Tilesmith already replaced"
    return None


def _dynamic_inputs(compiled: Any, example_inputs: Any) -> str | None:
    """What makes the graph dynamic, naming its inputs by index (``"a symbolic number (...) at input 0; symbolic
    sizes or strides at inputs [1, 2]"``), or Inductor's shape guards when no input shows it; ``None`` when static."""
    import torch

    scalars, tensors = [], []
    for index, value in enumerate(example_inputs or ()):
        if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
            scalars.append(index)
        elif isinstance(value, torch.Tensor):
            try:
                from torch._inductor.utils import any_is_symbolic

                symbolic = any_is_symbolic(value)
            except Exception:  # noqa: BLE001
                symbolic = any(isinstance(s, torch.SymInt) for s in (*value.shape, *value.stride()))
            if symbolic:
                tensors.append(index)
    parts = []
    if scalars:
        parts.append(f"a symbolic number (a size or a Python int argument) at input{'s' if len(scalars) > 1 else ''} "
                     f"{scalars if len(scalars) > 1 else scalars[0]}")
    if tensors:
        parts.append(f"symbolic sizes or strides at input{'s' if len(tensors) > 1 else ''} "
                     f"{tensors if len(tensors) > 1 else tensors[0]}")
    if parts:
        return "; ".join(parts)
    if getattr(compiled, "guards_expr", None):
        return f"Inductor recorded shape guards: {str(compiled.guards_expr)[:120]}"
    return None
