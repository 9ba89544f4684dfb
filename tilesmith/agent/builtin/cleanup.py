"""Generator ``wrapper_cleanup``: host-side statements in the body that provably do nothing.

What it removes: repeated ``streamN = get_raw_stream(i)`` lookups. Inductor emits one before every Triton
launch; inside one straight-line block they all return the same current stream (nothing in between
changes the current stream or device: any call naming a stream or device in between resets the analysis),
so only the first of each identical lookup is kept.

What it deliberately keeps (and why), so that nobody re-adds them here without measuring:

- ``torch.cuda.set_device(i)`` inside ``torch.cuda._DeviceGuard(i)``: redundant for the device index, but
  Inductor emits it so that threads that never made a CUDA runtime call (autograd's backward thread) get
  the primary context made current before Triton launches through the driver API. The gate runs candidates
  on a main thread and could not catch a crash there.
- ``assert_size_stride`` on inputs: a safety net whose failure mode (an AssertionError instead of silent
  garbage) is part of the wrapper's observable behaviour.
- ``del`` statements: they release memory early; dropping them raises peak memory for ~30 ns each.

Expected gain: about :data:`LOOKUP_COST_MS` per removed lookup, relative to the measured call time. That
figure is an estimate (a C call plus a Python store), not a measurement; the optimizer proposes this
generator last and skips it when the profile says the gain is below half the gate's threshold.
"""

from __future__ import annotations

import ast

from tilesmith.agent.builtin.base import GraphContext, Proposal, Skip
from tilesmith.agent.builtin.wrapper_text import WrapperShapeError, parse_entry

NAME = "wrapper_cleanup"
#: Estimated host cost of one ``get_raw_stream`` statement, milliseconds.
LOOKUP_COST_MS = 0.0002


def redundant_stream_lookups(source: str) -> list[int]:
    """1-based line numbers of ``stream = get_raw_stream(i)`` statements that repeat an earlier one."""
    try:
        entry = parse_entry(source)
    except WrapperShapeError:
        return []
    tree = ast.parse(source)
    bodies = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "call":
            bodies.append(node)
    if entry.form == "runner":
        bodies = [b for b in bodies if any(isinstance(a, ast.arg) and a.arg == "self" for a in b.args.args)]
    lines: list[int] = []
    for body in bodies:
        for stmts in _statement_lists(body):
            seen: dict[str, str] = {}
            for stmt in stmts:
                lookup = _lookup(stmt)
                if lookup is not None:
                    target, text = lookup
                    if seen.get(target) == text and stmt.lineno == stmt.end_lineno:
                        lines.append(stmt.lineno)
                    else:
                        seen[target] = text
                    continue
                if _may_switch_stream(stmt):
                    seen.clear()
                for name in _assigned_names(stmt):
                    seen.pop(name, None)
    return sorted(lines)


def cleanup_source(source: str) -> tuple[str, int]:
    """``source`` without redundant stream lookups, and how many were removed."""
    drop = set(redundant_stream_lookups(source))
    if not drop:
        return source, 0
    kept = [line for i, line in enumerate(source.splitlines(keepends=True), start=1) if i not in drop]
    return "".join(kept), len(drop)


class CleanupGenerator:
    """Generator 3 (see the module docstring)."""

    name = NAME

    def inapplicable(self, source: str, ctx: GraphContext) -> str | None:
        if not ctx.is_cuda:
            return "CPU graph: the wrapper has no stream lookups or device guards to clean up"
        return None

    def expected_gain(self, source: str, ctx: GraphContext) -> float | None:
        if ctx.profile is None or not ctx.profile.eager_ms:
            return None
        if "class _TilesmithCUDAGraphCall" in source:
            return 0.0  # replays skip the body's host statements entirely
        return len(redundant_stream_lookups(source)) * LOOKUP_COST_MS / ctx.profile.eager_ms

    def propose(self, source: str, ctx: GraphContext) -> Proposal:
        new, removed = cleanup_source(source)
        if not removed:
            raise Skip("no redundant stream lookups in the body")
        return Proposal(NAME, new, f"removed {removed} repeated get_raw_stream lookups")


def _statement_lists(node: ast.AST) -> list[list[ast.stmt]]:
    found = []
    for child in ast.walk(node):
        for field in ("body", "orelse", "finalbody"):
            value = getattr(child, field, None)
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                found.append(value)
    return found


def _lookup(stmt: ast.stmt) -> tuple[str, str] | None:
    if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
            and isinstance(stmt.value, ast.Call) and ast.unparse(stmt.value.func) == "get_raw_stream"
            and all(isinstance(a, ast.Constant) for a in stmt.value.args)):
        return stmt.targets[0].id, ast.unparse(stmt.value)
    return None


def _may_switch_stream(stmt: ast.stmt) -> bool:
    """A call that could change the current stream or device (``torch.cuda.set_device``, stream contexts)."""
    for node in ast.walk(stmt):
        if isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            if func != "get_raw_stream" and ("stream" in func.lower() or "device" in func.lower()):
                return True
    return isinstance(stmt, (ast.With, ast.AsyncWith))


def _assigned_names(stmt: ast.stmt) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(stmt):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
    return names
