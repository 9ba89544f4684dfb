"""Reading a captured FX program (``CapturedGraph.fx_program``) into nodes: the one parser of the roofline cost
model (``tilesmith/roofline/cost.py``) and the native-kernel matcher (``tilesmith/agent/builtin/native_match.py``).

The text is ``GraphModule.print_readable(include_stride=True, include_device=True)`` of the graph as it
reached Inductor (``tilesmith/capture/backend.py``: ``_readable``)::

    def forward(self, arg0_1: "bf16[8192, 4096][4096, 1]cuda:0", arg1_1: "bf16[4096][1]cuda:0"):
        mul: "bf16[8192, 4096][4096, 1]cuda:0" = torch.ops.aten.mul.Tensor(arg0_1, 0.125);  arg0_1 = None
        var_mean = torch.ops.aten.var_mean.correction(x, [1], correction = 0, keepdim = True)
        getitem: "f32[16, 1][1, 1]cuda:0" = var_mean[0]
        return (mul,)

It is parsed with :mod:`ast` (never executed). Node references become :class:`Ref`, ``torch.<dtype>``
arguments become :class:`DType` (FX abbreviations: ``f32``, ``bf16``, ``i8`` ...), other ``torch.<name>``
attributes the string ``"torch.<name>"``, lists and tuples tuples, other literals stay Python values. A node
whose annotation has a symbolic size or stride (``s77``) or that is a ``Sym(...)`` scalar is listed in
:attr:`FxGraph.symbolic`; such a node, or a placeholder without a readable annotation, marks the graph
:attr:`FxGraph.dynamic`.
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass, field
from typing import Any

from tilesmith._ast import dotted_name

#: ``torch.<name>`` dtype attribute -> FX annotation abbreviation.
TORCH_DTYPES = {"float32": "f32", "float": "f32", "bfloat16": "bf16", "float16": "f16", "half": "f16",
                "float64": "f64", "double": "f64", "int8": "i8", "uint8": "u8", "int16": "i16", "int32": "i32",
                "int64": "i64", "long": "i64", "bool": "b8"}
#: FX abbreviation -> element size in bytes.
ITEMSIZE = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "i64": 8, "i32": 4, "i16": 2, "i8": 1, "u8": 1, "b8": 1}

_ANNOTATION = re.compile(r"^(\w+)\[([^\]]*)\]\[([^\]]*)\](.*)$")


class FxTextError(ValueError):
    """FX program text that is not Python, or has no ``forward``."""


@dataclass(frozen=True)
class FxStatement:
    """One line of an FX program's ``forward``, as :func:`fx_statements` classifies it.

    ``kind``: ``input`` (a placeholder), ``call`` (``op`` without ``torch.ops.``; ``args``/``kwargs`` are the
    argument expressions), ``getitem`` (``source[index]``), ``attr`` (a ``self.`` constant or frozen parameter),
    ``other``, or ``return`` (``value``: the returned expression, or ``None``). ``annotation``: the string
    annotation (``"f32[8, 16]"``) or ``None``."""

    kind: str
    name: str = ""
    annotation: str | None = None
    op: str = ""
    args: tuple[ast.expr, ...] = ()
    kwargs: tuple[tuple[str, ast.expr], ...] = ()
    source: str = ""
    index: int = 0
    value: ast.expr | None = None


def _annotation(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def fx_statements(text: str) -> list[FxStatement]:
    """The placeholders, assignments and return of the ``forward`` of FX program text (``print_readable``'s
    ``class <lambda>(torch.nn.Module): def forward(self, ...)``), in order; ``x = None`` (a freed name) and other
    statements are left out. The front end of :func:`parse_fx`.

    Raises:
        FxTextError: the text is not parseable Python, or has no ``forward``.
    """
    body = re.sub(r"^class [^\n]*:", "class _G:", text.strip(), count=1)
    try:
        tree = ast.parse(body)
    except SyntaxError as exc:
        raise FxTextError(f"the FX program is not parseable Python: {exc.msg}") from None
    forward = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "forward"), None)
    if forward is None:
        raise FxTextError("the FX program has no forward()")
    out = [FxStatement("input", arg.arg, _annotation(arg.annotation)) for arg in forward.args.args[1:]]
    for stmt in forward.body:
        if isinstance(stmt, ast.Return):
            out.append(FxStatement("return", value=stmt.value))
            continue
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
            name, rhs, ann = stmt.target.id, stmt.value, _annotation(stmt.annotation)
        elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            name, rhs, ann = stmt.targets[0].id, stmt.value, None
            if isinstance(rhs, ast.Constant) and rhs.value is None:
                continue  # `x = None` frees a name
        else:
            continue
        if isinstance(rhs, ast.Call):
            target = dotted_name(rhs.func) or ""
            op = target[len("torch.ops."):] if target.startswith("torch.ops.") else target
            out.append(FxStatement("call", name, ann, op=op, args=tuple(rhs.args),
                                   kwargs=tuple((k.arg, k.value) for k in rhs.keywords if k.arg)))
        elif isinstance(rhs, ast.Subscript) and isinstance(rhs.value, ast.Name) and isinstance(rhs.slice, ast.Constant):
            out.append(FxStatement("getitem", name, ann, source=rhs.value.id, index=int(rhs.slice.value)))
        elif isinstance(rhs, ast.Attribute) and (dotted_name(rhs) or "").startswith("self."):
            out.append(FxStatement("attr", name, ann))
        else:
            out.append(FxStatement("other", name, ann))
    return out


@dataclass(frozen=True)
class Ref:
    """A reference to another node by name."""

    name: str


@dataclass(frozen=True)
class DType:
    """A ``torch.<dtype>`` argument, by FX abbreviation."""

    abbr: str


@dataclass(frozen=True)
class Meta:
    """Shape and strides (elements), dtype (FX abbreviation, e.g. ``bf16``) and device (``cuda:0``) of a tensor node."""

    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    device: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """``numel`` times the element size in bytes (:data:`ITEMSIZE`; 4 for a dtype it lacks)."""
        return self.numel * ITEMSIZE.get(self.dtype, 4)

    def is_contiguous(self) -> bool:
        """Row-major contiguous (strides of size-1 dimensions ignored)."""
        expect = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if size != 1 and stride != expect:
                return False
            expect *= size
        return True

    def is_rows(self) -> bool:
        """Rows of the last dimension: unit inner stride and leading dimensions that collapse into one row
        stride (what the native kernels take without a copy)."""
        if not self.shape:
            return False
        if self.shape[-1] > 1 and self.stride[-1] != 1:
            return False
        expect = None
        for size, stride in zip(reversed(self.shape[:-1]), reversed(self.stride[:-1]), strict=True):
            if size == 1:
                continue
            if expect is not None and stride != expect:
                return False
            expect = stride * size
        return True


@dataclass
class Node:
    """One FX node: a placeholder (``input``), a call, a ``getitem`` of a tuple node, a ``self.<attr>`` read
    (``attr``: a constant or frozen parameter), or ``other``."""

    name: str
    kind: str
    meta: Meta | None = None
    op: str = ""
    """Target without ``torch.ops.``: ``aten.mul.Tensor``, ``prims.convert_element_type.default``."""
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    index: int = 0

    @property
    def packet(self) -> str:
        """The op without its overload: ``aten.mm`` for ``aten.mm.default``; ``""`` for a non-call."""
        parts = self.op.split(".")
        return ".".join(parts[:2]) if len(parts) >= 2 else self.op


@dataclass
class FxGraph:
    """A parsed FX program: nodes by name in graph order, placeholder names in order, the returned values,
    how many times each node is used (arguments, ``getitem`` sources, the return), whether the graph has
    dynamic shapes, and the names of the nodes whose annotation is symbolic."""

    nodes: dict[str, Node]
    placeholders: tuple[str, ...]
    returned: tuple[Any, ...]
    users: dict[str, int]
    dynamic: bool
    symbolic: tuple[str, ...] = ()

    def node(self, value: Any) -> Node | None:
        return self.nodes.get(value.name) if isinstance(value, Ref) else None

    def calls(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.kind in ("call", "getitem")]


def _parse_meta(text: str | None) -> tuple[Meta | None, bool]:
    """``(meta, dynamic)`` of an annotation; dynamic when a size or stride is symbolic or it is a SymInt."""
    if not text:
        return None, False
    if text.startswith("Sym("):
        return None, True
    match = _ANNOTATION.match(text.strip())
    if not match:
        return None, False
    dtype, shape_s, stride_s, device = match.groups()

    def dims(part: str) -> tuple[int, ...] | None:
        out = []
        for item in (p.strip() for p in part.split(",")):
            if not item:
                continue
            if not re.fullmatch(r"-?\d+", item):
                return None
            out.append(int(item))
        return tuple(out)

    shape, stride = dims(shape_s), dims(stride_s)
    if shape is None or stride is None or len(shape) != len(stride):
        return None, True
    return Meta(dtype=dtype, shape=shape, stride=stride, device=device.strip()), False


def _value(node: ast.AST) -> Any:
    if isinstance(node, ast.Name):
        return Ref(node.id)
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return tuple(_value(e) for e in node.elts)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _value(node.operand)
        return -inner if isinstance(inner, (int, float)) and not isinstance(inner, bool) else None
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch":
        abbr = TORCH_DTYPES.get(node.attr)
        return DType(abbr) if abbr else ("torch." + node.attr)
    return None


def parse_fx(text: str) -> FxGraph:
    """Parse ``text`` (module docstring).

    Raises:
        FxTextError: the text is not parseable Python, or has no ``forward``.
    """
    statements = fx_statements(text)
    nodes: dict[str, Node] = {}
    placeholders: list[str] = []
    dynamic = False
    symbolic: list[str] = []
    returned: tuple[Any, ...] = ()
    for st in statements:
        if st.kind == "return":
            value = _value(st.value) if st.value is not None else ()
            returned = value if isinstance(value, tuple) else (value,)
            continue
        meta, dyn = _parse_meta(st.annotation)
        if dyn:
            symbolic.append(st.name)
        if st.kind == "input":
            dynamic = dynamic or dyn or meta is None
            nodes[st.name] = Node(st.name, "input", meta)
            placeholders.append(st.name)
            continue
        dynamic = dynamic or dyn
        if st.kind == "call":
            nodes[st.name] = Node(st.name, "call", meta, op=st.op, args=tuple(_value(a) for a in st.args),
                                  kwargs={k: _value(v) for k, v in st.kwargs})
        elif st.kind == "getitem":
            nodes[st.name] = Node(st.name, "getitem", meta, source=st.source, index=st.index)
        else:
            nodes[st.name] = Node(st.name, st.kind, meta)
    users: dict[str, int] = {}

    def count(value: Any) -> None:
        if isinstance(value, Ref):
            users[value.name] = users.get(value.name, 0) + 1
        elif isinstance(value, tuple):
            for v in value:
                count(v)

    for node in nodes.values():
        if node.kind == "call":
            count(node.args)
            count(tuple(node.kwargs.values()))
        elif node.kind == "getitem":
            users[node.source] = users.get(node.source, 0) + 1
    count(returned)
    return FxGraph(nodes=nodes, placeholders=tuple(placeholders), returned=returned, users=users, dynamic=dynamic,
                   symbolic=tuple(symbolic))
