"""Reading Inductor wrapper text: the entry point, its inputs and outputs, and the embedded Triton kernels.

Pure text/AST functions (no torch import), shared by the generators. The layout they expect is the torch
2.11 Python wrapper (``torch/_inductor/codegen/wrapper.py``): module-level ``name =
async_compile.triton('name', '''<kernel source>''', device_str='cuda')`` definitions, ``class Runner``
whose ``call(self, args)`` holds the body (or, on 2.6-era modules, a top-level ``def call(args)``), then
``call = runner.call``. Anything else makes :func:`parse_entry` raise :class:`WrapperShapeError`, which
the generators turn into a "skipped" note instead of a candidate.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

_TRITON_DEF = re.compile(
    r"^(?P<var>\w+) = async_compile\.triton\('(?P<name>\w+)', '''(?P<src>.*?)''', device_str='(?P<dev>\w+)'\)",
    re.MULTILINE | re.DOTALL,
)
_MUTATED_ARGS = re.compile(r"'mutated_arg_names': (\[[^\]]*\])")


class WrapperShapeError(ValueError):
    """The text is not a Python wrapper of the expected layout (message says what was missing)."""


@dataclass(frozen=True)
class KernelDef:
    """One ``async_compile.triton`` kernel embedded in a wrapper.

    ``src_start``/``src_end`` are character offsets of the kernel source inside the wrapper text (the part
    between the triple quotes), so that a rewrite can splice a new kernel source in place.
    """

    var: str
    name: str
    source: str
    device_str: str
    src_start: int
    src_end: int

    @property
    def params(self) -> tuple[str, ...]:
        """Parameter names of the ``@triton.jit`` function, in order ('' when the source does not parse)."""
        fn = kernel_function(self.source)
        return tuple(a.arg for a in fn.args.args) if fn is not None else ()

    @property
    def mutated_params(self) -> frozenset[str]:
        """``inductor_meta['mutated_arg_names']``: parameters the kernel writes in place."""
        match = _MUTATED_ARGS.search(self.source)
        if not match:
            return frozenset()
        try:
            return frozenset(ast.literal_eval(match.group(1)))
        except (ValueError, SyntaxError):
            return frozenset()


@dataclass(frozen=True)
class EntryInfo:
    """Where the wrapper's entry point is and what its body reads, writes and returns."""

    form: str
    """``"runner"`` (``class Runner`` + ``call = runner.call``) or ``"function"`` (top-level ``def call``)."""
    eager_expr: str
    """Expression naming the original body: ``"runner.call"`` or ``"call"``."""
    insert_after_line: int
    """1-based line after which code that rebinds ``call`` can be inserted."""
    input_names: tuple[str, ...]
    return_items: tuple[str, ...] | None
    """Source text of each returned element of the body's last ``return``; ``None`` if not a tuple."""
    device_indices: tuple[int, ...]
    """Sorted CUDA device indices from ``torch.cuda._DeviceGuard(i)`` in the body."""
    has_partitions: bool
    """``Runner(partitions=[...])`` is non-empty (cudagraph partitions: reduce-overhead)."""


def triton_kernels(source: str) -> list[KernelDef]:
    """Every ``async_compile.triton`` kernel definition in ``source``, in text order."""
    return [
        KernelDef(var=m.group("var"), name=m.group("name"), source=m.group("src"), device_str=m.group("dev"),
                  src_start=m.start("src"), src_end=m.end("src"))
        for m in _TRITON_DEF.finditer(source)
    ]


def kernel_function(kernel_source: str) -> ast.FunctionDef | None:
    """The ``@triton.jit`` function of a kernel source, or ``None`` when it does not parse."""
    try:
        tree = ast.parse(kernel_source)
    except SyntaxError:
        return None
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            return node
    return None


def parse_entry(source: str) -> EntryInfo:
    """Locate the entry point and analyse its body.

    Raises:
        WrapperShapeError: no ``call`` entry, no body, or the text does not parse.
    """
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise WrapperShapeError(f"the wrapper does not parse: {exc}") from None
    runner_cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Runner"), None)
    entry_assign = next((n for n in tree.body if isinstance(n, ast.Assign) and _assigns(n, "call")
                         and ast.unparse(n.value) == "runner.call"), None)
    top_def = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "call"), None)
    if runner_cls is not None and entry_assign is not None:
        body = next((n for n in runner_cls.body if isinstance(n, ast.FunctionDef) and n.name == "call"), None)
        if body is None:
            raise WrapperShapeError("class Runner has no call(self, args) method")
        form, eager, after = "runner", "runner.call", entry_assign.end_lineno
    elif top_def is not None:
        body, form, eager, after = top_def, "function", "call", top_def.end_lineno
    else:
        raise WrapperShapeError("no entry point: expected 'call = runner.call' or a top-level 'def call(args)'")
    partitions = False
    for node in tree.body:
        if isinstance(node, ast.Assign) and _assigns(node, "runner") and isinstance(node.value, ast.Call):
            for kw in node.value.keywords:
                if kw.arg == "partitions" and isinstance(kw.value, (ast.List, ast.Tuple)) and kw.value.elts:
                    partitions = True
    return EntryInfo(form=form, eager_expr=eager, insert_after_line=int(after or 0),
                     input_names=_input_names(body), return_items=_return_items(source, body),
                     device_indices=tuple(sorted(_device_guards(body))), has_partitions=partitions)


