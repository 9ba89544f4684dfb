"""``RunContext`` (tilesmith/context.py) is the whole contract between the live run and the stages that take one:
``LiveRun`` has every member it names, and the modules typed against it use no other member of ``run``."""

from __future__ import annotations

import ast
from pathlib import Path

from tilesmith.context import RunContext, RunOptionsView
from tilesmith.pipeline import LiveRun, RunOptions

ROOT = Path(__file__).resolve().parents[1] / "tilesmith"
USERS = ("optimize.py", "install/installer.py", "install/verify.py", "cache/reuse.py")


def members(protocol: type) -> set[str]:
    return {n for n in vars(protocol) if not n.startswith("_")}


def test_the_contract_is_small():
    assert members(RunContext) == {"run_id", "options", "lock", "benchmarks", "diagnose", "record_diagnostic",
                                   "retire_diagnostic", "start_background", "optimizer_factory"}
    assert members(RunOptionsView) == {"agency", "loops", "min_improvement"}


def test_live_run_has_every_member(tmp_path, monkeypatch):
    monkeypatch.setenv("TILESMITH_CACHE_DIR", str(tmp_path))
    run = LiveRun(RunOptions(agent_model=None, agency="medium", loops=1, max_model_calls=None, allow_cpu=True,
                             min_improvement=0.02))
    assert [n for n in sorted(members(RunContext)) if not hasattr(run, n)] == []
    assert [n for n in sorted(members(RunOptionsView)) if not hasattr(run.options, n)] == []
    with run.lock:
        run.benchmarks.append("record")
    assert run.benchmarks == ["record"]


def _run_attributes(path: Path) -> set[str]:
    """Names read as ``run.<name>`` or ``self.run.<name>`` in ``path``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id == "run":
            found.add(node.attr)
        elif isinstance(owner, ast.Attribute) and owner.attr == "run" and isinstance(owner.value, ast.Name) \
                and owner.value.id == "self":
            found.add(node.attr)
    return found


def test_the_stages_use_only_the_contract():
    extra = {rel: sorted(_run_attributes(ROOT / rel) - members(RunContext)) for rel in USERS}
    assert extra == {rel: [] for rel in USERS}
