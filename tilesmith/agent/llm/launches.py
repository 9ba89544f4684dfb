"""Mechanical agency checks the host runs before a candidate reaches the gate.

``agency="low"`` promises the wrapper and kernel boundaries stay as Inductor made them: the same
kernels, launched in the same order; only their insides (tile sizes, ``num_warps``, vectorization,
coalescing) and launch parameters may change. :func:`launch_sequence` reads that order from the
wrapper's ``call`` function and :func:`check_agency` compares it with the original's.

What counts as a launch (the forms Inductor 2.11 writes into CUDA Python wrappers, see the fixtures
under ``tests/fixtures/inductor-h200/``): ``<kernel>.run(...)`` for module-level kernels (Triton and
templates), ``extern_kernels.<fn>(...)``, ``torch.ops.<ns>.<op>...(...)`` and ``aten.<op>(...)``, in
source order (loop bodies once). Launch arguments are not compared: grids and buffers may change.

``medium`` and ``high`` have no mechanical rule beyond the callable ABI, which the gate checks.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from tilesmith._ast import dotted_name as _dotted


@dataclass(frozen=True)
class AgencyCheck:
    """Outcome of :func:`check_agency`: ``ok`` or the reasons (written for the agent) why not."""

    ok: bool
    reasons: tuple[str, ...] = ()




def _find_call(tree: ast.Module) -> ast.FunctionDef | None:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "call":
            return node
    for node in tree.body:  # torch 2.11 writes `class Runner: def call(self, args)` and `call = runner.call`
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "call":
                    return item
    return None


class _Launches(ast.NodeVisitor):
    def __init__(self, kernels: set[str]) -> None:
        self.kernels = kernels
        self.out: list[str] = []

    def visit_Call(self, node: ast.Call) -> None:  # noqa: N802
        self.generic_visit(node)  # arguments first: nested calls are evaluated before the outer one
        name = _dotted(node.func)
        if name is None:
            return
        head, _, tail = name.partition(".")
        if tail == "run" and head in self.kernels:
            self.out.append(head)
        elif (head == "extern_kernels" and tail) or name.startswith(("torch.ops.", "aten.")):
            self.out.append(name)


def module_kernels(tree: ast.Module) -> set[str]:
    """Names bound at module level to ``async_compile.<kind>(...)`` or other module-level kernels."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = _dotted(node.value.func) or ""
            if func.startswith("async_compile.") or func.endswith(("load_kernel", "CachingAutotuner")):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def launch_sequence(source: str) -> tuple[str, ...] | None:
    """Kernel launches of the wrapper's ``call`` in source order, or ``None`` if it cannot be read.

    Raises nothing: a source that does not parse or has no ``call`` returns ``None`` (the gate then
    reports the load error with its line number).
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    call = _find_call(tree)
    if call is None:
        return None
    visitor = _Launches(module_kernels(tree))
    for stmt in call.body:
        visitor.visit(stmt)
    return tuple(visitor.out)


def check_agency(agency: str, original: str, candidate: str) -> AgencyCheck:
    """Check the mechanical rule of ``agency`` for ``candidate`` against the ``original`` wrapper.

    Returns ``AgencyCheck(ok=True)`` for ``medium``/``high``, for unreadable sources (left to the gate)
    and for a ``low`` candidate whose launch sequence equals the original's.
    """
    if agency != "low":
        return AgencyCheck(True)
    before, after = launch_sequence(original), launch_sequence(candidate)
    if before is None or after is None or before == after:
        return AgencyCheck(True)
    reasons = ["agency 'low' keeps the kernel boundaries: the same kernels launched in the same order "
               "(only kernel internals and launch parameters may change)"]
    for i, (a, b) in enumerate(zip(before, after, strict=False)):
        if a != b:
            reasons.append(f"launch {i} is {b!r}; the original launches {a!r} there")
            break
    else:
        if len(after) > len(before):
            reasons.append(f"extra launch {len(before)}: {after[len(before)]!r} (the original has {len(before)})")
        else:
            reasons.append(f"launch {len(after)} ({before[len(after)]!r}) is missing (the original has "
                           f"{len(before)})")
    reasons.append(f"original order: {', '.join(before)}")
    return AgencyCheck(False, tuple(reasons))
