"""docs/optimizer.md: its example factory runs as written, and an optimizer may let StopOptimization end it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

import tilesmith
from tilesmith.agent.protocol import StopOptimization

REPO = Path(__file__).resolve().parents[1]


def test_the_documented_example_factory_runs_and_reports_a_verdict(tmp_path):
    text = (REPO / "docs" / "optimizer.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    script = tmp_path / "example.py"
    script.write_text(block)
    env = {**os.environ, "TILESMITH_CACHE_DIR": str(tmp_path / "ts"), "PYTHONPATH": str(REPO)}
    env.pop("TILESMITH_ALLOW_CPU", None)  # the example sets it itself
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The graph's name comes from its wrapper's AOT id: "0_inference" when compiled here, another number when
    # the shared Inductor cache (TORCHINDUCTOR_CACHE_DIR) hands back a wrapper an earlier process compiled.
    verdicts = [line for line in proc.stdout.splitlines() if re.match(r"\d+_inference: ", line)]
    assert len(verdicts) == 1, proc.stdout
    assert verdicts[0].split(": ", 1)[1].split()[0] in ("accepted", "rejected_slower", "rejected_marginal",
                                                          "rejected_unconfirmed"), verdicts
    accepted = verdicts[0].split(": ", 1)[1].startswith("accepted")
    assert accepted == any(line.startswith("installed: ") for line in proc.stdout.splitlines()), proc.stdout


class _UntilStopped:
    """Proposes the same honest rewrite, then keeps asking for turns until new_turn raises StopOptimization."""

    name = "until-stopped"

    def __init__(self) -> None:
        self.stopped = False

    def for_graph(self, session):
        return self

    def close(self) -> None:
        pass

    def optimize(self, session) -> None:
        from tests.models import mm_instead_of_loop

        while True:
            try:
                path = session.new_turn()
            except StopOptimization:
                self.stopped = True
                raise
            path.write_text(mm_instead_of_loop(path.read_text()) + f"\n# turn {session.turns_used}\n")
            session.evaluate(proposer=self.name)


def test_stop_optimization_escaping_an_optimizer_is_a_normal_end_not_an_error(cpu_test_mode, monkeypatch):
    from tests.models import MulSum

    monkeypatch.setenv("TILESMITH_MAX_TURNS", "2")
    torch.manual_seed(0)
    model, x = MulSum().eval(), torch.randn(64, 512)
    factory = _UntilStopped()
    compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=factory)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    assert factory.stopped
    kinds = [d.kind for d in tilesmith.diagnostics(compiled)]
    assert "optimizer_error" not in kinds and "internal_error" not in kinds, tilesmith.diagnostics(compiled)