def written_inputs(source: str, entry: EntryInfo, mutated_input_idxs: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Input indices the body may write into (conservative).

    An input counts as written when it is in ``mutated_input_idxs``, when Inductor reuses it for another
    buffer (``buf = arg; del arg  # reuse``: reuse always means the buffer is written next, and CPU kernels
    give no other sign of it), when it or a name aliasing it (``buf = arg`` / ``buf =
    reinterpret_tensor(arg, ...)``) is passed as ``out=``,
    is the receiver of an in-place method (``x.copy_(...)``, any method ending in ``_``), or is passed to a
    Triton kernel's ``.run`` at a parameter listed in the kernel's ``mutated_arg_names``.
    """
    tree = ast.parse(source)
    body = _find_body(tree, entry)
    index = {name: i for i, name in enumerate(entry.input_names)}
    alias: dict[str, int] = dict(index)
    kernels = {k.var: k for k in triton_kernels(source)}
    written: set[int] = {int(i) for i in mutated_input_idxs}
    lines = source.splitlines()
    for node in ast.walk(body):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            origin = _origin(node.value, alias)
            if origin is not None:
                alias[node.targets[0].id] = origin
                if "# reuse" in lines[node.lineno - 1]:  # Inductor reuses a buffer only to write into it
                    written.add(origin)
    for node in ast.walk(body):
        if not isinstance(node, ast.Call):
            continue
        for kw in node.keywords:
            if kw.arg == "out":
                origin = _origin(kw.value, alias)
                if origin is not None:
                    written.add(origin)
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr.endswith("_") and not func.attr.startswith("_"):
            origin = _origin(func.value, alias)
            if origin is not None:
                written.add(origin)
        if _is_inplace_op(func) and node.args:
            origin = _origin(node.args[0], alias)
            if origin is not None:
                written.add(origin)
        if isinstance(func, ast.Attribute) and func.attr == "run" and isinstance(func.value, ast.Name):
            kernel = kernels.get(func.value.id)
            if kernel is None:
                continue
            params, mutated = kernel.params, kernel.mutated_params
            for pos, arg in enumerate(node.args):
                if pos < len(params) and params[pos] in mutated:
                    origin = _origin(arg, alias)
                    if origin is not None:
                        written.add(origin)
    return tuple(sorted(i for i in written if 0 <= i < len(entry.input_names)))


def _assigns(node: ast.Assign, name: str) -> bool:
    return len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) and node.targets[0].id == name


def _find_body(tree: ast.Module, entry: EntryInfo) -> ast.FunctionDef:
    if entry.form == "runner":
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Runner")
        return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "call")
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "call")


def _input_names(body: ast.FunctionDef) -> tuple[str, ...]:
    for stmt in body.body:
        if (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Name) and stmt.value.id == "args"
                and len(stmt.targets) == 1):
            target = stmt.targets[0]
            if isinstance(target, (ast.Tuple, ast.List)):
                return tuple(e.id for e in target.elts if isinstance(e, ast.Name))
            if isinstance(target, ast.Name):
                return (target.id,)
    return ()


def _return_items(source: str, body: ast.FunctionDef) -> tuple[str, ...] | None:
    returns = [n for n in ast.walk(body) if isinstance(n, ast.Return)]
    if not returns or returns[-1].value is None:
        return None
    value = returns[-1].value
    if not isinstance(value, (ast.Tuple, ast.List)):
        return None
    return tuple(ast.get_source_segment(source, e) or ast.unparse(e) for e in value.elts)


def _device_guards(body: ast.FunctionDef) -> set[int]:
    found: set[int] = set()
    for node in ast.walk(body):
        if (isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.cuda._DeviceGuard" and node.args
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, int)):
            found.add(node.args[0].value)
    return found


def _is_inplace_op(func: ast.AST) -> bool:
    """``torch.ops.aten.add_.Tensor`` / ``aten.copy_.default``: an in-place operator overload."""
    parts = ast.unparse(func).split(".")
    return "aten" in parts[:-1] and any(p.endswith("_") and not p.startswith("_") for p in parts[-2:])


def _origin(expr: ast.AST, alias: dict[str, int]) -> int | None:
    """Input index that ``expr`` (a name, or ``reinterpret_tensor(name, ...)``) aliases, if any."""
    if isinstance(expr, ast.Name):
        return alias.get(expr.id)
    if (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "reinterpret_tensor"
            and expr.args):
        return _origin(expr.args[0], alias)
    return None


def rewritable_entry(source: str, *, partitions: str) -> EntryInfo:
    """The :func:`parse_entry` facts of a Python CUDA wrapper the built-in rewrites may edit.

    Raises:
        Skip: a C++ wrapper (``cpp_wrapper``: no Python ``call`` to rewrite), a body :func:`parse_entry` cannot
            read, CUDA-graph partitions (``partitions`` is the reason's wording), or several CUDA devices.
    """
    from tilesmith.agent.builtin.base import Skip

    if "cpp_wrapper_src" in source or "inductor_entry" in source:
        raise Skip("C++ wrapper (cpp_wrapper): only Python wrappers are rewritten")
    try:
        entry = parse_entry(source)
    except WrapperShapeError as exc:
        raise Skip(str(exc)) from None
    if entry.has_partitions:
        raise Skip(partitions)
    if len(entry.device_indices) > 1:
        raise Skip(f"the body uses several CUDA devices {list(entry.device_indices)}")
    return entry
