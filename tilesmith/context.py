"""``RunContext``: what the stages may ask of the live run (one ``tilesmith.compile()`` call) they work for.

:class:`tilesmith.pipeline.LiveRun` is the one implementation; tests pass small stand-ins with the members a
function uses. The stages that take a run (:mod:`tilesmith.optimize`, :mod:`tilesmith.install.installer`,
:mod:`tilesmith.install.verify`, :mod:`tilesmith.cache.reuse`) use these members and no others; structural typing
(:class:`typing.Protocol`), so nothing has to inherit from it. Importing this module imports no stage and no torch.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from tilesmith.records import BenchmarkRecord, Diagnostic


class RunOptionsView(Protocol):
    """The parts of :class:`tilesmith.pipeline.RunOptions` the stages read."""

    @property
    def agency(self) -> str: ...

    @property
    def loops(self) -> int: ...

    @property
    def min_improvement(self) -> float: ...


class RunContext(Protocol):
    """The live run as the stages see it: its options, its diagnostics and benchmarks, its background threads
    and its optimizer factory."""

    @property
    def run_id(self) -> str: ...

    @property
    def options(self) -> RunOptionsView: ...

    @property
    def lock(self) -> threading.Lock:
        """Guards :attr:`benchmarks` (and the run's other lists) against the run's background threads."""
        ...

    @property
    def benchmarks(self) -> list[BenchmarkRecord]:
        """The installed graphs' records, in install order; change it only while holding :attr:`lock`."""
        ...

    def diagnose(self, kind: str, message: str, graph_key: str | None = None, graph_name: str | None = None,
                 /) -> Diagnostic:
        """Record (and log) a new diagnostic of the run; returns it."""
        ...

    def record_diagnostic(self, diagnostic: Diagnostic, /) -> None:
        """Record a diagnostic made elsewhere (a session's, the cache's)."""
        ...

    def retire_diagnostic(self, kind: str, graph_key: str, /) -> None:
        """Drop the run's ``kind`` diagnostics of one graph from what ``tilesmith.diagnostics`` answers (a
        status that no longer holds, e.g. ``optimizing_in_background`` once decided); ``run.json`` keeps them."""
        ...

    def start_background(self, thread: threading.Thread, /) -> None:
        """Start a daemon thread that re-checks or optimizes one graph; ``tilesmith.wait`` joins it."""
        ...

    def optimizer_factory(self) -> Any:
        """The run's ``OptimizerFactory`` (:mod:`tilesmith.agent.protocol`), created at first use."""
        ...
