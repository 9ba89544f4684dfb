"""Small AST helpers shared by the stages that read wrapper or FX text (gate scan, roofline, native matcher,
agency check)."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass


def dotted_name(node: ast.AST) -> str | None:
    """``"torch.ops.aten.mm"`` for an ``Attribute``/``Name`` chain; ``None`` for anything else (calls, subscripts)."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


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
    statements are left out. The one front end of the roofline cost model's and the native matcher's readers.

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
