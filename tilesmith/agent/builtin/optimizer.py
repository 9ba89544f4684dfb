"""The built-in agent's loop: deterministic generators proposed through the host gate, best first.

Per graph (:meth:`BuiltinOptimizer.optimize`):

1. Decide which generators apply (device, agency, wrapper shape); each one that does not gets a reason.
2. On CUDA, measure the original wrapper once in a search worker (:mod:`.profile`): eager vs CUDA-graph
   time per call and per-kernel launch-configuration timings. A failed search is noted; generators that
   need it are then skipped, the others run in the fixed order below.
3. Repeatedly pick, among the generators not yet tried, the one with the highest expected gain *on the
   current incumbent* (a measured estimate; unknown counts as 0 and keeps the fixed order
   ``cudagraph``, ``launch_config``, ``wrapper_cleanup``, ``native_kernels``), build its candidate from
   ``session.incumbent_source()``, write it into a new turn of the attempt ring (keeping the FX header
   the ring wrote) and let the gate evaluate it. A generator whose measured expected gain is below half of
   ``TILESMITH_MIN_IMPROVEMENT`` is skipped rather than spending a gate evaluation.
4. Stop when ``session.stop_reason()`` is set (loops accepted, turn or time limit) or every generator was
   tried or skipped ("exhausted", recorded as a ``builtin_exhausted`` diagnostic listing what happened).

Each generator proposes at most once per graph; an accepted candidate becomes the incumbent, so a later
loop builds on it (for example launch configurations pinned inside a CUDA-graph-replayed wrapper).

On CPU (test mode) no generator applies: CUDA graphs, Triton launch configurations and the native kernels
are CUDA-only and CPU wrappers have no stream lookups. The optimizer then evaluates nothing and ends
"exhausted".
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from tilesmith import settings
from tilesmith.agent.builtin.base import Generator, GraphContext, Skip
from tilesmith.agent.builtin.cleanup import CleanupGenerator
from tilesmith.agent.builtin.cudagraph import CudaGraphGenerator
from tilesmith.agent.builtin.launch_config import LaunchConfigGenerator
from tilesmith.agent.builtin.native import NativeKernelGenerator
from tilesmith.agent.protocol import StopOptimization

log = logging.getLogger("tilesmith")

NAME = "tilesmith/builtin"


def default_generators() -> list[Generator]:
    """The generators in their fixed tie-break order (also the order without measurements)."""
    return [CudaGraphGenerator(), LaunchConfigGenerator(), CleanupGenerator(), NativeKernelGenerator()]


class BuiltinOptimizer:
    """Optimizer for one graph (the :class:`~tilesmith.agent.protocol.Optimizer` protocol).

    After :meth:`optimize`, ``outcome`` is ``"exhausted"`` or the session's stop reason, and ``history``
    lists ``(generator, status)`` pairs where status is a verdict status or ``"skipped: <why>"``.
    """

    name = NAME

    def __init__(self, *, agency: str, generators: list[Generator] | None = None, searcher: Any = None):
        self.agency = agency
        self.generators = list(generators) if generators is not None else default_generators()
        self._searcher = searcher
        self.outcome: str | None = None
        self.history: list[tuple[str, str]] = []
        self.context: GraphContext | None = None

    def optimize(self, session: Any) -> None:
        ctx = self._context(session)
        self.context = ctx
        pending: list[Generator] = []
        for gen in self.generators:
            reason = gen.inapplicable(session.incumbent_source(), ctx)
            if reason is None and ctx.profile is None and self._needs_profile(gen, ctx):
                self._profile(session, ctx)
                reason = gen.inapplicable(session.incumbent_source(), ctx)
            if reason is None:
                pending.append(gen)
            else:
                self.history.append((gen.name, f"skipped: {reason}"))
        # The profile may arrive after an earlier generator was judged; re-judge those with it.
        if ctx.profile is not None:
            for gen in list(pending):
                reason = gen.inapplicable(session.incumbent_source(), ctx)
                if reason is not None:
                    pending.remove(gen)
                    self.history.append((gen.name, f"skipped: {reason}"))
        while pending:
            reason = session.stop_reason()
            if reason:
                self.outcome = reason
                return
            source = session.incumbent_source()
            gen, gain = self._pick(pending, source, ctx)
            pending.remove(gen)
            threshold = 0.5 * ctx.min_improvement
            if gain is not None and gain < threshold:
                self.history.append((gen.name, f"skipped: expected gain {gain:.1%} below {threshold:.1%}"))
                continue
            try:
                proposal = gen.propose(source, ctx)
            except Skip as exc:
                self.history.append((gen.name, f"skipped: {exc}"))
                continue
            try:
                path = session.new_turn()
            except StopOptimization as exc:
                self.outcome = str(exc) or (session.stop_reason() or "stopped")
                return
            write_attempt(Path(path), proposal.source)
            expected = "" if gain is None else f" [expected {gain:.1%}]"
            verdict = session.evaluate(proposer=f"builtin:{gen.name}", note=proposal.note + expected)
            self.history.append((gen.name, str(getattr(verdict, "status", verdict))))
        reason = session.stop_reason()
        if reason:
            self.outcome = reason
            return
        self.outcome = "exhausted"
        summary = "; ".join(f"{name}: {status}" for name, status in self.history) or "no generators"
        session.note("builtin_exhausted", f"the built-in agent has nothing more to propose ({summary}).")

    # -- helpers ------------------------------------------------------------------------------------
    def _context(self, session: Any) -> GraphContext:
        graph = getattr(session, "graph", None)
        try:
            min_improvement = float(settings.get("TILESMITH_MIN_IMPROVEMENT"))
        except Exception:  # noqa: BLE001 - an invalid value is reported by the gate, not here
            min_improvement = 0.02
        return GraphContext(
            device=str(getattr(graph, "device", "cpu")),
            agency=str(getattr(session, "agency", self.agency) or self.agency),
            mutated_input_idxs=tuple(getattr(graph, "mutated_input_idxs", ()) or ()),
            constant_names=tuple(getattr(graph, "constant_names", ()) or ()),
            min_improvement=min_improvement,
            fx_program=str(getattr(graph, "fx_program", "") or ""),
        )

    @staticmethod
    def _needs_profile(gen: Generator, ctx: GraphContext) -> bool:
        return ctx.is_cuda and ctx.profile_error is None and gen.name in ("launch_config", "cudagraph")

    def _profile(self, session: Any, ctx: GraphContext) -> None:
        """Measure the original wrapper once (sets ``ctx.profile`` or ``ctx.profile_error``)."""
        if ctx.constant_names:
            ctx.profile_error = "the graph has module constants the search worker cannot rebuild"
            return
        from tilesmith.agent.builtin.profile import SearchFailed, run_search

        searcher = self._searcher or run_search
        started = time.monotonic()
        try:
            ctx.profile = searcher(session.incumbent_source(), ctx.device, timeout_s=self._search_timeout(session))
        except SearchFailed as exc:
            ctx.profile_error = str(exc)
        except Exception as exc:  # noqa: BLE001 - never let the search break the user's first call
            ctx.profile_error = f"{type(exc).__name__}: {exc}"
        if ctx.profile_error:
            session.note("builtin_search_failed", f"launch-configuration search unavailable: {ctx.profile_error}")
        log.info("tilesmith: built-in search for %s took %.1f s", getattr(session, "graph_key", "?")[:12],
                 time.monotonic() - started)

    @staticmethod
    def _search_timeout(session: Any) -> float:
        limit = float(settings.get("TILESMITH_WORKER_TIMEOUT_S"))
        left = getattr(session, "time_left_s", None)
        if callable(left):
            left = left()
        return max(1.0, min(limit, float(left))) if isinstance(left, (int, float)) else limit

    def _pick(self, pending: list[Generator], source: str, ctx: GraphContext) -> tuple[Generator, float | None]:
        scored = [(gen, gen.expected_gain(source, ctx)) for gen in pending]
        best = max(range(len(scored)), key=lambda i: (scored[i][1] or 0.0, -i))
        return scored[best]


def write_attempt(path: Path, wrapper: str) -> None:
    """Write ``wrapper`` into the turn file ``path``, keeping the FX-program header the ring put there."""
    try:
        from tilesmith.capture.source import strip_fx_header
    except ImportError:  # pragma: no cover - capture stage missing in a partial checkout
        def strip_fx_header(text: str) -> str:
            return text
    current = path.read_text(encoding="utf-8") if path.exists() else ""
    header = current[: len(current) - len(strip_fx_header(current))]
    body = strip_fx_header(wrapper)
    path.write_text(header + body, encoding="utf-8")


class BuiltinOptimizerFactory:
    """The run-level factory for ``agent_model="tilesmith/builtin"`` (no proxy, no keys, no model calls).

    ``max_model_calls`` is accepted for the protocol and ignored: the built-in agent invokes no model.
    """

    name = NAME

    def __init__(self, *, agency: str = "medium", max_model_calls: int | None = None, searcher: Any = None):
        self.agency = agency
        self.max_model_calls = max_model_calls
        self._searcher = searcher

    def for_graph(self, session: Any) -> BuiltinOptimizer:
        return BuiltinOptimizer(agency=getattr(session, "agency", self.agency) or self.agency,
                                searcher=self._searcher)

    def close(self) -> None:
        """Nothing to release (search workers end with each graph's search)."""

    def calls_used(self) -> tuple[int | None, int | None]:
        """Model calls used and budget, for the progress display: always ``(0, None)``."""
        return 0, None
