"""Optimize one graph at its first call: snapshot → cache → optimizer + gate → install.

Called by :meth:`tilesmith.pipeline.LiveRun.optimize` with the graph's fresh track. Every outcome ends in
``track.json``'s ``status`` (``installed``, ``cache_hit`` or ``kept_inductor``) and, unless installed from
the optimizer, a diagnostic saying why.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from typing import Any

from tilesmith import settings
from tilesmith._text import sentence
from tilesmith.agent.protocol import StopOptimization
from tilesmith.context import RunContext
from tilesmith.install import verify
from tilesmith.install.loader import entry_point, load_wrapper, swap
from tilesmith.records import BenchmarkRecord, Candidate, GraphState, Timing, Verdict
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
        _keep(run, track, "unsupported_constants", f"graph {label} has non-tensor module constants {odd} "
              "that cannot be handed to an isolated worker; it stays on Inductor.")
        return
    snap = snapshot.new_snapshot_dir(label)
    try:
        snapshot.write_snapshot(snap, inputs, handle.constants)
        inputs.clear()  # the snapshot holds them now; free device memory before workers start
        hit = _lookup(run, handle, track)
        if hit is not None and settings.get("TILESMITH_CACHE_RECHECK") == "background":
            handle.state = GraphState.RECHECKING
            run.diagnose("cache_rechecking", f"graph {track.label}: found validated artifact {track.key[:12]}; "
                         "re-checking it in the background (TILESMITH_CACHE_RECHECK=background). The graph runs "
                         "on Inductor until the re-check installs it; tilesmith.wait(model) waits for that.",
                         track.key, handle.graph.name)
            _defer(run, track, snap, hit, handle, "recheck")
            snap = None
            return
        if single_process and hit is None and settings.get("TILESMITH_OPTIMIZE") == "background":
            run.diagnose("optimizing_in_background", f"graph {track.label}: optimizing in the background "
                         "(TILESMITH_OPTIMIZE=background). The graph runs on Inductor until a candidate the gate "
                         "accepted is installed; tilesmith.wait(model) waits for the decision.",
                         track.key, handle.graph.name)
            _defer(run, track, snap, hit, handle, "optimize")
            snap = None
            return
        _stages(run, handle, track, snap, hit, False)
        snap = None
    finally:
        if snap is not None:
            snapshot.remove(snap)


def _defer(run: RunContext, track: Track, snap: Any, hit: Any, handle: Any, what: str) -> None:
    """Run :func:`_stages` in a daemon thread that owns ``snap`` from here on (``run.wait`` joins it)."""
    thread = threading.Thread(target=_stages, args=(run, handle, track, snap, hit, True), daemon=True,
                              name=f"tilesmith-{what}-{track.key[:8]}")
    run.start_background(thread)


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
            _keep(run, track, "gate_memory", f"graph {gate.memory_problem}")
            outcome = "gate_memory"
        elif hit is not None and _install_hit(run, handle, track, gate, hit, background):
            outcome = "cache hit installed"
        else:
            outcome = _run_optimizer(run, handle, track, gate, progress)
        if progress:
            progress.graph_finished(label, outcome)
        log.info("tilesmith: graph %s: %s after %.1f s", label, outcome, time.monotonic() - started)
    except BaseException as exc:  # noqa: BLE001 - in the thread nothing may escape; inline the caller reports
        if not background or isinstance(exc, KeyboardInterrupt):
            raise
        what = "re-check" if hit is not None else "optimization"
        log.exception("tilesmith: background %s of %s failed", what, label)
        _keep(run, track, "internal_error", f"graph {label}: the background {what} failed with "
              f"{type(exc).__name__}: {exc}; the graph stays on Inductor. Please report this with the run folder.")
    finally:
        if gate is not None:
            gate.close()
        snapshot.remove(snap)
        if handle.state in (GraphState.RECHECKING, GraphState.OPTIMIZING):
            handle.state = GraphState.INSTALLED if handle.record is not None else GraphState.KEPT_INDUCTOR


def _run_optimizer(run: RunContext, handle: Any, track: Track, gate: Any, progress: Any) -> str:
    try:
        factory = run.optimizer_factory()
    except Exception as exc:  # noqa: BLE001 - e.g. the proxy failed to start
        diagnostic = getattr(exc, "diagnostic", None)
        kind = getattr(diagnostic, "kind", None) or "optimizer_unavailable"
        message = getattr(diagnostic, "message", None) or f"{type(exc).__name__}: {exc}"
        _keep(run, track, kind, f"graph {track.label}: {message}")
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
            _keep(run, track, diagnostic.kind, f"graph {track.label}: {diagnostic.message}")
            return diagnostic.kind
        log.exception("tilesmith: optimizer failed on %s", track.label)
        session.note("optimizer_error", f"the optimizer raised {type(exc).__name__}: {exc}")
    if session.incumbent is None or session.incumbent_verdict is None:
        _keep(run, track, "no_improvement", _no_win_message(session))
        return "kept Inductor"
    record = install(run, handle, track, session.incumbent, session.incumbent_verdict, source="optimizer",
                     loops=session.accepted_loops)
    if record is not None:
        _store_artifact(run, track, session.incumbent, session.incumbent_verdict, record)
    return "installed" if record else "install failed"


def install(run: RunContext, handle: Any, track: Track, candidate: Candidate, verdict: Verdict, *, source: str,
            loops: int) -> BenchmarkRecord | None:
    """Load ``candidate`` in the user's process, swap it in (shadow-checked, :mod:`tilesmith.install.verify`)
    and record its benchmark."""
    try:
        prep = verify.prepare()  # thread baseline before the candidate's import
        module = load_wrapper(candidate.source, handle.constants)
        fn = entry_point(module, handle.graph.inputs_to_check, handle.graph.mutated_input_idxs)
    except Exception as exc:  # noqa: BLE001
        _keep(run, track, "install_failed", f"graph {track.label}: the accepted candidate failed to load in "
              f"the host ({type(exc).__name__}: {exc}); the graph stays on Inductor.")
        return None
    record = benchmark_record(run, handle, track, verdict, source=source, loops=loops)
    handle.installed_source, handle.record = candidate.source, record
    fn = verify.guard(run, handle, track, fn, module, candidate.source, prep)  # production verification
    hold = getattr(handle, "hold_install", None)
    if hold is not None:  # torch.distributed leader: installed once every rank agreed (tilesmith/coord)
        hold(fn, record, candidate.source)
        return record
    swap(handle.compiled, fn)
    handle.state = GraphState.INSTALLED
    with run.lock:
        run.benchmarks.append(record)
    track.update(status="cache_hit" if source == "cache" else "installed", benchmark=_record_json(record))
    return record


def reuse_in_run(run: RunContext, first: Any, handle: Any) -> None:
    """Install for ``handle`` what its identical twin ``first`` (same cache key, same run) got.

    Dynamo recompiles (a new ``requires_grad`` or grad mode, say) can produce the very same wrapper again in one
    run. It shares the twin's track folder; the validated source is loaded with this graph's own constants
    (it passed the gate in this process on this wrapper), or the graph stays on Inductor like its twin.
    """
    twin = f"graph {handle.label} is identical to graph {first.graph.name} optimized earlier in this run"
    source, record = getattr(first, "installed_source", None), getattr(first, "record", None)
    if first.state != GraphState.INSTALLED or source is None or record is None:
        handle.state = GraphState.KEPT_INDUCTOR
        why = {GraphState.RECHECKING: "whose cached artifact is still being re-checked in the background; this one "
                                      "stays on Inductor.",
               GraphState.UNINSTALLED: "whose wrapper production verification uninstalled; this one stays on Inductor."
               }.get(first.state, "which stayed on Inductor; so does this one.")
        run.diagnose("duplicate_graph", f"{twin}, {why}", handle.key, handle.graph.name)
        return
    try:
        prep = verify.prepare()
        module = load_wrapper(source, handle.constants)
        fn = entry_point(module, handle.graph.inputs_to_check, handle.graph.mutated_input_idxs)
        first_verifier = verify.verifier_of(first)
        swap(handle.compiled, verify.guard(run, handle, getattr(first_verifier, "track", None), fn, module, source,
                                           prep))
    except Exception as exc:  # noqa: BLE001
        handle.state = GraphState.KEPT_INDUCTOR
        run.diagnose("install_failed", f"{twin}; loading its validated wrapper failed ({type(exc).__name__}: "
                     f"{exc}); this graph stays on Inductor.", handle.key, handle.graph.name)
        return
    handle.state = GraphState.INSTALLED
    with run.lock:
        run.benchmarks.append(dataclasses.replace(record, graph_name=handle.graph.name, kind=handle.graph.kind))
    run.diagnose("duplicate_graph", f"{twin}; installed the same validated wrapper (numbers from that graph's "
                 "confirmation).", handle.key, handle.graph.name)


def benchmark_record(run: RunContext, handle: Any, track: Track, verdict: Verdict, *, source: str,
                     loops: int) -> BenchmarkRecord:
    """Inductor-vs-Tilesmith numbers from the confirmation's paired samples (host-computed)."""
    timing: Timing = verdict.confirmation or verdict.timing  # type: ignore[assignment]
    if timing.original_ms:
        inductor_ms = _median(timing.original_ms)
        speedup = timing.speedup_vs_original or inductor_ms / timing.candidate_median_ms
        ci = tuple(getattr(timing, "speedup_vs_original_ci", None) or (math.nan, math.nan))
    else:
        inductor_ms = timing.baseline_median_ms
        speedup, ci = timing.speedup, (timing.ci_low, timing.ci_high)
    floor = _roofline(run, handle)
    return BenchmarkRecord(
        graph_key=track.key, graph_name=handle.graph.name, kind=handle.graph.kind,
        torch_inductor_ms=inductor_ms, tilesmith_ms=timing.candidate_median_ms, speedup=speedup,
        speedup_ci=(float(ci[0]), float(ci[1])), source=source, loops_accepted=loops,
        track_dir=str(track.folder), roofline_floor_ms=floor.floor_ms if floor else None, roofline=floor,
        method=timing.method)


