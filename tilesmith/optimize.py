"""Optimize one graph at its first call: snapshot → cache → optimizer + gate → install.

Called by :meth:`tilesmith.pipeline.LiveRun.optimize` with the graph's fresh track. This module only sequences
the stages (inline, or in a background thread): the cache's lookup and store are :mod:`tilesmith.cache.reuse`'s,
installing and the benchmark record :mod:`tilesmith.install.installer`'s. Every outcome ends in ``track.json``'s
``status`` (``installed``, ``cache_hit`` or ``kept_inductor``) and, unless installed from the optimizer, a
diagnostic saying why.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from typing import Any

from tilesmith import settings
from tilesmith._text import sentence
from tilesmith.agent.protocol import StopOptimization
from tilesmith.cache import reuse
from tilesmith.context import RunContext
from tilesmith.install import installer
from tilesmith.install.installer import keep_inductor
from tilesmith.records import GraphState
from tilesmith.session import GraphSession
from tilesmith.track import snapshot
from tilesmith.track.run import Track

log = logging.getLogger("tilesmith")


def optimize_graph(run: RunContext, handle: Any, track: Track, inputs: list[Any], *,
                   single_process: bool = True) -> None:
    """Run the stages for ``handle``'s graph; ``inputs`` are copies of its first call's inputs.

    The stages move to a background thread for a cache hit under ``TILESMITH_CACHE_RECHECK=background`` and,
    when ``single_process``, for the optimizer under ``TILESMITH_OPTIMIZE=background`` (under torch.distributed
    the coordinator needs the leader's decision when this returns; ``TILESMITH_DIST_LEADER`` is its own mode).
    """
    import torch

    label = track.label
    odd = sorted(k for k, v in handle.constants.items() if not isinstance(v, torch.Tensor))
    if odd:
        keep_inductor(run, track, "unsupported_constants", f"graph {label} has non-tensor module constants "
                      f"{odd} that cannot be handed to an isolated worker; it stays on Inductor.")
        return
    snap = snapshot.new_snapshot_dir(label)
    try:
        snapshot.write_snapshot(snap, inputs, handle.constants)
        inputs.clear()  # the snapshot holds them now; free device memory before workers start
        hit = reuse.lookup(run, handle, track)
        deferred: tuple[str, str, str] | None = None  # (diagnostic kind, message, what the thread does)
        if hit is not None and settings.get("TILESMITH_CACHE_RECHECK") == "background":
            handle.state = GraphState.RECHECKING
            deferred = ("cache_rechecking", f"graph {track.label}: found validated artifact {track.key[:12]}; "
                        "re-checking it in the background (TILESMITH_CACHE_RECHECK=background). The graph runs "
                        "on Inductor until the re-check installs it; tilesmith.wait(model) waits for that.",
                        "recheck")
        elif single_process and hit is None and settings.get("TILESMITH_OPTIMIZE") == "background":
            deferred = ("optimizing_in_background", f"graph {track.label}: optimizing in the background "
                        "(TILESMITH_OPTIMIZE=background). The graph runs on Inductor until a candidate the gate "
                        "accepted is installed; tilesmith.wait(model) waits for the decision.", "optimize")
        if deferred is not None:
            kind, message, what = deferred
            run.diagnose(kind, message, track.key, handle.graph.name)
            _defer(run, track, snap, hit, handle, what)
            snap = None
            return
        _stages(run, handle, track, snap, hit, False)
        snap = None
    finally:
        if snap is not None:
            snapshot.remove(snap)


def _defer(run: RunContext, track: Track, snap: Any, hit: Any, handle: Any, what: str) -> None:
    """Run :func:`_stages` in a daemon thread that owns ``snap`` from here on (``run.wait`` joins it).

    Should the process exit before the thread decides, an ``atexit`` callback records that (``background_abandoned``
    in ``track.json``, a :class:`~tilesmith.errors.TilesmithWarning` on stderr) instead of leaving the track
    ``optimizing`` for good; the thread unregisters it once it has decided."""
    def at_exit() -> None:
        _abandoned(run, track, handle, thread, what)

    def body() -> None:
        try:
            _stages(run, handle, track, snap, hit, True)
        finally:
            atexit.unregister(at_exit)

    thread = threading.Thread(target=body, daemon=True, name=f"tilesmith-{what}-{track.key[:8]}")
    atexit.register(at_exit)
    run.start_background(thread)


def _abandoned(run: RunContext, track: Track, handle: Any, thread: threading.Thread, what: str) -> None:
    """At interpreter exit: the background ``what`` of ``handle``'s graph has not decided (the daemon thread dies
    with the process), so the graph ran on Inductor throughout; say so in the run folder and on stderr."""
    if not thread.is_alive() or handle.state not in (GraphState.OPTIMIZING, GraphState.RECHECKING):
        return
    job = "artifact-cache re-check" if what == "recheck" else "optimization"
    message = (f"graph {track.label}: the process exited while its background {job} was still running, so nothing "
               "was installed and the graph ran on Inductor throughout. Remedy: call tilesmith.wait(model) before "
               "the program ends (it waits for the decision).")
    try:
        keep_inductor(run, track, "background_abandoned", message)
        for kind in ("optimizing_in_background", "cache_rechecking"):  # no longer running
            run.retire_diagnostic(kind, track.key)
        import warnings

        from tilesmith.errors import TilesmithWarning

        warnings.warn(message, TilesmithWarning, stacklevel=1)
    except Exception:  # noqa: BLE001 - at exit: never raise
        log.debug("tilesmith: could not record the abandoned %s of %s", job, track.label, exc_info=True)


def _stages(run: RunContext, handle: Any, track: Track, snap: Any, hit: Any, background: bool) -> None:
    """Gate (+ cache re-check or optimizer) → install, for one graph whose snapshot is in ``snap``.

    ``background``: running in a thread after the graph's first call returned (``TILESMITH_CACHE_RECHECK=
    background`` or ``TILESMITH_OPTIMIZE=background``): the reference then comes from a trusted worker, never
    from the user's callable (which
    would run in the user's CUDA context and RNG from another thread), there is no progress display, and
    nothing may escape the thread: a failure is a diagnostic and the graph stays on Inductor.
    """
    label = track.label
    progress = None if background else _progress()
    started = time.monotonic()
    gate = None
    try:
        from tilesmith.gate import Gate, GateProblem

        problem = GateProblem(label=label, graph=handle.graph, snapshot_dir=snap,
                              original_source=handle.graph.canonical_source)
        gate = Gate(problem, reference=None if background else handle.original,
                    min_improvement=run.options.min_improvement, profiles_dir=track.profiles)
        if progress:
            progress.graph_started(label)
        if getattr(gate, "memory_problem", None):  # the graph cannot be evaluated in the memory left
            keep_inductor(run, track, "gate_memory", f"graph {gate.memory_problem}")
            outcome = "gate_memory"
        elif hit is not None and installer.install_hit(run, handle, track, gate, hit, background):
            outcome = "cache hit installed"
        else:
            outcome = _run_optimizer(run, handle, track, gate, progress)
        if progress:
            progress.graph_finished(label, outcome)
        log.info("tilesmith: graph %s: %s after %.1f s", label, outcome, time.monotonic() - started)
    except BaseException as exc:  # noqa: BLE001 - in the thread nothing may escape; inline the caller reports
        if isinstance(exc, KeyboardInterrupt):
            if handle.record is None:  # not installed yet (an interrupt while storing the artifact changes nothing)
                _interrupted(run, track, hit is not None, progress)
            raise
        if not background:
            raise
        what = "re-check" if hit is not None else "optimization"
        log.exception("tilesmith: background %s of %s failed", what, label)
        keep_inductor(run, track, "internal_error", f"graph {label}: the background {what} failed with "
                      f"{type(exc).__name__}: {exc}; the graph stays on Inductor. Please report this with the run "
                      "folder.")
    finally:
        if gate is not None:
            gate.close()
        snapshot.remove(snap)
        if handle.state in (GraphState.RECHECKING, GraphState.OPTIMIZING):
            handle.state = GraphState.INSTALLED if handle.record is not None else GraphState.KEPT_INDUCTOR
        if background:  # decided: the "running in the background" status no longer holds (the decision's own
            for kind in ("optimizing_in_background", "cache_rechecking"):  # diagnostic or record says what happened)
                run.retire_diagnostic(kind, track.key)


def _interrupted(run: RunContext, track: Track, recheck: bool, progress: Any) -> None:
    """Ctrl-C (``KeyboardInterrupt``) stopped the graph's optimization: say so before it propagates.

    Without this the graph stayed on Inductor for the rest of the process with no diagnostic, and
    ``track.json`` kept ``status: optimizing`` (``tilesmith show`` then reported it as still optimizing).
    Recording must not hide the interrupt: a failure here is only logged.
    """
    what = "artifact-cache re-check" if recheck else "first-call optimization"
    try:
        keep_inductor(run, track, "optimization_interrupted",
                      f"graph {track.label}: its {what} was interrupted (KeyboardInterrupt) before the gate "
                      "decided; the graph stays on Inductor for the rest of this process. Remedy: let the first "
                      "call finish (TILESMITH_GRAPH_BUDGET_S bounds the built-in agent's part), or set "
                      "TILESMITH_OPTIMIZE=background so that it returns at once; a new process optimizes the "
                      "graph again.")
        if progress:
            progress.graph_finished(track.label, "interrupted, kept Inductor")
    except Exception:  # noqa: BLE001 - the interrupt must still propagate
        log.exception("tilesmith: could not record the interrupted optimization of %s", track.label)


def _run_optimizer(run: RunContext, handle: Any, track: Track, gate: Any, progress: Any) -> str:
    try:
        factory = run.optimizer_factory()
    except Exception as exc:  # noqa: BLE001 - e.g. the proxy failed to start
        diagnostic = getattr(exc, "diagnostic", None)
        kind = getattr(diagnostic, "kind", None) or "optimizer_unavailable"
        message = getattr(diagnostic, "message", None) or f"{type(exc).__name__}: {exc}"
        keep_inductor(run, track, kind, f"graph {track.label}: {message}")
        return "optimizer unavailable"
    calls = getattr(factory, "calls_used", None)
    session = GraphSession(track, gate, agency=run.options.agency, loops=run.options.loops,
                           on_diagnostic=run.record_diagnostic, progress=progress, calls_used=calls)
    try:
        optimizer = factory.for_graph(session)
        optimizer.optimize(session)
    except StopOptimization:
        pass  # the stop rule ended the loop inside the optimizer (Session.new_turn): a normal end, not an error
    except Exception as exc:  # noqa: BLE001
        diagnostic = getattr(exc, "diagnostic", None)
        if diagnostic is not None:
            keep_inductor(run, track, diagnostic.kind, f"graph {track.label}: {diagnostic.message}")
            return diagnostic.kind
        log.exception("tilesmith: optimizer failed on %s", track.label)
        session.note("optimizer_error", f"the optimizer raised {type(exc).__name__}: {exc}")
    if session.incumbent is None or session.incumbent_verdict is None:
        keep_inductor(run, track, "no_improvement", _no_win_message(session))
        return "kept Inductor"
    record = installer.install(run, handle, track, session.incumbent, session.incumbent_verdict,
                               source="optimizer", loops=session.accepted_loops)
    if record is not None:
        reuse.store_artifact(run, track, session.incumbent, session.incumbent_verdict, record)
    return "installed" if record else "install failed"


def _no_win_message(session: GraphSession) -> str:
    if not session.verdicts:
        return (f"graph {session.track.label}: the optimizer proposed no candidate, so the graph stays on "
                "Inductor (where the optimizer said why, its own diagnostic for this graph is listed too).")
    stop = session.stop_reason() or "the optimizer had nothing more to propose"
    rejected = [v for v in session.verdicts if not v.accepted]
    tail = ""
    if rejected:
        last = rejected[-1]
        tail = f"; last verdict: {last.summary()}"
    text = (f"graph {session.track.label}: no candidate passed the gate after {session.turns_used} turns and "
            f"{len(session.verdicts)} evaluations ({stop}){tail}")
    return f"{sentence(text)} The graph stays on Inductor."


def _progress() -> Any:
    try:
        from tilesmith import progress

        return progress
    except ImportError:
        return None
