"""The install stage's outcomes for one graph: an accepted wrapper installed, or the graph kept on Inductor.

:func:`install` loads an accepted candidate in the user's process, swaps it in (shadow-checked,
:mod:`tilesmith.install.verify`) and records its :class:`~tilesmith.records.BenchmarkRecord`
(:func:`benchmark_record`); :func:`install_hit` does the same for a validated artifact of the cache once the gate
re-checked it on this run's inputs; :func:`keep_inductor` records why a graph stays on Inductor. Each ends in
``track.json``'s ``status`` (``installed``, ``cache_hit`` or ``kept_inductor``). :mod:`tilesmith.optimize`
sequences these after the gate.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from tilesmith.cache.reuse import forward_cache_problems
from tilesmith.context import RunContext
from tilesmith.gate.window import StateWindow
from tilesmith.install import audit, verify
from tilesmith.install.loader import entry_point, load_wrapper, swap
from tilesmith.records import BenchmarkRecord, Candidate, GraphState, Timing, Verdict
from tilesmith.track.run import Track

log = logging.getLogger("tilesmith")


def install(run: RunContext, handle: Any, track: Track, candidate: Candidate, verdict: Verdict, *, source: str,
            loops: int) -> BenchmarkRecord | None:
    """Load ``candidate`` in the user's process, swap it in (shadow-checked, :mod:`tilesmith.install.verify`)
    and record its benchmark."""
    prep = module = None
    try:
        prep = verify.prepare(candidate.source, track.label)  # baselines before the candidate's import
        window = StateWindow(str(handle.graph.device)) if prep is not None and prep.snapshot is not None else None
        with audit.importing(prep):  # the gate worker's audit rules, on this thread, while the wrapper imports
            module = load_wrapper(candidate.source, handle.constants)
            fn = entry_point(module, handle.graph.inputs_to_check, handle.graph.mutated_input_idxs)
    except Exception as exc:  # noqa: BLE001
        if refuse_import(run, handle, track, candidate.source, prep, module):
            return None
        keep_inductor(run, track, "install_failed", f"graph {track.label}: the accepted candidate failed to load "
                      f"in the host ({type(exc).__name__}: {exc}); the graph stays on Inductor.")
        return None
    if refuse_import(run, handle, track, candidate.source, prep, module):
        return None
    changed = window.changes() if window is not None else []
    if changed:  # nothing but the import ran since the window opened: the candidate's doing
        window.restore()
        keep_inductor(run, track, "verification_failed", f"graph {track.label}: importing the accepted wrapper in "
                      f"your process changed process-global state ({'; '.join(changed[:6])}); it was put back "
                      "where it has a setter, and the graph stays on Inductor. The artifact is not stored. "
                      "(TILESMITH_VERIFY=...,state=off turns this check off.)")
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
    track.update(status="cache_hit" if source == "cache" else "installed", benchmark=record_json(record))
    return record


def install_hit(run: RunContext, handle: Any, track: Track, gate: Any, hit: tuple[Any, Any],
                background: bool = False) -> bool:
    """Install a validated artifact for this exact key after re-checking it on this run's inputs.

    ``hit``: ``(store, artifact)`` from :func:`tilesmith.cache.reuse.lookup`; ``gate``: the graph's gate (its
    ``recheck``). False when the re-check failed (recorded in ``track.json``) or the install did."""
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
    forward_cache_problems(run, track, store)
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


def refuse_import(run: RunContext, handle: Any, track: Track, source: str, prep: Any, module: Any) -> bool:
    """True (and the graph kept on Inductor, its artifact quarantined) when the wrapper's import in the user's
    process raised an event the audit refused, or left work of its own in Inductor's compile pool
    (:func:`tilesmith.install.audit.import_findings`)."""
    found = audit.import_findings(prep, module)
    if found is None:
        return False
    check, detail = found
    where = verify.quarantine(run, track.key, source, handle.graph.name, f"import in the user's process: {check}: "
                              f"{detail}")
    keep_inductor(run, track, "verification_failed", f"graph {track.label}: importing the accepted wrapper in your "
                  f"process did what the gate's rules refuse ({check}: {detail}). The graph stays on Inductor. "
                  f"{where} (TILESMITH_VERIFY=...,audit=off turns this check off.)")
    return True


def keep_inductor(run: RunContext, track: Track, kind: str, message: str) -> None:
    """The graph stays on Inductor: a ``kind`` diagnostic saying why, in the run and in ``track.json``."""
    diagnostic = run.diagnose(kind, message, track.key, track.graph.name)
    track.add_diagnostic(diagnostic)
    track.update(status="kept_inductor")


def record_json(record: BenchmarkRecord) -> dict[str, Any]:
    """``track.json``'s ``benchmark`` for an installed graph."""
    return {"torch_inductor_ms": record.torch_inductor_ms, "tilesmith_ms": record.tilesmith_ms,
            "speedup": record.speedup, "speedup_ci": list(record.speedup_ci),
            "roofline_floor_ms": record.roofline_floor_ms, "source": record.source,
            "loops_accepted": record.loops_accepted, "method": record.method}


def _verdict_from_artifact(verdict: Verdict, artifact: Any) -> Verdict:
    """A verdict carrying the artifact's stored numbers when the re-check did not re-time (too costly)."""
    lo, hi = artifact.speedup_ci
    timing = Timing(method="cuda_event", calls_per_sample=1, baseline_ms=(artifact.torch_inductor_ms,),
                    candidate_ms=(artifact.tilesmith_ms,), speedup=artifact.speedup, ci_low=lo, ci_high=hi)
    return Verdict(accepted=True, status="accepted", reasons=verdict.reasons, timing=timing,
                   report_path=verdict.report_path, evaluation_id=verdict.evaluation_id)


def _roofline(run: RunContext, handle: Any) -> Any:
    if not handle.graph.device.startswith("cuda"):
        return None
    try:
        from tilesmith.roofline import measure_device_limits, roofline_floor

        return roofline_floor(handle.graph, measure_device_limits(handle.graph.device))
    except Exception:  # noqa: BLE001 - the floor is informative; never fail an install over it
        log.debug("tilesmith: roofline floor unavailable", exc_info=True)
        return None


def _median(values: tuple[float, ...]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])
