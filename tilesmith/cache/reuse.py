"""Reuse of validated wrappers: the artifact cache across runs, and an identical twin within one run.

:func:`lookup` finds a validated artifact for a graph's key before the optimizer runs (the gate re-checks it and
:func:`tilesmith.install.installer.install_hit` installs it); :func:`store_artifact` keeps an installed winner for
later runs; :func:`reuse_in_run` gives a graph what its twin (same key, same run) got. Problems of the store
become run diagnostics (:func:`forward_cache_problems`); a broken store degrades to no caching.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tilesmith import settings
from tilesmith.cache.artifact import Artifact, environment_snapshot, reports_from_track
from tilesmith.cache.store import ArtifactStore
from tilesmith.context import RunContext
from tilesmith.install import audit, verify
from tilesmith.install.loader import entry_point, load_wrapper, swap
from tilesmith.records import BenchmarkRecord, Candidate, GraphState, Verdict
from tilesmith.track.run import Track


def lookup(run: RunContext, handle: Any, track: Track) -> tuple[Any, Any] | None:
    """``(store, artifact)`` for an exact hit on this graph's key, else ``None`` (problems become diagnostics)."""
    try:
        store = ArtifactStore(settings.cache_root())
        artifact = store.get(track.key)
    except Exception as exc:  # noqa: BLE001 - a broken store degrades to no caching
        run.diagnose("cache_error", f"graph {track.label}: artifact cache unreadable ({exc}); optimizing "
                     "as usual.", track.key, handle.graph.name)
        return None
    forward_cache_problems(run, track, store)
    return None if artifact is None else (store, artifact)


def store_artifact(run: RunContext, track: Track, candidate: Candidate, verdict: Verdict,
                   record: BenchmarkRecord) -> None:
    """Keep the installed ``candidate`` with its gate reports and numbers under the graph's key."""
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
        forward_cache_problems(run, track, store)
    except Exception as exc:  # noqa: BLE001
        run.diagnose("cache_error", f"graph {track.label}: could not store the artifact ({exc}); the "
                     "installed graph is unaffected.", track.key, record.graph_name)


def forward_cache_problems(run: RunContext, track: Track, store: Any) -> None:
    """Turn the store's recorded problems (corrupted entry, unwritable disk) into run diagnostics."""
    for problem in store.take_problems():
        run.diagnose(problem.kind, f"graph {track.label}: {problem.message}", track.key, track.graph.name)


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
        prep = verify.prepare(source, handle.label)
        with audit.importing(prep):
            module = load_wrapper(source, handle.constants)
            fn = entry_point(module, handle.graph.inputs_to_check, handle.graph.mutated_input_idxs)
        found = audit.import_findings(prep, module)
        if found is not None:
            raise PermissionError(f"its import did what the gate's rules refuse ({found[0]}: {found[1]})")
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
