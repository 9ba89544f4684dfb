"""One ``tilesmith.compile()`` run: capture → track → agent → gate → install, in that order.

:class:`LiveRun` is the sink the capture backend reports every compiled graph to. Eligible graphs get a
trampoline as their ``current_callable``; the trampoline's first (and only) call

1. copies that call's inputs into a private snapshot (the gate's inputs) and computes the user's outputs
   with the original Inductor callable, which is put back in place first;
2. creates the graph's track (``runs/<run-id>/<cache-key>/``), looks up the artifact cache, and otherwise
   runs the graph's optimizer through a :class:`~tilesmith.session.GraphSession` and the host gate;
3. installs the accepted wrapper (:mod:`tilesmith.install.loader`) and records a ``BenchmarkRecord``;
   otherwise the graph stays on Inductor with a diagnostic saying why.

Nothing in here may raise into the user's model call: every failure becomes a diagnostic and the graph
keeps its original Inductor callable.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

from tilesmith import settings
from tilesmith._compat import module_constants, versions
from tilesmith.capture import eligibility
from tilesmith.capture.backend import AOT_CACHE_HIT
from tilesmith.capture.graph import captured_graph, with_real_inputs
from tilesmith.capture.source import canonicalize, graph_name
from tilesmith.records import BenchmarkRecord, CapturedGraph, Diagnostic, GraphState
from tilesmith.track import snapshot
from tilesmith.track.key import cache_key, key_environment
from tilesmith.track.run import RunFolder, Track, new_run_id, utc_now

log = logging.getLogger("tilesmith")


@dataclass(frozen=True)
class RunOptions:
    """What one ``tilesmith.compile()`` call asked for (validated by :mod:`tilesmith.api`)."""

    agent_model: Any
    """Model name (``str``) or an ``OptimizerFactory`` object."""
    agency: str
    loops: int
    max_model_calls: int | None
    allow_cpu: bool
    min_improvement: float
    compile_mode: str | None = None

    @property
    def model_name(self) -> str | None:
        """The model name, ``custom:<name>`` for an ``OptimizerFactory``, ``None`` when no optimizer was given."""
        model = self.agent_model
        if model is None or isinstance(model, str):
            return model
        return f"custom:{getattr(model, 'name', type(model).__name__)}"


def _with_fx_module(graph: CapturedGraph, from_cache: bool) -> CapturedGraph:
    """Keep a freshly serialized FX graph by its Inductor key, or find the one kept for a graph an AOTAutograd
    cache hit loaded (:mod:`tilesmith.capture.fxgraph`: the configuration generator compiles it again)."""
    import dataclasses

    from tilesmith.capture import fxgraph

    root = fxgraph.store_root()
    if graph.fx_module is not None:
        fxgraph.save(graph.fx_module, graph.inductor_key, root)
        return graph
    if from_cache:
        found = fxgraph.lookup(graph.inductor_key, root)
        if found is not None:
            return dataclasses.replace(graph, fx_module=found)
    return graph


class GraphHandle:
    """Live state of one eligible graph: Inductor's compiled object and its original callable."""

    def __init__(self, compiled: Any, graph: CapturedGraph, key: str, constants: dict[str, Any],
                 inner_kwargs: dict[str, Any] | None = None):
        self.compiled = compiled
        self.graph = graph
        self.inner_kwargs = inner_kwargs
        """Set only while ``graph.inputs`` waits for the first real call (an AOTAutograd cache hit)."""
        self.key = key
        self.constants = constants
        self.original = compiled.current_callable
        self.state = GraphState.PENDING
        self.lock = threading.RLock()
        self.installed_source: str | None = None
        self.record: BenchmarkRecord | None = None
        self.hold_install: Any = None
        """Under torch.distributed on the graph's leader: ``install`` hands the accepted wrapper here instead of
        swapping it in; every rank installs it once the job agreed (:mod:`tilesmith.coord`)."""

    @property
    def label(self) -> str:
        return f"{self.key[:8]} ({self.graph.name})"