def _lookup(run: RunContext, handle: Any, track: Track) -> tuple[Any, Any] | None:
    """``(store, artifact)`` for an exact hit on this graph's key, else ``None`` (problems become diagnostics)."""
    try:
        from tilesmith.cache import ArtifactStore
    except ImportError:
        return None
    try:
        store = ArtifactStore(settings.cache_root())
        artifact = store.get(track.key)
    except Exception as exc:  # noqa: BLE001 - a broken store degrades to no caching
        run.diagnose("cache_error", f"graph {track.label}: artifact cache unreadable ({exc}); optimizing "
                     "as usual.", track.key, handle.graph.name)
        return None
    _forward_cache_problems(run, track, store)
    return None if artifact is None else (store, artifact)


def _install_hit(run: RunContext, handle: Any, track: Track, gate: Any, hit: tuple[Any, Any],
                 background: bool = False) -> bool:
    """Install a validated artifact for this exact key after re-checking it on this run's inputs."""
    store, artifact = hit
    candidate = Candidate(source=artifact.source, proposer="cache", note=f"artifact {track.key[:8]}")
    verdict = gate.recheck(candidate)
    if not verdict.accepted:
        # In track.json too (an evaluation by "cache" naming its gate report, and the diagnostic), so that
        # `tilesmith show`/`report` list it with the graph.
        track.record_evaluation(verdict.evaluation_id or "recheck", None, "cache", verdict)
        diagnostic = run.diagnose("cache_recheck_failed", f"graph {track.label}: the cached artifact failed its "
                                  f"re-check on this run's inputs ({verdict.summary()}); optimizing as usual.",
                                  track.key, handle.graph.name)
        track.add_diagnostic(diagnostic)
        return False
    store.write_cache_json(track.folder, track.key, artifact)
    _forward_cache_problems(run, track, store)
    if verdict.timing is None and verdict.confirmation is None:
        verdict = _verdict_from_artifact(verdict, artifact)
    record = install(run, handle, track, candidate, verdict, source="cache", loops=0)
    if record is not None:
        how = ("in the background, against a trusted worker's reference" if background
               else "before this graph's first call returned")
        run.diagnose("cache_hit", f"graph {track.label}: installed validated artifact {track.key[:12]} "
                     f"without running the optimizer (re-checked on this run's inputs {how}).", track.key,
                     handle.graph.name)
    return record is not None


