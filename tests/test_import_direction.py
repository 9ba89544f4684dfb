"""Import direction (issue 14): the gate's host and worker sides never import each other, the shared modules at
``tilesmith/gate/``'s top import neither, and no stage imports a stage downstream of it
(capture → track → agent → gate → install). Every ``import`` statement counts, also those inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "tilesmith"
STAGES = ("capture", "track", "agent", "gate", "install")


def imported_modules(path: Path, package: str | None = None) -> list[str]:
    """Absolute module names ``path`` imports (relative imports resolved against its package)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    if package is None:
        package = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.append(base)
            found += [f"{base}.{a.name}" for a in node.names]  # ``from tilesmith.gate import worker``
    return found


def side_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["tilesmith", "gate"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in ("host", "worker") else "shared"


def gate_files(side: str) -> list[Path]:
    gate = ROOT / "gate"
    if side == "shared":
        return [p for p in gate.glob("*.py") if p.name != "__init__.py"]
    return sorted((gate / side).rglob("*.py"))


@pytest.mark.parametrize("side, forbidden", [("host", {"worker"}), ("worker", {"host"}),
                                             ("shared", {"host", "worker"})])
def test_gate_host_and_worker_never_import_each_other(side, forbidden):
    files = gate_files(side)
    assert files, f"no modules found for the gate's {side} side"
    bad = [(p.relative_to(ROOT).as_posix(), m) for p in files for m in imported_modules(p)
           if side_of(m) in forbidden]
    assert bad == [], f"the gate's {side} side imports {sorted(forbidden)}: {bad}"


def test_no_stage_imports_a_stage_downstream_of_it():
    bad = []
    for path in ROOT.rglob("*.py"):
        stage = path.relative_to(ROOT).parts[0]
        if stage not in STAGES:
            continue
        for module in imported_modules(path):
            parts = module.split(".")
            if parts[0] == "tilesmith" and len(parts) > 1 and parts[1] in STAGES \
                    and STAGES.index(parts[1]) > STAGES.index(stage):
                bad.append((path.relative_to(ROOT).as_posix(), module))
    assert bad == [], f"a stage imports a later stage: {bad}"


def test_the_checker_sees_a_violation(tmp_path):
    """The helper reads function-level and ``from`` imports (so the tests above can fail)."""
    sample = tmp_path / "probe.py"
    sample.write_text("def f():\n    from tilesmith.gate import worker\n    import tilesmith.gate.worker.core\n"
                      "    from ..worker import timing\n")
    modules = imported_modules(sample, package="tilesmith.gate.host")
    assert {"tilesmith.gate.worker", "tilesmith.gate.worker.core", "tilesmith.gate.worker.timing"} <= set(modules)
    assert {side_of(m) for m in modules} >= {"worker"}
