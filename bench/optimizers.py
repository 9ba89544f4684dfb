"""Optimizer factories for the benchmark suite's Tilesmith arm besides the real agents.

``python bench/suite.py --agent py:bench.optimizers:NoOpFactory`` measures Tilesmith with an optimizer that
proposes nothing: what the capture, the track folder and the trampoline cost on their own (each graph stays on
Inductor). It records one host-side rejection per graph (``session.reject``, no gate worker is started), so
that the graph's ``track.json`` holds an evaluation with a proposer and a status; the CPU harness tests use it
to check what the report reads from the track without paying for gate workers on 2 cores.
"""

from __future__ import annotations

from typing import Any

PROPOSER = "bench:noop"


class NoOpOptimizer:
    """Records ``rejected_policy`` for the incumbent (the original wrapper) and stops."""

    name = PROPOSER

    def optimize(self, session: Any) -> None:
        if session.stop_reason():
            return
        session.reject(session.incumbent_source(), proposer=PROPOSER, status="rejected_policy",
                       reasons=("bench/optimizers.py NoOpFactory proposes nothing: overhead baseline",))


class NoOpFactory:
    """``OptimizerFactory`` (docs/optimizer.md) handing every graph a :class:`NoOpOptimizer`."""

    name = PROPOSER

    def for_graph(self, session: Any) -> NoOpOptimizer:
        return NoOpOptimizer()

    def close(self) -> None:
        pass
