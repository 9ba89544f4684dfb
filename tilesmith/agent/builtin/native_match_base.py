"""Shared pieces of the native-kernel matchers (:mod:`.native_match`, :mod:`.native_match_groupnorm`).

:class:`NoMatch`, :class:`Arg`, :class:`NativePlan`, the node walker :class:`_Walk` (lookups that raise
:class:`NoMatch` and record every node a pattern uses) and the input-layout helpers. No pattern lives here, so
every matcher module imports this one and none imports another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tilesmith.fx_text import DType, FxGraph, Meta, Node, Ref

FLOATS = ("f32", "bf16", "f16")
#: FX abbreviation -> ``torch.<name>`` (what a generated call passes as a dtype argument).
TORCH_NAME = {"f32": "torch.float32", "bf16": "torch.bfloat16", "f16": "torch.float16"}
#: Most rows of x the int8 kernels take (``csrc/int8_linear_bind.cpp``): decode shapes.
INT8_MAX_M = 16
#: Widest row the norm kernels hold in registers (``csrc/norm.cu``: ``norm_max_d``, every dtype).
NORM_MAX_D = 16384
_VIEWS = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default")
_CONVERT = "prims.convert_element_type.default"


class NoMatch(Exception):
    """The graph is not one of the native patterns; the message says why (per family)."""


@dataclass(frozen=True)
class Arg:
    """One argument of the native call: graph input ``input`` (placeholder index) or Python ``literal``."""

    input: int | None = None
    literal: str | None = None


@dataclass(frozen=True)
class NativePlan:
    """How the whole graph maps onto one native kernel call.

    ``returns``: per FX output, the index into the kernel's list result (``None``: the kernel returns one
    tensor). ``bytes_moved``: bytes the kernel must read and write at the least (for the roofline estimate).
    """

    family: str
    function: str
    args: tuple[Arg, ...]
    returns: tuple[int | None, ...]
    description: str
    bytes_moved: int


def _lit(value: Any) -> Arg:
    return Arg(literal=repr(value))


NONE = Arg(literal="None")


class _Walk:
    """Node lookups that raise :class:`NoMatch`, recording every node the pattern uses."""

    def __init__(self, g: FxGraph):
        self.g = g
        self.used: set[str] = set()

    def call(self, value: Any, *ops: str) -> Node:
        node = self.g.node(value)
        if node is None or node.kind != "call" or (ops and node.op not in ops):
            shown = node.op if node is not None and node.kind == "call" else getattr(value, "name", repr(value))
            raise NoMatch(f"expected {' or '.join(ops) or 'an operation'}, found {shown}")
        self.used.add(node.name)
        return node

    def is_call(self, value: Any, *ops: str) -> bool:
        node = self.g.node(value)
        return node is not None and node.kind == "call" and (not ops or node.op in ops)

    def input_index(self, value: Any) -> int | None:
        node = self.g.node(value)
        if node is None or node.kind != "input":
            return None
        return self.g.placeholders.index(node.name)

    def meta(self, value: Any) -> Meta:
        node = self.g.node(value)
        if node is None or node.meta is None:
            raise NoMatch(f"no tensor annotation for {getattr(value, 'name', value)!r}")
        return node.meta

    def split(self, node: Node, pred: Any) -> tuple[Any, Any]:
        """``(side, other)`` of a binary node's two first arguments, ``side`` the one satisfying ``pred``."""
        if len(node.args) < 2:
            raise NoMatch(f"{node.op} has fewer than two arguments")
        a, b = node.args[0], node.args[1]
        if pred(a):
            return a, b
        if pred(b):
            return b, a
        raise NoMatch(f"{node.name} = {node.op} has no operand of the expected kind")

    def single_output(self) -> Ref:
        if len(self.g.returned) != 1 or not isinstance(self.g.returned[0], Ref):
            raise NoMatch(f"the graph returns {len(self.g.returned)} values (the pattern returns one tensor)")
        return self.g.returned[0]


def _unclone(walk: _Walk, value: Any) -> Any:
    """``value`` with ``aten.clone`` (contiguous copies AOTAutograd inserts for strided inputs) stripped, when
    that reaches a graph input; the kernels read the strided rows directly. Otherwise ``value`` unchanged."""
    cur, clones = value, []
    while walk.is_call(cur, "aten.clone.default"):
        node = walk.g.node(cur)
        fmt = node.kwargs.get("memory_format")
        if fmt not in (None, "torch.contiguous_format", "torch.preserve_format"):
            return value
        clones.append(node.name)
        cur = node.args[0]
    if walk.input_index(cur) is None:
        return value
    walk.used.update(clones)
    return cur


def _upcast_source(walk: _Walk, value: Any) -> Any:
    """What ``value = convert(src, f32)`` upcasts (``value`` itself when it is no conversion).

    Raises:
        NoMatch: ``value`` converts to another dtype than float32.
    """
    if not walk.is_call(value, _CONVERT):
        return value
    conv = walk.call(value)
    if tuple(conv.args[1:2]) != (DType("f32"),):
        raise NoMatch("the statistics' input is not an upcast to float32")
    return conv.args[0]


def _rsqrt_of_eps_add(walk: _Walk) -> tuple[Ref, Any, float]:
    """``(rsqrt node, statistic, eps)`` for the graph's one ``rsqrt(statistic + eps)``.

    Raises:
        NoMatch: not exactly one rsqrt, or its argument is not a sum with a number.
    """
    rsqrts = [n for n in walk.g.calls() if n.op == "aten.rsqrt.default"]
    if len(rsqrts) != 1:
        raise NoMatch(f"{len(rsqrts)} rsqrt operations (the pattern has one)")
    rs = walk.call(Ref(rsqrts[0].name))
    add = walk.call(rs.args[0], "aten.add.Tensor", "aten.add.Scalar")
    eps, stat = walk.split(add, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))
    return Ref(rs.name), stat, float(eps)


def _row_input(walk: _Walk, value: Any, what: str) -> tuple[int, Meta]:
    value = _unclone(walk, value)
    index = walk.input_index(value)
    if index is None:
        raise NoMatch(f"{what} is computed in the graph, not a graph input")
    meta = walk.meta(value)
    if not meta.is_rows():
        raise NoMatch(f"{what} {value.name} is not a row layout (sizes {list(meta.shape)}, strides "
                      f"{list(meta.stride)}): the native kernels need unit inner stride")
    return index, meta


def _vector_input(walk: _Walk, value: Any, n: int) -> bool:
    """A graph input holding ``n`` contiguous elements, broadcast over rows (shape ``[n]`` or ``[1, ..., n]``)."""
    index = walk.input_index(value)
    if index is None:
        return False
    meta = walk.meta(value)
    return (meta.dtype in FLOATS and meta.numel == n and bool(meta.shape) and meta.shape[-1] == n
            and meta.is_contiguous())


def _last_dim(dims: Any, ndim: int) -> bool:
    if isinstance(dims, int):
        dims = (dims,)
    return isinstance(dims, tuple) and len(dims) == 1 and isinstance(dims[0], int) and dims[0] in (-1, ndim - 1)