def _store_artifact(run: RunContext, track: Track, candidate: Candidate, verdict: Verdict,
                    record: BenchmarkRecord) -> None:
    try:
        from tilesmith.cache import Artifact, ArtifactStore, environment_snapshot, reports_from_track
    except ImportError:
        return
    try:
        accepted = [e["id"] for e in track.state["evaluations"] if e.get("accepted") and e.get("id")]
        artifact = Artifact(source=candidate.source, reports=reports_from_track(track.folder, accepted),
                            speedup=record.speedup, speedup_ci=record.speedup_ci,
                            torch_inductor_ms=record.torch_inductor_ms, tilesmith_ms=record.tilesmith_ms,
                            environment=environment_snapshot(track.graph.device), graph_name=record.graph_name,
                            kind=record.kind, proposer=candidate.proposer, origin_run_id=run.run_id,
                            loops_accepted=record.loops_accepted, roofline_floor_ms=record.roofline_floor_ms)
        store = ArtifactStore(settings.cache_root())
        store.put(track.key, artifact)
        _forward_cache_problems(run, track, store)
    except Exception as exc:  # noqa: BLE001
        run.diagnose("cache_error", f"graph {track.label}: could not store the artifact ({exc}); the "
                     "installed graph is unaffected.", track.key, record.graph_name)


