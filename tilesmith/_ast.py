"""Small AST helpers shared by the stages that read wrapper or FX text (gate scan, the LLM agent's launch
count, :mod:`tilesmith.fx_text`)."""

from __future__ import annotations

import ast


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
