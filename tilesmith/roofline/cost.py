"""Roofline cost model of a captured graph: the bytes it must move and the FLOPs it must run, and its floor
against a device's measured copy bandwidth and matrix-multiply rate (:class:`DeviceLimits`).

What is counted (a *lower bound*: no correct implementation of the graph can be faster):

* **Bytes.** Every graph input (placeholder, or ``self.<constant>`` attribute) that some computing node
  reads is read once; every graph output is written once; an input that ``aten.copy_`` overwrites
  (an input mutation) is written once. Intermediates cost nothing (perfect fusion). Refinements, each
  keeping the bound a lower bound:

  - an output that is an input, or a view of one (``view``/``permute``/``slice``/``split``… chains),
    is an alias and is not written; an input that is only returned (the training forward returns
    ``primals_*`` for the backward) is not read;
  - an input read only through views is charged the elements those views expose (at most its size);
    an input read as the table of a gather (``embedding``, ``index.Tensor``, ``index_select``,
    ``gather``) is charged at most the gathered output's size;
  - a tensor's size is its number of *distinct* elements, ``min(numel, 1 + Σ (size_i - 1)·|stride_i|)``,
    so an ``expand``-ed input counts once.

* **FLOPs.** Matrix products, convolutions and attention, counted by PyTorch's own formulas
  (:data:`torch.utils.flop_counter.flop_registry`: ``mm``/``addmm``/``bmm``/``baddbmm``/``_scaled_mm``
  as ``2·M·N·K``, ``convolution`` and ``convolution_backward``, the SDPA forward and backward variants).
  Causal attention (``is_causal=True``) is charged half of the full count, since a kernel may skip the
  masked half of the score matrix. Pointwise and reduction arithmetic is not counted: it is always far
  under the memory time on the GPUs Tilesmith targets.

* **Rates.** FLOPs run at the measured matrix rate of their operand dtype: bf16/fp16 at the bf16 rate,
  fp32/fp64 at the fp32 rate measured under the process's current TF32 setting (the setting the graph's
  own matmuls run under), 8-bit float types at twice the bf16 rate (the Hopper datasheet ratio; not
  measured). ``floor = max(bytes / copy_bandwidth, Σ flops_d / rate_d)``.

Why parse text: :class:`~tilesmith.records.CapturedGraph` carries the FX program as readable text
(``print_readable(include_stride=True, include_device=True)``); Inductor's own estimates (scheduler
read/write sizes) exist only during compilation and are not kept in the record. The limits come from
:func:`tilesmith.roofline.measure.measure_device_limits` (measured on the device in the same run, not taken from a
data sheet). This module measures nothing: it needs no device (torch only for dtypes and FLOP formulas, on the
``meta`` device).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tilesmith.fx_text import DType, FxTextError, Meta, Node, Ref, parse_fx
from tilesmith.records import CapturedGraph, InputSpec, RooflineFloor, TensorSpec

__all__ = ["DeviceLimits", "GraphCost", "RooflineParseError", "floor_from_cost", "floor_from_fx", "graph_cost",
           "roofline_floor"]


class RooflineParseError(ValueError):
    """The FX program text cannot be costed (symbolic shapes, unknown annotation, no ``forward``)."""


@dataclass(frozen=True)
class DeviceLimits:
    """Measured ceilings of one device. Rates use SI units: 1 GB/s = 1e9 B/s, 1 TFLOP/s = 1e12 FLOP/s."""

    device: str
    """``str(torch.device)`` the limits were measured on, e.g. ``"cuda:0"``."""
    device_name: str
    copy_gbps: float
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    matmul_bf16_tflops: float
    matmul_fp32_tflops: float
    """fp32 ``torch.mm`` rate under the TF32 setting current at measurement time."""
    method: str = "cuda_event"
    """``"cuda_event"`` on GPUs; ``"host_clock"`` in CPU test mode."""
    copy_bytes: int = 0
    """Size of the copied buffer (bytes read; as many are written)."""
    matmul_sizes: tuple[tuple[str, int], ...] = ()
    """``(dtype, n)`` of the ``n×n×n`` products timed."""
    allow_tf32: bool = False
    measured_s: float = 0.0
    """Wall-clock seconds the measurement took."""

    def tflops_for(self, dtype: str) -> float:
        """Matrix rate (TFLOP/s) that FLOPs with operands of ``dtype`` (FX abbreviation or ``torch.*`` name) run at."""
        d = _short_dtype(dtype)
        if d in ("bf16", "f16"):
            return self.matmul_bf16_tflops
        if d.startswith("f8") or d in ("i8", "u8"):
            return 2.0 * self.matmul_bf16_tflops
        return self.matmul_fp32_tflops


@dataclass(frozen=True)
class GraphCost:
    """What a graph must do at the least, independent of the device."""

    bytes_read: int
    bytes_written: int
    flops_by_dtype: tuple[tuple[str, int], ...]
    """``(operand dtype abbreviation, FLOPs)`` per dtype, e.g. ``(("bf16", 2 * 8192 * 768 * 2304),)``."""
    flop_ops: tuple[tuple[str, int], ...] = field(default=())
    """``(node name, FLOPs)`` of every counted node, in graph order (for reports and tests)."""

    @property
    def bytes_moved(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def flops(self) -> int:
        return sum(f for _, f in self.flops_by_dtype)


# ---------------------------------------------------------------------------------------------- parsing

_VIEW_OPS = frozenset({
    "aten.view", "aten._unsafe_view", "aten.reshape", "aten.permute", "aten.transpose", "aten.t",
    "aten.expand", "aten.unsqueeze", "aten.squeeze", "aten.slice", "aten.select", "aten.as_strided",
    "aten.alias", "aten.detach", "aten.narrow", "aten.diagonal", "aten.view_as_real",
    "aten.view_as_complex", "aten.unfold", "aten.lift_fresh", "prims.view_of",
})
_MULTI_VIEW_OPS = frozenset({"aten.split", "aten.split_with_sizes", "aten.unbind", "aten.chunk",
                             "aten.tensor_split"})
# op -> index of the argument whose reads are bounded by the output size
_GATHER_OPS = {"aten.embedding": 0, "aten.index": 0, "aten.index_select": 0, "aten.gather": 0,
               "aten.take": 0}


def _distinct_elements(shape: Sequence[int], stride: Sequence[int]) -> int:
    numel = math.prod(shape)
    if numel == 0:
        return 0
    span = 1 + sum((s - 1) * abs(st) for s, st in zip(shape, stride, strict=False))
    return min(numel, span)


def _short_dtype(dtype: str) -> str:
    """``"torch.bfloat16"`` → ``"bf16"`` (FX's abbreviations); abbreviations pass through."""
    if not dtype.startswith("torch."):
        return dtype
    import torch
    from torch.fx.graph import dtype_abbrs

    return dtype_abbrs.get(getattr(torch, dtype[len("torch."):], None), dtype)


def _torch_dtype(abbr: str) -> Any:
    from torch.fx.graph import dtype_abbrs

    found = next((dt for dt, name in dtype_abbrs.items() if name == abbr), None)
    if found is None:
        raise RooflineParseError(f"unknown dtype abbreviation {abbr!r} in FX annotation")
    return found


def _itemsize(abbr: str) -> int:
    return int(_torch_dtype(abbr).itemsize)


def _meta_from_spec(spec: InputSpec) -> Meta | None:
    if not isinstance(spec, TensorSpec):
        return None
    return Meta(_short_dtype(spec.dtype), tuple(spec.shape), tuple(spec.stride), spec.device)


def _parse(fx_program: str) -> tuple[dict[str, Node], tuple[str, ...], tuple[Any, ...]]:
    """Nodes by name, placeholder names in order, and the returned values (:func:`tilesmith.fx_text.parse_fx`).

    Raises:
        RooflineParseError: text without ``forward``, a symbolic annotation, or a dtype torch does not know.
    """
    try:
        graph = parse_fx(fx_program)
    except FxTextError as exc:
        raise RooflineParseError(str(exc)) from None
    if graph.symbolic:
        name = graph.symbolic[0]
        raise RooflineParseError(f"symbolic annotation of {name}: dynamic shapes have no fixed roofline floor")
    for node in graph.nodes.values():
        if node.meta is not None:
            _itemsize(node.meta.dtype)  # raises for a dtype abbreviation torch does not know
    return graph.nodes, graph.placeholders, graph.returned


def _refs(values: Any) -> list[tuple[int, Ref]]:
    """``(top-level argument position, ref)`` for every node reference inside ``values``."""
    out: list[tuple[int, Ref]] = []
    for pos, v in enumerate(values):
        stack = [v]
        while stack:
            x = stack.pop()
            if isinstance(x, Ref):
                out.append((pos, x))
            elif isinstance(x, tuple):
                stack.extend(x)
    return out


# ------------------------------------------------------------------------------------------- counting

def graph_cost(fx_program: str, inputs: Sequence[InputSpec] | None = None) -> GraphCost:
    """Bytes and FLOPs a graph must at least move and run (see the module docstring for the rules).

    Args:
        fx_program: ``print_readable(include_stride=True, include_device=True)`` text of the graph as it
            reached Inductor (``CapturedGraph.fx_program``).
        inputs: the graph's input specs; when given and as many as the placeholders, they override the
            placeholder annotations (shapes, strides, dtypes).

    Raises:
        RooflineParseError: symbolic (dynamic) shapes, an unknown dtype, or text without ``forward``.
    """
    nodes, placeholders, returned = _parse(fx_program)
    if inputs is not None and len(inputs) == len(placeholders):
        for name, spec in zip(placeholders, inputs, strict=True):
            meta = _meta_from_spec(spec)
            if meta is not None:
                _itemsize(meta.dtype)
                nodes[name].meta = meta

    base_cache: dict[str, str] = {}

    def base(name: str) -> str:
        """The node whose storage ``name`` views (itself when it is not a view)."""
        if name in base_cache:
            return base_cache[name]
        node, seen = nodes.get(name), name
        result = name
        if node is not None:
            if node.kind == "call" and node.packet in _VIEW_OPS and node.args and isinstance(node.args[0], Ref):
                result = base(node.args[0].name)
            elif node.kind == "getitem" and node.source in nodes:
                src = nodes[node.source]
                if src.kind == "call" and src.packet in _MULTI_VIEW_OPS and src.args and isinstance(src.args[0], Ref):
                    result = base(src.args[0].name)
        base_cache[seen] = result
        return result

    def is_input(name: str) -> bool:
        node = nodes.get(name)
        return node is not None and node.kind in ("input", "attr")  # attr: a constant or frozen parameter

    def nbytes(name: str) -> int:
        """Bytes of the distinct elements of node ``name`` (0 without a tensor annotation)."""
        node = nodes.get(name)
        if node is None or node.meta is None:
            return 0
        return _distinct_elements(node.meta.shape, node.meta.stride) * _itemsize(node.meta.dtype)

    full: set[str] = set()
    partial: dict[str, int] = {}
    written: dict[str, int] = {}
    flops: dict[str, int] = {}
    flop_ops: list[tuple[str, int]] = []
    for node in nodes.values():
        if node.kind != "call" or node.packet in _VIEW_OPS or node.packet in _MULTI_VIEW_OPS:
            continue
        gather_arg = _GATHER_OPS.get(node.packet)
        for pos, ref in _refs(node.args) + _refs(tuple(node.kwargs.values())):
            b = base(ref.name)
            if not is_input(b):
                continue
            if node.packet == "aten.copy_" and pos == 0:
                written[b] = max(written.get(b, 0), nbytes(ref.name))  # input mutation: written, not read
            elif gather_arg == pos:
                partial[b] = partial.get(b, 0) + min(nbytes(node.name) or nbytes(ref.name), nbytes(ref.name))
            elif ref.name != b:
                partial[b] = partial.get(b, 0) + nbytes(ref.name)
            else:
                full.add(b)
        count = _node_flops(node, nodes)
        if count:
            dtype = _operand_dtype(node, nodes)
            flops[dtype] = flops.get(dtype, 0) + count
            flop_ops.append((node.name, count))

    bytes_read = 0
    for name in {*full, *partial}:
        whole = nbytes(name)
        bytes_read += whole if name in full else min(whole, partial[name])

    for value in returned:
        if not isinstance(value, Ref):
            continue
        b = base(value.name)
        if is_input(b):
            continue  # an input or a view of one: an alias, nothing to write
        written[b] = max(written.get(b, 0), nbytes(value.name))
    return GraphCost(bytes_read=bytes_read, bytes_written=sum(written.values()),
                     flops_by_dtype=tuple(sorted(flops.items())), flop_ops=tuple(flop_ops))


def _operand_dtype(node: Node, nodes: dict[str, Node]) -> str:
    for _, ref in _refs(node.args):
        src = nodes.get(ref.name)
        if src is not None and src.meta is not None:
            return src.meta.dtype
    return node.meta.dtype if node.meta is not None else "bf16"


def _node_flops(node: Node, nodes: dict[str, Node]) -> int:
    """FLOPs of one call node by PyTorch's flop formulas; 0 for ops without one."""
    if not node.op.startswith("aten."):
        return 0
    import torch
    from torch.utils.flop_counter import flop_registry

    parts = node.op.split(".")
    packet = getattr(torch.ops.aten, parts[1], None)
    formula = _extra_formula(parts[1]) if packet is not None and packet not in flop_registry else None
    if packet is None or (packet not in flop_registry and formula is None):
        return 0
    formula = formula or flop_registry[packet]

    def meta_tensor(name: str) -> Any:
        src = nodes.get(name)
        if src is None:
            return None
        if src.meta is None:  # a tuple-valued node: rebuild from its getitems
            items = {n.index: n for n in nodes.values() if n.kind == "getitem" and n.source == name}
            if not items:
                return None
            return tuple(meta_tensor(items[i].name) if i in items else None for i in range(max(items) + 1))
        return torch.empty_strided(src.meta.shape, src.meta.stride, dtype=_torch_dtype(src.meta.dtype),
                                   device="meta")

    def convert(v: Any) -> Any:
        if isinstance(v, Ref):
            return meta_tensor(v.name)
        if isinstance(v, tuple):
            return [convert(x) for x in v]
        return None if isinstance(v, DType) else v  # dtypes are irrelevant to the formulas

    args = [convert(a) for a in node.args]
    kwargs = {k: convert(v) for k, v in node.kwargs.items()}
    try:
        count = int(formula(*args, out_val=meta_tensor(node.name), **kwargs))
    except Exception as exc:  # noqa: BLE001 - a formula that cannot read these arguments
        raise RooflineParseError(f"cannot count FLOPs of {node.name} = {node.op}: {exc}") from None
    if _is_causal(node, packet, parts):
        count //= 2
    return count


def _extra_formula(op: str) -> Any:
    """Formulas PyTorch's registry lacks: the CPU flash-attention ops (CPU test mode graphs)."""
    from torch.utils import flop_counter

    if op == "_scaled_dot_product_flash_attention_for_cpu":
        def forward(q: Any, k: Any, v: Any, *_: Any, out_val: Any = None, **__: Any) -> int:
            return flop_counter.sdpa_flop_count(q.shape, k.shape, v.shape)
        return forward
    if op == "_scaled_dot_product_flash_attention_for_cpu_backward":
        def backward(g: Any, q: Any, k: Any, v: Any, *_: Any, out_val: Any = None, **__: Any) -> int:
            return flop_counter.sdpa_backward_flop_count(g.shape, q.shape, k.shape, v.shape)
        return backward
    return None


def _is_causal(node: Node, packet: Any, parts: list[str]) -> bool:
    if "is_causal" in node.kwargs:
        return bool(node.kwargs["is_causal"])
    overload = getattr(packet, parts[2] if len(parts) > 2 else "default", None)
    schema = getattr(overload, "_schema", None)
    for i, arg in enumerate(getattr(schema, "arguments", ()) or ()):
        if arg.name == "is_causal":
            return i < len(node.args) and node.args[i] is True
    return False


# -------------------------------------------------------------------------------------------- floors

def floor_from_cost(cost: GraphCost, limits: DeviceLimits) -> RooflineFloor:
    """The floor of ``cost`` on a device with ``limits``.

    ``floor_ms = max(bytes_moved / copy_gbps, Σ flops_d / rate_d)``; ``flops_tflops`` in the record is the
    effective matrix rate ``flops / compute time`` (the bf16 rate when the graph runs no matrix FLOPs).
    """
    memory_s = cost.bytes_moved / (limits.copy_gbps * 1e9)
    compute_s = sum(f / (limits.tflops_for(d) * 1e12) for d, f in cost.flops_by_dtype)
    total = cost.flops
    rate = total / compute_s / 1e12 if compute_s > 0 else limits.matmul_bf16_tflops
    return RooflineFloor(bytes_moved=cost.bytes_moved, flops=total, bandwidth_gbps=limits.copy_gbps,
                         flops_tflops=rate, floor_ms=1e3 * max(memory_s, compute_s))


def floor_from_fx(fx_program: str, limits: DeviceLimits,
                  inputs: Sequence[InputSpec] | None = None) -> RooflineFloor | None:
    """:func:`graph_cost` then :func:`floor_from_cost`; ``None`` when the text cannot be costed."""
    try:
        return floor_from_cost(graph_cost(fx_program, inputs), limits)
    except RooflineParseError:
        return None


def roofline_floor(graph: CapturedGraph, limits: DeviceLimits) -> RooflineFloor | None:
    """Roofline floor of a captured graph (``None`` for dynamic-shape or uncostable programs).

    Never raises for content reasons: a graph whose FX text cannot be costed simply has no floor.
    """
    return floor_from_fx(graph.fx_program, limits, graph.inputs)