def _forward_cache_problems(run: RunContext, track: Track, store: Any) -> None:
    """Turn the store's recorded problems (corrupted entry, unwritable disk) into run diagnostics."""
    for problem in store.take_problems():
        run.diagnose(problem.kind, f"graph {track.label}: {problem.message}", track.key, track.graph.name)


def _verdict_from_artifact(verdict: Verdict, artifact: Any) -> Verdict:
    """A verdict carrying the artifact's stored numbers when the re-check did not re-time (too costly)."""
    lo, hi = artifact.speedup_ci
    timing = Timing(method="cuda_event", calls_per_sample=1, baseline_ms=(artifact.torch_inductor_ms,),
                    candidate_ms=(artifact.tilesmith_ms,), speedup=artifact.speedup, ci_low=lo, ci_high=hi)
    return Verdict(accepted=True, status="accepted", reasons=verdict.reasons, timing=timing,
                   report_path=verdict.report_path, evaluation_id=verdict.evaluation_id)


def _keep(run: RunContext, track: Track, kind: str, message: str) -> None:
    diagnostic = run.diagnose(kind, message, track.key, track.graph.name)
    track.add_diagnostic(diagnostic)
    track.update(status="kept_inductor")


def _no_win_message(session: GraphSession) -> str:
    if not session.verdicts:
        return (f"graph {session.track.label}: the optimizer proposed no candidate (an optimizer that says "
                "why records its own diagnostic for this graph). The graph stays on Inductor.")
    stop = session.stop_reason() or "the optimizer had nothing more to propose"
    rejected = [v for v in session.verdicts if not v.accepted]
    tail = ""
    if rejected:
        last = rejected[-1]
        tail = f"; last verdict: {last.summary()}"
    text = (f"graph {session.track.label}: no candidate passed the gate after {session.turns_used} turns and "
            f"{len(session.verdicts)} evaluations ({stop}){tail}")
    return f"{sentence(text)} The graph stays on Inductor."


def _roofline(run: RunContext, handle: Any) -> Any:
    if not handle.graph.device.startswith("cuda"):
        return None
    try:
        from tilesmith.roofline import measure_device_limits, roofline_floor

        return roofline_floor(handle.graph, measure_device_limits(handle.graph.device))
    except Exception:  # noqa: BLE001 - the floor is informative; never fail an install over it
        log.debug("tilesmith: roofline floor unavailable", exc_info=True)
        return None


def _progress() -> Any:
    try:
        from tilesmith import progress

        return progress
    except ImportError:
        return None


def _record_json(record: BenchmarkRecord) -> dict[str, Any]:
    return {"torch_inductor_ms": record.torch_inductor_ms, "tilesmith_ms": record.tilesmith_ms,
            "speedup": record.speedup, "speedup_ci": list(record.speedup_ci),
            "roofline_floor_ms": record.roofline_floor_ms, "source": record.source,
            "loops_accepted": record.loops_accepted, "method": record.method}


def _median(values: tuple[float, ...]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])