class LiveRun:
    """State of one ``tilesmith.compile()`` call; the capture backend's sink, and the
    :class:`~tilesmith.context.RunContext` the stages get."""

    def __init__(self, options: RunOptions, factory: Any = None):
        self.options = options
        self.run_id = new_run_id()
        self._versions: dict[str, str] | None = None
        self.folder = RunFolder(settings.cache_root(), self.run_id, {
            "created_utc": utc_now(), "agent_model": options.model_name, "agency": options.agency,
            "loops": options.loops, "max_model_calls": options.max_model_calls,
            "min_improvement": options.min_improvement, "pid": os.getpid(), "host": socket.gethostname()})
        self.folder.metadata.update(self._environment())
        if options.allow_cpu:  # the CPU gate's own bar (a per-process allowance), shown by `tilesmith show`/`report`
            from tilesmith.gate.host.stats import CPU_PROCESS_ALLOWANCE, acceptance_bar

            median_at_least, ci_low_above = acceptance_bar(options.min_improvement, CPU_PROCESS_ALLOWANCE)
            self.folder.metadata["cpu_gate_bar"] = {"median_at_least": round(median_at_least, 6),
                                                    "ci_low_above": round(ci_low_above, 6)}
        self.diagnostics: list[Diagnostic] = []
        self.benchmarks: list[BenchmarkRecord] = []
        self.handles: list[GraphHandle] = []
        self._by_key: dict[str, GraphHandle] = {}
        self._factory = factory
        self.lock = threading.Lock()
        """Guards ``diagnostics``, ``benchmarks``, ``handles`` and ``background`` (the run's background threads
        change them too); :class:`tilesmith.context.RunContext` names it for the stages."""
        self.closed = False
        self.background: list[threading.Thread] = []
        self._coordinator()  # under torch.distributed: join the job's decision board now, not in a model call

    # -- background work (TILESMITH_CACHE_RECHECK=background, TILESMITH_OPTIMIZE=background) ----
    def start_background(self, thread: threading.Thread) -> None:
        """Start and remember a daemon thread that re-checks or optimizes (and maybe installs) one graph."""
        with self.lock:
            self.background.append(thread)
        thread.start()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for every background re-check and optimization started so far; True when none is still running.

        ``timeout_s``: seconds in all (``None``: no limit)."""
        import time

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self.lock:
            threads = list(self.background)
        for thread in threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads)

    # -- diagnostics --------------------------------------------------------------------------
    def diagnose(self, kind: str, message: str, graph_key: str | None = None,
                 graph_name_: str | None = None) -> Diagnostic:
        diagnostic = Diagnostic(kind, message, graph_key, graph_name_)
        self.record_diagnostic(diagnostic)
        log.info("tilesmith: %s: %s", kind, message)
        return diagnostic

    def record_diagnostic(self, diagnostic: Diagnostic) -> None:
        with self.lock:
            self.diagnostics.append(diagnostic)
        problem = self.folder.add_diagnostic(diagnostic)
        if problem is not None:
            with self.lock:
                self.diagnostics.append(problem)

    def retire_diagnostic(self, kind: str, graph_key: str) -> None:
        with self.lock:
            self.diagnostics[:] = [d for d in self.diagnostics if not (d.kind == kind and d.graph_key == graph_key)]

    # -- capture sink -------------------------------------------------------------------------
    def on_compiled(self, compiled: Any, fx_program: str, example_inputs: Any, kwargs: dict[str, Any]) -> None:
        """Check eligibility of a freshly compiled graph and, if eligible, install the trampoline."""
        source = str(getattr(compiled, "source_code", "") or "")
        name = graph_name(source) or f"{kwargs.get('graph_id', '?')}_graph"
        key = self._key(canonicalize(source), self._device_of(compiled)) if source else None
        label = f"{key[:8]} ({name})" if key else name
        refused = eligibility.refusal(compiled, example_inputs, kwargs, allow_cpu=self.options.allow_cpu,
                                      label=label)
        if refused:
            self.diagnose(refused[0], refused[1], key, name)
            return
        graph = captured_graph(compiled, fx_program, example_inputs, kwargs,
                               compile_mode=self.options.compile_mode)
        from_cache = bool(kwargs.get(AOT_CACHE_HIT))
        graph = _with_fx_module(graph, from_cache)
        handle = GraphHandle(compiled, graph, key or "", module_constants(compiled),
                             inner_kwargs=dict(kwargs) if from_cache else None)
        eligibility.claim(compiled)
        with self.lock:
            self.handles.append(handle)
        compiled.current_callable = self._trampoline(handle)

    def _trampoline(self, handle: GraphHandle) -> Any:
        def first_call(args: list[Any]) -> Any:
            with handle.lock:
                if handle.state != GraphState.PENDING:  # another thread got here first
                    return handle.compiled.current_callable(args)
                handle.state = GraphState.OPTIMIZING
                handle.compiled.current_callable = handle.original
                if handle.inner_kwargs is not None and not self._inputs_from_call(handle, args):
                    return handle.original(args)
                copies = [snapshot.copy_input(a) for a in args]
                outputs = handle.original(args)
                try:
                    self.optimize(handle, copies)
                except BaseException as exc:  # noqa: BLE001 - never break the user's call
                    if isinstance(exc, KeyboardInterrupt):
                        raise
                    log.exception("tilesmith: optimization of %s failed", handle.label)
                    self.diagnose("internal_error", f"graph {handle.label}: optimization failed with "
                                  f"{type(exc).__name__}: {exc}; the graph stays on Inductor. Please report "
                                  "this with the run folder.", handle.key, handle.graph.name)
                    handle.state = GraphState.KEPT_INDUCTOR
                return outputs

        first_call._boxed_call = True  # type: ignore[attr-defined]
        return first_call

    def _inputs_from_call(self, handle: GraphHandle, args: list[Any]) -> bool:
        """Record the input specs of a graph an AOTAutograd cache hit loaded, from its first real call.

        Returns False (graph kept on Inductor, with a diagnostic) when a real argument is not a tensor: a static
        graph has tensor inputs only, and the cache-hit path cannot see whether a scalar was symbolic (e.g. an
        unbacked SymInt a backward graph receives), which ``inner_compile``'s fake inputs would have shown.
        """
        import torch

        kwargs, handle.inner_kwargs = handle.inner_kwargs, None
        scalars = [i for i, a in enumerate(args) if not isinstance(a, torch.Tensor)]
        try:
            if not scalars:
                handle.graph = with_real_inputs(handle.graph, args, kwargs or {})
                return True
            kind, why = "dynamic_shapes", (f"inputs {scalars} are not tensors (symbolic sizes or scalars); "
                                           "Tilesmith optimizes static-shape graphs only. Remedy: compile with "
                                           "dynamic=False, or avoid data-dependent sizes (.item()) in this region.")
        except Exception as exc:  # noqa: BLE001 - never break the user's call
            kind, why = "internal_error", (f"its input specs could not be read ({type(exc).__name__}: {exc}). "
                                           "Please report this with the run folder.")
        handle.state = GraphState.KEPT_INDUCTOR
        self.diagnose(kind, f"graph {handle.label} (loaded from the AOTAutograd cache): {why} It stays on "
                      "Inductor.", handle.key, handle.graph.name)
        return False

    # -- the pipeline -------------------------------------------------------------------------
    def optimize(self, handle: GraphHandle, inputs: list[Any]) -> None:
        """Steps 2–3 of the module docstring for one graph (runs inside its first call)."""
        from tilesmith.cache.reuse import reuse_in_run
        from tilesmith.optimize import optimize_graph

        with self.lock:
            first = self._by_key.setdefault(handle.key, handle)
        coordinator = self._coordinator()
        if first is not handle:
            undecided = (GraphState.OPTIMIZING, GraphState.FOLLOWING, GraphState.AGREEING, GraphState.RECHECKING)
            if coordinator is not None and first.state in undecided:
                coordinator.twin(self, first, handle)  # gets the job's decision on its twin, on every rank alike
                return
            reuse_in_run(self, first, handle)
            return
        if coordinator is not None and coordinator.take(self, handle, inputs):
            return  # this call stays on Inductor; the job's decision arrives in a background thread
        problem = self.folder.open()  # the run folder exists from its first tracked graph on
        if problem is not None:
            self.record_diagnostic(problem)
        track = Track(self.folder, handle.graph, handle.key, self.options.loops)  # in a temporary folder after that
        track.create()
        try:
            optimize_graph(self, handle, track, inputs, single_process=coordinator is None)
        finally:
            if coordinator is not None:
                coordinator.led(self, handle, track)

    def _coordinator(self) -> Any:
        """The process's torch.distributed coordinator (:mod:`tilesmith.coord`), or ``None`` (single process)."""
        from tilesmith.coord import coordinator

        return coordinator(self)

    def optimizer_factory(self) -> Any:
        """The run's optimizer factory, created at the first graph that needs one."""
        with self.lock:
            if self._factory is None:
                from tilesmith.agent import make_factory

                self._factory = make_factory(self.options, self.folder.folder)
            return self._factory

    def close(self) -> None:
        """Release run-level resources (the LLM proxy); idempotent; called when the model is collected."""
        if self.closed:
            return
        self.closed = True
        factory, self._factory = self._factory, None
        if factory is not None:
            try:
                factory.close()
            except Exception:  # noqa: BLE001
                log.debug("tilesmith: closing the optimizer factory failed", exc_info=True)

    # -- helpers ------------------------------------------------------------------------------
    def _environment(self) -> dict[str, str]:
        v = self.versions()
        return {"torch": v["torch"], "triton": v["triton"], "cuda": v["cuda"], "device_name": v["gpu"]}

    def versions(self) -> dict[str, str]:
        if self._versions is None:
            self._versions = versions()
        return self._versions

    def _key(self, canonical: str, device: str) -> str:
        env = key_environment(versions=self.versions(), device=device, agent_model=self.options.model_name,
                              agency=self.options.agency, loops=self.options.loops,
                              min_improvement=self.options.min_improvement)
        return cache_key(canonical, env)

    @staticmethod
    def _device_of(compiled: Any) -> str:
        types = sorted(str(d) for d in (getattr(compiled, "device_types", None) or ()))
        return "cuda" if "cuda" in types else (types[0] if types else "cpu")
