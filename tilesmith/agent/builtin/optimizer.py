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
from tilesmith.agent.builtin.base import Generator, GraphContext, Proposal, Skip
from tilesmith.agent.builtin.cleanup import CleanupGenerator
from tilesmith.agent.builtin import aten_wrapper, configs
from tilesmith.agent.builtin.cudagraph import REPLAY_OVERHEAD_MS, CudaGraphGenerator
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

    After :meth:`optimize`, ``outcome`` is ``"exhausted"``, ``"budget"`` or the session's stop reason, and
    ``history`` lists ``(generator, status)`` pairs where status is a verdict status or ``"skipped: <why>"``.
    ``budget_s`` overrides ``TILESMITH_GRAPH_BUDGET_S`` (seconds for the whole optimization of the graph);
    ``configs`` turns the configuration generator on or off (default: on with the default generators); ``gate_screened=True`` sends the best screened
    configuration proposals to the gate even when the screen predicts no gain (tests of the gate path).
    """

    name = NAME

    def __init__(self, *, agency: str, generators: list[Generator] | None = None, searcher: Any = None,
                 budget_s: float | None = None, configs: bool | None = None, gate_screened: bool = False):
        self.agency = agency
        self.generators = list(generators) if generators is not None else default_generators()
        self._searcher = searcher
        self._budget_s = budget_s
        self._configs = generators is None if configs is None else configs
        self._gate_screened = gate_screened
        self.outcome: str | None = None
        self.history: list[tuple[str, str]] = []
        self.context: GraphContext | None = None
        self.deadline = 0.0
        self._gate_s: list[float] = []

    def optimize(self, session: Any) -> None:
        ctx = self._context(session)
        self.context = ctx
        budget = self._budget_s if self._budget_s is not None else float(settings.get("TILESMITH_GRAPH_BUDGET_S"))
        self.deadline = time.monotonic() + budget
        variants, not_applicable = self._portfolio(session, ctx)
        pending: list[Generator] = []
        for gen in self.generators:
            reason = gen.inapplicable(session.incumbent_source(), ctx)
            if reason is None and ctx.profile is None and self._needs_profile(gen, ctx):
                self._profile(session, ctx, variants)
                reason = gen.inapplicable(session.incumbent_source(), ctx)
            if reason is None:
                pending.append(gen)
            else:
                self.history.append((gen.name, f"skipped: {reason}"))
        if variants and ctx.profile is None and ctx.profile_error is None:
            self._profile(session, ctx, variants)
        # The profile may arrive after an earlier generator was judged; re-judge those with it.
        if ctx.profile is not None:
            for gen in list(pending):
                reason = gen.inapplicable(session.incumbent_source(), ctx)
                if reason is not None:
                    pending.remove(gen)
                    self.history.append((gen.name, f"skipped: {reason}"))
        if variants or not_applicable:
            chosen = self._config_options(session, ctx, pending, not_applicable)
            pending = chosen + pending
        ctx.incumbent_ms = ctx.profile.eager_ms if ctx.profile is not None else None
        while pending:
            reason = session.stop_reason()
            if reason:
                self.outcome = reason
                return
            source = session.incumbent_source()
            gen, gain = self._pick(pending, source, ctx)
            pending.remove(gen)
            threshold = 0.5 * ctx.min_improvement
            if gain is not None and gain < threshold and not (self._gate_screened and isinstance(gen, ConfigOption)):
                self.history.append((gen.name, f"skipped: expected gain {gain:.1%} below {threshold:.1%}"))
                continue
            if not self._time_for_gate():
                skipped = [gen.name] + [g.name for g in pending]
                self.history.append((gen.name, "skipped: graph budget spent"))
                self.outcome = "budget"
                session.note("builtin_budget", f"the built-in agent's time budget for this graph "
                             f"(TILESMITH_GRAPH_BUDGET_S={budget:g} s) is spent; not evaluated: "
                             f"{', '.join(skipped)}. The best accepted candidate so far (if any) is kept.")
                return
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
            started = time.monotonic()
            verdict = session.evaluate(proposer=f"builtin:{gen.name}", note=proposal.note + expected)
            self._gate_s.append(time.monotonic() - started)
            status = str(getattr(verdict, "status", verdict))
            self.history.append((gen.name, status))
            if getattr(verdict, "accepted", status == "accepted"):
                ctx.incumbent_ms = _accepted_ms(verdict, ctx, gen)
        reason = session.stop_reason()
        if reason:
            self.outcome = reason
            return
        self.outcome = "exhausted"
        summary = "; ".join(f"{name}: {status}" for name, status in self.history) or "no generators"
        session.note("builtin_exhausted", f"the built-in agent has nothing more to propose ({summary}).")

    # -- configuration generator --------------------------------------------------------------------
    def _portfolio(self, session: Any, ctx: GraphContext) -> tuple[list[Any], dict[str, str]]:
        """The configuration variants to compile for this graph (empty with the reason when none apply)."""
        if not self._configs:
            return [], {}
        graph = getattr(session, "graph", None)
        if getattr(graph, "fx_module", None) is None:
            return [], {configs.NAME: "the FX graph was not serialized at capture (an AOTAutograd cache hit, or "
                                      "a graph GraphPickler cannot pickle): nothing to compile again"}
        if ctx.constant_names:
            return [], {configs.NAME: "the graph has module constants the search worker cannot rebuild"}
        variants, skipped = configs.portfolio(graph.fx_program, session.incumbent_source(), ctx.device,
                                              ctx.agency)
        return variants, skipped

    def _config_options(self, session: Any, ctx: GraphContext, pending: list[Generator],
                        not_applicable: dict[str, str]) -> list[Generator]:
        """Screened variants as proposals: each ``ok`` variant alone and, where the ``cudagraph`` generator
        applies, composed with it; only the :data:`MAX_CONFIG_GATES` best by predicted time go to the gate."""
        profile = ctx.profile
        screens = tuple(profile.variants) if profile is not None else ()
        cudagraph = next((g for g in pending if g.name == "cudagraph"), None)
        options: list[ConfigOption] = []
        for screen in screens:
            if screen.status != "ok" or not screen.source or not screen.ratio or profile is None:
                continue
            base_ms = (profile.eager_ms or screen.original_ms or 0.0) / screen.ratio
            options.append(ConfigOption(screen, None, base_ms))
            if cudagraph is not None and screen.graph_ms is not None:
                options.append(ConfigOption(screen, cudagraph, screen.graph_ms + REPLAY_OVERHEAD_MS))
        options.sort(key=lambda o: o.predicted_ms)
        chosen = options[:MAX_CONFIG_GATES]
        for option in options[MAX_CONFIG_GATES:]:
            self.history.append((option.name, f"skipped: screened {option.predicted_ms:.4f} ms/call, not among "
                                              f"the {MAX_CONFIG_GATES} best"))
        for screen in screens:
            if screen.status != "ok":
                why = "not compiled" if screen.status == "skipped" else screen.status
                self.history.append((f"{configs.NAME}:{screen.name}",
                                     f"skipped: {why}{': ' + screen.error if screen.error else ''}"))
        for name, why in not_applicable.items():
            self.history.append((name if name == configs.NAME else f"{configs.NAME}:{name}", f"skipped: {why}"))
        configs.write_screen_report(_profiles_dir(session), screens, skipped=not_applicable,
                                    chosen=[o.name for o in chosen],
                                    original_ms=profile.eager_ms if profile is not None else None,
                                    wall_s=profile.wall_s if profile is not None else None)
        return list(chosen)

    def _time_for_gate(self) -> bool:
        """Whether a gate evaluation still fits in the graph's budget (estimate: the slowest one so far, else
        :data:`GATE_ESTIMATE_S`)."""
        estimate = max(self._gate_s) if self._gate_s else GATE_ESTIMATE_S
        return time.monotonic() + 0.5 * estimate <= self.deadline

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

    def _profile(self, session: Any, ctx: GraphContext, variants: list[Any] | None = None) -> None:
        """Measure the original wrapper once, and compile and screen ``variants`` in the same worker (sets
        ``ctx.profile`` or ``ctx.profile_error``)."""
        if ctx.constant_names:
            ctx.profile_error = "the graph has module constants the search worker cannot rebuild"
            return
        from tilesmith.agent.builtin.profile import SearchFailed, run_search

        searcher = self._searcher or run_search
        started = time.monotonic()
        timeout = self._search_timeout(session)
        kwargs: dict[str, Any] = {}
        if variants:
            graph = session.graph
            # Leave room for the gate after the compiles: stop starting variants once less than two gate
            # evaluations' worth of the budget is left.
            left = max(1.0, min(timeout, self.deadline - started))
            kwargs = {"variants": [v.request() for v in variants], "fx_module": graph.fx_module,
                      "deadline_s": max(1.0, left - 2 * GATE_ESTIMATE_S), "launch_configs": ctx.is_cuda,
                      "original_canonical": graph.canonical_source}
            timeout = left
        try:
            ctx.profile = searcher(session.incumbent_source(), ctx.device, timeout_s=timeout, **kwargs)
        except SearchFailed as exc:
            ctx.profile_error = str(exc)
        except Exception as exc:  # noqa: BLE001 - never let the search break the user's first call
            ctx.profile_error = f"{type(exc).__name__}: {exc}"
        if ctx.profile_error:
            session.note("builtin_search_failed", f"the built-in agent's search worker failed: {ctx.profile_error}")
        log.info("tilesmith: built-in search for %s took %.1f s", getattr(session, "graph_key", "?")[:12],
                 time.monotonic() - started)

    def _search_timeout(self, session: Any) -> float:
        limit = float(settings.get("TILESMITH_WORKER_TIMEOUT_S"))
        left = getattr(session, "time_left_s", None)
        if callable(left):
            left = left()
        if self.deadline:
            budget_left = self.deadline - time.monotonic()
            left = budget_left if not isinstance(left, (int, float)) else min(float(left), budget_left)
        return max(1.0, min(limit, float(left))) if isinstance(left, (int, float)) else limit

    def _pick(self, pending: list[Generator], source: str, ctx: GraphContext) -> tuple[Generator, float | None]:
        scored = [(gen, gen.expected_gain(source, ctx)) for gen in pending]
        best = max(range(len(scored)), key=lambda i: (scored[i][1] or 0.0, -i))
        return scored[best]


#: Screened configuration proposals sent to the gate at most (the issue's "one or two most promising").
MAX_CONFIG_GATES = 2
#: Gate wall time assumed before the first evaluation of a graph (seconds), for the budget.
GATE_ESTIMATE_S = 15.0


class ConfigOption:
    """A screened configuration variant as a generator that proposes one fixed source (the variant, or the
    variant with the ``cudagraph`` generator's runtime on top). ``predicted_ms``: screened time per call."""

    def __init__(self, screen: Any, cudagraph: Generator | None, predicted_ms: float):
        self.screen = screen
        self.cudagraph = cudagraph
        self.predicted_ms = predicted_ms
        self.name = f"{configs.NAME}:{screen.name}" + ("+cudagraph" if cudagraph is not None else "")

    def inapplicable(self, source: str, ctx: GraphContext) -> str | None:
        return None

    def expected_gain(self, source: str, ctx: GraphContext) -> float | None:
        base = ctx.incumbent_ms if ctx.incumbent_ms else (ctx.profile.eager_ms if ctx.profile else None)
        if not base:
            return None
        return 1.0 - self.predicted_ms / base

    def propose(self, source: str, ctx: GraphContext) -> Proposal:
        text = self.screen.source
        if aten_wrapper.MARKER in self.screen.patches:
            note = (f"the graph's ATen operations run one by one (no Inductor kernel); screened "
                    f"{self.screen.ratio:.3f}x vs the original")
        else:
            note = (f"Inductor recompiled with {self.screen.patches} (launch configurations its autotuners chose "
                    f"pinned: {self.screen.pinned_kernels}); screened {self.screen.ratio:.3f}x vs the original")
        if self.cudagraph is not None:
            text = self.cudagraph.propose(text, ctx).source
            note += f", composed with a whole-call CUDA graph (screened replay {self.screen.graph_ms:.4f} ms)"
        return Proposal(self.name, text, note)


def _accepted_ms(verdict: Any, ctx: GraphContext, gen: Any) -> float | None:
    """Host-measured time per call of the new incumbent, in the profile's units: the original's ``eager_ms``
    divided by the gate's confirmed speedup over the original (else the option's prediction)."""
    timing = getattr(verdict, "confirmation", None) or getattr(verdict, "timing", None)
    speedup = getattr(timing, "speedup_vs_original", None) or getattr(timing, "speedup", None)
    if ctx.profile is not None and ctx.profile.eager_ms and speedup:
        if getattr(timing, "baseline_label", "inductor") == "incumbent" and ctx.incumbent_ms and \
                getattr(timing, "speedup_vs_original", None) is None:
            return ctx.incumbent_ms / float(speedup)
        return ctx.profile.eager_ms / float(speedup)
    return getattr(gen, "predicted_ms", None)


def _profiles_dir(session: Any) -> Path | None:
    workspace = getattr(session, "workspace", None)
    return Path(workspace) / "profiles" if workspace is not None else None


def write_attempt(path: Path, wrapper: str) -> None:
    """Write ``wrapper`` into the turn file ``path``, keeping the FX-program header the ring put there."""
    from tilesmith.capture.source import strip_fx_header

    current = path.read_text(encoding="utf-8") if path.exists() else ""
    header = current[: len(current) - len(strip_fx_header(current))]
    body = strip_fx_header(wrapper)
    path.write_text(header + body, encoding="utf-8")


class BuiltinOptimizerFactory:
    """The run-level factory for ``agent_model="tilesmith/builtin"`` (no proxy, no keys, no model calls).

    ``max_model_calls`` is accepted for the protocol and ignored: the built-in agent invokes no model.
    """

    name = NAME

    def __init__(self, *, agency: str = "medium", max_model_calls: int | None = None, searcher: Any = None,
                 **options: Any):
        self.agency = agency
        self.max_model_calls = max_model_calls
        self._searcher = searcher
        self._options = options
        """Passed to every :class:`BuiltinOptimizer` (``budget_s``, ``configs``, ``gate_screened``, ``generators``)."""

    def for_graph(self, session: Any) -> BuiltinOptimizer:
        return BuiltinOptimizer(agency=getattr(session, "agency", self.agency) or self.agency,
                                searcher=self._searcher, **self._options)

    def close(self) -> None:
        """Nothing to release (search workers end with each graph's search)."""

    def calls_used(self) -> tuple[int | None, int | None]:
        """Model calls used and budget, for the progress display: always ``(0, None)``."""
        return 0, None
