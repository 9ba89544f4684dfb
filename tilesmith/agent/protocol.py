"""The optimizer protocol: how anything that proposes candidates talks to a graph's track.

The host owns the decision. An optimizer (the LLM agent, the built-in agent, a scripted test optimizer)
only *proposes* wrapper sources through :meth:`Session.evaluate`; the session runs the host gate, records
the attempt and, when the gate accepts, counts one of the requested ``loops`` and makes the candidate
the new incumbent (the baseline the next loop must beat).

Stop rule (guarantees termination, also when ``max_model_calls`` is ``None``): a session stops
accepting work when ``loops`` candidates were accepted, when ``TILESMITH_MAX_TURNS`` turns were used, or
when ``TILESMITH_GRAPH_TIMEOUT_S`` seconds have passed since optimization of the graph began.
:meth:`Session.stop_reason` says which; optimizers must check it before each turn, and
:meth:`Session.new_turn` raises :class:`StopOptimization` once it is set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from tilesmith.records import CapturedGraph, Diagnostic, Verdict


class StopOptimization(Exception):
    """Raised by :meth:`Session.new_turn` when the stop rule has ended this graph's optimization."""


@runtime_checkable
class Session(Protocol):
    """One eligible graph's optimization, as an optimizer sees it (implemented by the pipeline)."""

    graph: CapturedGraph
    graph_key: str
    """64-hex cache key."""
    workspace: Path
    """The track folder: ``attempts/``, ``profiles/``, ``program.fx.txt``. No secrets are ever here."""
    agency: str
    """``"low"``, ``"medium"`` or ``"high"``."""
    loops: int

    @property
    def accepted_loops(self) -> int: ...

    @property
    def turns_used(self) -> int: ...

    def stop_reason(self) -> str | None:
        """``None`` while work may continue, else why the loop must stop (loops done, turn or time limit)."""

    def current_attempt(self) -> Path:
        """Path of the newest attempt file (the ring's most recent slot)."""

    def new_turn(self) -> Path:
        """Start a turn: copy the most recently evaluated source into a new ring slot and return its path.

        Raises:
            StopOptimization: the stop rule ended this graph's optimization.
        """

    def evaluate(self, source: str | None = None, *, proposer: str, note: str = "") -> Verdict:
        """Run the host gate on ``source`` (default: the current attempt file's text).

        The evaluated text becomes the "most recently evaluated source" that the next turn starts from;
        when it is accepted it also becomes the incumbent and ``accepted_loops`` grows by one. A source
        identical to an earlier evaluated one is answered ``rejected_duplicate`` without running the gate.
        """

    def reject(self, source: str, *, proposer: str, reasons: tuple[str, ...] | list[str],
               status: str = "rejected_policy", note: str = "") -> Verdict:
        """Record a host rejection made without the gate (a mechanically checked rule, e.g. agency low)."""

    def incumbent_source(self) -> str:
        """Source the next accepted candidate must beat (the original wrapper before any acceptance)."""

    def note(self, kind: str, message: str) -> Diagnostic:
        """Record a diagnostic for this graph (shown by ``tilesmith.diagnostics``)."""


class Optimizer(Protocol):
    """Proposes candidates for one graph. ``optimize`` returns when the session's stop rule says so,
    or earlier when the optimizer has nothing more to propose."""

    name: str

    def optimize(self, session: Session) -> None: ...


class OptimizerFactory(Protocol):
    """One per ``tilesmith.compile()`` run: makes an optimizer per graph and owns shared resources
    (for the LLM agent: the private proxy process and the model-call budget)."""

    name: str

    def for_graph(self, session: Session) -> Optimizer: ...

    def close(self) -> None: ...
