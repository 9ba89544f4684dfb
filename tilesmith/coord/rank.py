"""One rank's part in the job-wide decision on each graph (protocol: :mod:`tilesmith.coord`).

:class:`Coordinator` (one per process) is called from two hooks in the pipeline:

* :meth:`Coordinator.take` at a graph's first call, before the graph's track is created: on the graph's
  leader it returns ``False`` (the pipeline optimizes inline as usual, but :func:`tilesmith.install.installer.install`
  hands the accepted wrapper to :meth:`Coordinator._hold` instead of swapping it in); on every other rank it
  writes the call's inputs to a private snapshot, starts a follower thread and returns ``True``: the call
  returns on Inductor at once.
* :meth:`Coordinator.led` after the leader's inline optimization: starts the leader's thread, which
  publishes the decision and waits, like every follower, for the job's final decision.

Every rank then obeys the single final the store holds: the wrapper (whose neutral text's SHA-256 is
compared on every rank) or Inductor, with a ``dist_*`` diagnostic saying which and why. Nothing here raises
into a model call: store errors and internal errors become diagnostics, and the graph keeps Inductor.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import socket
import threading
import time
from typing import Any

from tilesmith import settings
from tilesmith.coord import devices
from tilesmith.coord.board import Board, BoardError, Final, closing
from tilesmith.records import GraphState

log = logging.getLogger("tilesmith")

TIMING_ONLY = ("rejected_slower", "rejected_marginal")
"""Re-check outcomes that mean "correct here, not measurably faster in one measurement": usable. The leader
measured speed (with confirmation); a single measurement per rank would make the job's install fail whenever
any one of N ranks measured noise."""

_POLL_S = (0.2, 1.0)
"""Store polling interval: 0.2 s for the first 10 s of a wait, then 1 s."""
HEARTBEAT_S = 1.0
_UNDECIDED = (GraphState.PENDING, GraphState.OPTIMIZING, GraphState.RECHECKING, GraphState.FOLLOWING,
              GraphState.AGREEING)
"""Graph states before the job's decision is applied on this rank."""


@dataclasses.dataclass
class _Entry:
    run: Any
    handle: Any
    ckey: str
    scope: str
    index: int | None
    leader: int | None = None
    snap: Any = None
    snap_error: str = ""
    track: Any = None
    held: tuple[Any, Any, str] | None = None
    """``(callable, BenchmarkRecord, source)`` the leader accepted, until the job's final decision."""
    source: str | None = None
    """On a follower: the leader's wrapper made concrete for this rank's device, once re-checked here."""

    @property
    def label(self) -> str:
        return self.handle.label


def record_to_json(record: Any) -> dict[str, Any]:
    """The numbers of a ``BenchmarkRecord`` that travel to the other ranks (no paths)."""
    doc = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)
           if f.name not in ("roofline", "track_dir", "graph_key", "graph_name", "kind")}
    doc["speedup_ci"] = list(record.speedup_ci)
    doc["extras"] = [list(x) for x in record.extras]
    return doc


class Coordinator:
    """This process's member of the job's decision board (created by :func:`tilesmith.coord.coordinator`)."""

    def __init__(self, board: Board, versions: dict[str, str], *, broken: str | None = None):
        self.board = board
        self.rank, self.world_size = board.rank, board.world_size
        self.broken = broken
        """Why coordination is impossible (every graph then keeps Inductor), or ``None``."""
        self.timeout_s = float(settings.get("TILESMITH_DIST_TIMEOUT_S"))
        self.liveness_s = float(settings.get("TILESMITH_DIST_LIVENESS_S"))
        self.fingerprint = {"torch": versions.get("torch"), "triton": versions.get("triton"),
                            "cuda": versions.get("cuda"), "gpu": versions.get("gpu"), "rank": self.rank,
                            "host": socket.gethostname()}
        self._fps: dict[int, dict[str, Any]] = {self.rank: self.fingerprint}
        self._occurrences: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._heart: threading.Thread | None = None

    # -- start and heartbeat ---------------------------------------------------------------------
    def start(self) -> None:
        """Publish this rank's fingerprint and start the heartbeat thread (both best effort)."""
        if self.broken:
            return
        try:
            self.board.publish_fingerprint(self.fingerprint)
            self.board.beat()
            self._refresh_fingerprints()
        except BoardError as exc:
            self.broken = str(exc)
            return
        self._heart = threading.Thread(target=self._beat_loop, name="tilesmith-dist-heartbeat", daemon=True)
        self._heart.start()
        atexit.register(self.stop)

    def stop(self) -> None:
        self._stop.set()
        if self._heart is not None and self._heart is not threading.current_thread():
            self._heart.join(2 * HEARTBEAT_S)

    def _beat_loop(self) -> None:
        failures = 0
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.board.beat()
                self._refresh_fingerprints()
                failures = 0
            except BoardError as exc:
                failures += 1
                if failures == 3:
                    log.warning("tilesmith: rank %d cannot reach the torch.distributed store: %s", self.rank, exc)

    def _refresh_fingerprints(self) -> bool:
        """Read fingerprints not yet known; True when every rank's is known."""
        for r in range(self.world_size):
            if r not in self._fps:
                fp = self.board.fingerprint(r)
                if fp is not None:
                    with self._lock:
                        self._fps[r] = fp
        return len(self._fps) == self.world_size

    # -- roles --------------------------------------------------------------------------------------
    @staticmethod
    def _same(a: dict[str, Any], b: dict[str, Any], cuda: bool) -> bool:
        fields = ("torch", "triton", "cuda", "gpu") if cuda else ("torch", "triton", "cuda")
        return all(a.get(f) == b.get(f) for f in fields)

    def _role(self, cuda: bool) -> int | None:
        """The leader's rank from the fingerprints known now, or ``None`` when a lower rank's is unknown.

        Rule: the lowest rank whose torch/Triton/CUDA versions and GPU model (for CUDA graphs) equal this
        rank's, i.e. the lowest rank whose graphs get the same cache keys; rank 0 in a homogeneous job.
        """
        with self._lock:
            fps = dict(self._fps)
        for r in range(self.rank):
            if r not in fps:
                return None
            if self._same(fps[r], self.fingerprint, cuda):
                return r
        return self.rank

    def _resolve(self, cuda: bool, deadline: float) -> tuple[int, tuple[int, ...]]:
        """``(leader, group)``: waits (until ``deadline``) for every rank's fingerprint; ranks that never
        published one by then are left out of the group."""
        started = time.monotonic()
        while not self._refresh_fingerprints() and time.monotonic() < deadline:
            self._sleep(started)
        with self._lock:
            fps = dict(self._fps)
        group = tuple(sorted(r for r, fp in fps.items() if self._same(fp, self.fingerprint, cuda)))
        return group[0], group

    # -- hooks --------------------------------------------------------------------------------------
    def take(self, run: Any, handle: Any, inputs: list[Any]) -> bool:
        """First-call hook. ``True``: this rank follows (the call returns on Inductor, ``inputs`` consumed);
        ``False``: this rank leads and the pipeline optimizes as usual."""
        index = devices.device_index(handle.graph.device)
        ckey = run._key(devices.neutral(handle.graph.canonical_source, index), run._device_of(handle.compiled))
        with self._lock:
            n = self._occurrences[ckey] = self._occurrences.get(ckey, -1) + 1
        entry = _Entry(run, handle, ckey, f"g/{ckey}/{n}", index)
        if self.broken:
            handle.state = GraphState.KEPT_INDUCTOR
            run.diagnose("dist_unavailable", f"graph {handle.label}: torch.distributed is initialised "
                         f"({self.world_size} ranks) but Tilesmith cannot use its store ({self.broken}); the "
                         "graph stays on Inductor on this rank so that no rank installs a wrapper the others "
                         "lack. Remedy: fix the store, or set TILESMITH_DISTRIBUTED=off to optimize every "
                         "rank on its own (ranks may then install different wrappers).",
                         handle.key, handle.graph.name)
            return True
        leader = self._role(handle.graph.device.startswith("cuda"))
        inline = settings.get("TILESMITH_DIST_LEADER") == "inline"
        if leader == self.rank and inline:
            entry.leader = self.rank
            handle.hold_install = lambda fn, record, source: self._hold(entry, fn, record, source)
            handle.coord_entry = entry
            return False
        self._snapshot(entry, inputs)
        if leader == self.rank:  # TILESMITH_DIST_LEADER=background: _follow leads in its thread
            handle.state = GraphState.OPTIMIZING
            run.diagnose("dist_leading", f"graph {handle.label}: this rank optimizes this graph for all "
                         f"{self.world_size} ranks, in the background (TILESMITH_DIST_LEADER=background); it runs "
                         "on Inductor until the job's decision.", handle.key, handle.graph.name)
        else:
            handle.state = GraphState.FOLLOWING
            who = (f"rank {leader}" if leader is not None else "the graph's leader (the lowest rank with this "
                   "rank's versions and GPU model)")
            run.diagnose("dist_following", f"graph {handle.label}: {who} optimizes this graph for all "
                         f"{self.world_size} ranks; this rank runs it on Inductor until the job's decision, then "
                         "re-checks and installs the accepted wrapper (or keeps Inductor).", handle.key,
                         handle.graph.name)
        run.start_background(threading.Thread(target=self._guard, args=(entry, self._follow), daemon=True,
                                              name=f"tilesmith-dist-{handle.key[:8]}"))
        return True

    def led(self, run: Any, handle: Any, track: Any) -> None:
        """After the leader's inline optimization: publish its decision from a thread."""
        entry = getattr(handle, "coord_entry", None)
        if entry is None:
            return
        entry.track = track
        run.start_background(threading.Thread(target=self._guard, args=(entry, self._lead), daemon=True,
                                              name=f"tilesmith-dist-{handle.key[:8]}"))

    def twin(self, run: Any, first: Any, handle: Any) -> None:
        """A graph identical to ``first`` (same cache key, same run) while ``first``'s job-wide decision is
        pending: it gets what ``first`` ends with (``reuse_in_run``) once that is final, so that every rank's
        twin ends the same way whichever rank heard the decision first."""
        from tilesmith.cache.reuse import reuse_in_run

        handle.state = GraphState.FOLLOWING

        def wait_then_reuse() -> None:
            started = time.monotonic()
            while first.state in _UNDECIDED:
                self._sleep(started)
            reuse_in_run(run, first, handle)

        run.start_background(threading.Thread(target=wait_then_reuse, daemon=True,
                                              name=f"tilesmith-dist-twin-{handle.key[:8]}"))

    def _hold(self, entry: _Entry, fn: Any, record: Any, source: str) -> None:
        """Called by ``install`` on the leader instead of swapping the wrapper in."""
        entry.held = (fn, record, source)
        entry.handle.state = GraphState.AGREEING
        entry.run.diagnose("dist_awaiting_agreement", f"graph {entry.label}: accepted here ({record.speedup:.3f}x); "
                           f"it is installed on every rank once all ranks have re-checked it on their own device "
                           f"(at most TILESMITH_DIST_TIMEOUT_S={self.timeout_s:g} s); this rank runs Inductor "
                           "until then.", entry.handle.key, entry.handle.graph.name)

    # -- threads ------------------------------------------------------------------------------------
    def _guard(self, entry: _Entry, body: Any) -> None:
        """Run ``body(entry)``; whatever goes wrong, the graph keeps Inductor with a diagnostic."""
        try:
            body(entry)
        except BoardError as exc:
            self._keep(entry, Final(False, "dist_unavailable", f"{exc}; this rank keeps Inductor (the other "
                                    "ranks reach the same end when the store is gone, or time out)", self.rank))
        except BaseException as exc:  # noqa: BLE001 - nothing may escape a background thread
            log.exception("tilesmith: distributed coordination of %s failed", entry.label)
            self._keep(entry, Final(False, "internal_error", f"distributed coordination failed with "
                                    f"{type(exc).__name__}: {exc}. Please report this with the run folder.",
                                    self.rank))
        finally:
            from tilesmith.track import snapshot

            if entry.snap is not None:
                snapshot.remove(entry.snap)
                entry.snap = None

    def _follow(self, entry: _Entry) -> None:
        cuda = entry.handle.graph.device.startswith("cuda")
        deadline = time.monotonic() + self.timeout_s
        leader = self._role(cuda)
        group: tuple[int, ...] | None = None
        if leader is None:
            leader, group = self._resolve(cuda, deadline)
        entry.leader = leader
        if leader == self.rank:  # no lower rank shares this environment: lead, in this thread
            self._lead_in_background(entry)
            return
        final, decision = self._await_decision(entry, deadline)
        if final is None and not decision.get("accepted"):
            final = self.board.propose_final(entry.scope, Final(
                False, "dist_kept_inductor", f"the leader (rank {leader}) accepted no wrapper: "
                f"{decision.get('reason') or 'no reason given'}", self.rank))
        if final is not None:
            self._apply(entry, final)
            return
        fn, doc = self._recheck(entry, decision)
        self.board.vote(entry.scope, fn is not None, doc)
        final = self._await_final(entry, decision["sha256"], group)
        self._apply(entry, final, fn=fn, decision=decision, recheck=doc)

    def _lead_in_background(self, entry: _Entry) -> None:
        from tilesmith import optimize
        from tilesmith.cache.reuse import lookup
        from tilesmith.install.installer import keep_inductor
        from tilesmith.track.run import Track

        run, handle = entry.run, entry.handle
        handle.hold_install = lambda fn, record, source: self._hold(entry, fn, record, source)
        handle.state = GraphState.OPTIMIZING
        track = entry.track = Track(run.folder, handle.graph, handle.key, run.options.loops)
        run.folder.save()
        track.create()
        if entry.snap is None:
            keep_inductor(run, track, "dist_kept_inductor", f"graph {entry.label}: {entry.snap_error}")
        else:
            snap, entry.snap = entry.snap, None  # _stages owns and removes it
            optimize._stages(run, handle, track, snap, lookup(run, handle, track), True)
        self._lead(entry)

    def _lead(self, entry: _Entry) -> None:
        handle, started = entry.handle, time.monotonic()
        while handle.state == GraphState.RECHECKING:  # TILESMITH_CACHE_RECHECK=background: its thread decides
            self._sleep(started)
        if entry.held is None:
            with entry.run.lock:
                seen = list(entry.run.diagnostics)
            reason = next((d.message for d in reversed(seen) if d.graph_key == handle.key
                           and not d.kind.startswith("dist_")), "no candidate passed the gate")
            self.board.publish_decision(entry.scope, {"leader": self.rank, "accepted": False, "reason": reason})
            final = self.board.propose_final(entry.scope, Final(False, "dist_kept_inductor", f"the leader (rank "
                                             f"{self.rank}) accepted no wrapper: {reason}", self.rank))
            self._apply(entry, final)
            return
        fn, record, source = entry.held
        neutral = devices.neutral(source, entry.index)
        sha = devices.source_sha256(neutral)
        self.board.publish_decision(entry.scope, {
            "leader": self.rank, "accepted": True, "source": neutral, "sha256": sha,
            "record": record_to_json(record), "graph_name": handle.graph.name})
        self.board.vote(entry.scope, True, {"sha256": sha, "status": "accepted (leader)"})
        final = self._await_final(entry, sha, None)
        self._apply(entry, final, fn=fn, decision={"sha256": sha, "leader": self.rank}, record=record)

    # -- waiting ------------------------------------------------------------------------------------
    @staticmethod
    def _sleep(started: float) -> None:
        time.sleep(_POLL_S[0] if time.monotonic() - started < 10 else _POLL_S[1])

    def _await_decision(self, entry: _Entry, deadline: float) -> tuple[Final | None, dict[str, Any]]:
        """``(final, {})`` when the job decided without this rank (or it gave up), else ``(None, decision)``."""
        leader, started = entry.leader, time.monotonic()
        watch = _Liveness(self.board, self.liveness_s)
        while True:
            final = self.board.final(entry.scope)
            if final is not None:
                return final, {}
            decision = self.board.decision(entry.scope)
            if decision is not None:
                return None, decision
            silent = watch.silent_for(leader)
            if silent is not None:
                return self.board.propose_final(entry.scope, Final(
                    False, "dist_leader_lost", f"the leader (rank {leader}) sent no heartbeat for {silent:.0f} s "
                    f"(TILESMITH_DIST_LIVENESS_S={self.liveness_s:g}) before deciding; it probably died "
                    "mid-optimization", self.rank)), {}
            if time.monotonic() > deadline:
                return self.board.propose_final(entry.scope, Final(
                    False, "dist_timeout", f"the leader (rank {leader}) published no decision within "
                    f"TILESMITH_DIST_TIMEOUT_S={self.timeout_s:g} s (is it still optimizing, or does it run "
                    "a different graph here?)", self.rank)), {}
            self._sleep(started)

    def _await_final(self, entry: _Entry, sha: str, group: tuple[int, ...] | None) -> Final:
        cuda = entry.handle.graph.device.startswith("cuda")
        started = time.monotonic()
        deadline = started + self.timeout_s
        if group is None:
            _, group = self._resolve(cuda, deadline)
        watch = _Liveness(self.board, self.liveness_s)
        last_scan = 0.0
        while True:
            final = self.board.final(entry.scope)
            if final is not None:
                return final
            proposal = closing(self.board.votes(entry.scope), self.board.veto(entry.scope), group, self.rank, sha)
            now = time.monotonic()
            if proposal is None and now - last_scan >= min(5.0, self.liveness_s / 4):
                last_scan = now
                missing = [r for r in group if not self.board.voted(entry.scope, r)]
                lost = [(r, s) for r in missing if (s := watch.silent_for(r)) is not None]
                if lost:
                    r, s = lost[0]
                    what = "the leader" if r == entry.leader else "a rank"
                    proposal = Final(False, "dist_leader_lost" if r == entry.leader else "dist_rank_lost",
                                     f"{what} (rank {r}) sent no heartbeat for {s:.0f} s before answering "
                                     f"(TILESMITH_DIST_LIVENESS_S={self.liveness_s:g})", self.rank)
                elif now > deadline:
                    proposal = Final(False, "dist_timeout", f"ranks {missing} did not answer within "
                                     f"TILESMITH_DIST_TIMEOUT_S={self.timeout_s:g} s of the decision", self.rank)
            if proposal is not None:
                return self.board.propose_final(entry.scope, proposal)
            self._sleep(started)

    # -- re-check and install ---------------------------------------------------------------------
    def _snapshot(self, entry: _Entry, inputs: list[Any]) -> None:
        import torch

        from tilesmith.track import snapshot

        handle = entry.handle
        odd = sorted(k for k, v in handle.constants.items() if not isinstance(v, torch.Tensor))
        if odd:
            entry.snap_error = f"non-tensor module constants {odd} cannot be handed to a gate worker"
            return
        snap = snapshot.new_snapshot_dir(handle.label)
        try:
            snapshot.write_snapshot(snap, inputs, handle.constants)
            entry.snap = snap
        except Exception as exc:  # noqa: BLE001 - the snapshot is for the re-check; without it this rank vetoes
            snapshot.remove(snap)
            entry.snap_error = f"this rank could not save its first call's inputs ({type(exc).__name__}: {exc})"
        inputs.clear()

    def _recheck(self, entry: _Entry, decision: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """``(callable or None, vote document)``: the leader's wrapper made concrete for this rank's device,
        re-checked by this rank's own gate (``Gate.recheck``, as for an artifact-cache hit) and loaded here."""
        from tilesmith.gate import Gate, GateProblem
        from tilesmith.install.loader import entry_point, load_wrapper
        from tilesmith.records import Candidate
        from tilesmith.track.run import Track

        run, handle = entry.run, entry.handle
        sha = decision["sha256"]

        def veto(reason: str, status: str = "unusable") -> tuple[None, dict[str, Any]]:
            return None, {"sha256": sha, "status": status, "reason": f"graph {handle.label}: {reason}"}

        if devices.source_sha256(decision["source"]) != sha:
            return veto("the published wrapper does not match its SHA-256 (corrupted in the store)")
        try:
            source = devices.retarget(decision["source"], entry.index)
        except ValueError as exc:
            return veto(str(exc))
        if devices.source_sha256(devices.neutral(source, entry.index)) != sha:
            return veto(f"the wrapper names this rank's device index ({entry.index}) in a form that cannot be "
                        "retargeted (its SHA-256 changes)")
        if entry.snap is None:
            return veto(entry.snap_error or "no snapshot of the first call")
        track = entry.track = Track(run.folder, handle.graph, handle.key, run.options.loops)
        run.folder.save()
        track.create()
        candidate = Candidate(source=source, proposer=f"rank{decision.get('leader')}",
                              note=f"accepted by rank {decision.get('leader')}, sha256 {sha[:12]}")
        try:
            gate = Gate(GateProblem(label=handle.label, graph=handle.graph, snapshot_dir=entry.snap,
                                    original_source=handle.graph.canonical_source),
                        reference=None, min_improvement=run.options.min_improvement, profiles_dir=track.profiles)
        except Exception as exc:  # noqa: BLE001 - no gate here: this rank cannot vouch for the wrapper
            return veto(f"this rank's gate could not start ({type(exc).__name__}: {exc})", "gate_unavailable")
        try:
            verdict = gate.recheck(candidate)
        finally:
            gate.close()
        doc = {"sha256": sha, "status": verdict.status,
               "speedup": verdict.timing.speedup if verdict.timing is not None else None}
        if not (verdict.accepted or verdict.status in TIMING_ONLY):
            return veto(f"its re-check on rank {self.rank} failed: {verdict.summary()}", verdict.status)
        try:
            fn = entry_point(load_wrapper(source, handle.constants), handle.graph.inputs_to_check,
                             handle.graph.mutated_input_idxs)
        except Exception as exc:  # noqa: BLE001
            return veto(f"the wrapper failed to load on rank {self.rank} ({type(exc).__name__}: {exc})")
        entry.source = source
        return fn, doc

    def _apply(self, entry: _Entry, final: Final, *, fn: Any = None, decision: dict[str, Any] | None = None,
               record: Any = None, recheck: dict[str, Any] | None = None) -> None:
        """Obey the job's ``final`` on this rank."""
        if not final.install:
            self._keep(entry, final)
            return
        if fn is None or decision is None or final.sha256 != decision.get("sha256"):
            self._keep(entry, Final(False, "dist_diverged", f"the job installs wrapper {str(final.sha256)[:12]} "
                                    "but this rank has no usable copy of it (it was not counted in the vote); "
                                    "this rank keeps Inductor", self.rank))
            return
        from tilesmith.install.loader import swap
        from tilesmith.install.installer import record_json

        run, handle = entry.run, entry.handle
        leader = int(decision.get("leader", entry.leader if entry.leader is not None else self.rank))
        if record is None:
            record = self._follower_record(entry, decision, recheck or {})
        record = dataclasses.replace(record, measured_by_rank=leader,
                                     extras=tuple(record.extras) + (("dist_source_sha256", final.sha256),))
        swap(handle.compiled, fn)
        handle.state, handle.record = GraphState.INSTALLED, record
        handle.installed_source = entry.held[2] if entry.held is not None else entry.source
        with run.lock:
            run.benchmarks.append(record)
        if entry.track is not None:
            entry.track.update(status="installed" if record.source == "optimizer" else "cache_hit",
                               benchmark=record_json(record))
        try:
            self.board.record_installed(entry.scope, final.sha256 or "")
        except BoardError:
            pass
        run.diagnose("dist_installed", f"graph {entry.label}: installed the wrapper rank {leader} accepted "
                     f"(sha256 {str(final.sha256)[:12]}, the same on every rank: {final.reason}); its numbers "
                     f"were measured by rank {leader}.", handle.key, handle.graph.name)

    def _follower_record(self, entry: _Entry, decision: dict[str, Any], recheck: dict[str, Any]) -> Any:
        from tilesmith.records import BenchmarkRecord

        doc = dict(decision.get("record") or {})
        known = {f.name for f in dataclasses.fields(BenchmarkRecord)}
        fields = {k: v for k, v in doc.items() if k in known}
        fields["speedup_ci"] = tuple(fields.get("speedup_ci") or (math.nan, math.nan))
        fields["extras"] = tuple(tuple(x) for x in fields.get("extras") or ()) + tuple(
            (f"recheck_{k}", str(v)) for k, v in sorted(recheck.items()) if k in ("status", "speedup"))
        graph = entry.handle.graph
        track_dir = str(entry.track.folder) if entry.track is not None else ""
        return BenchmarkRecord(graph_key=entry.handle.key, graph_name=graph.name, kind=graph.kind,
                               track_dir=track_dir, **fields)

    def _keep(self, entry: _Entry, final: Final) -> None:
        run, handle = entry.run, entry.handle
        handle.state, handle.record, handle.installed_source = GraphState.KEPT_INDUCTOR, None, None
        diagnostic = run.diagnose(final.kind, f"graph {entry.label}: the job keeps Inductor for this graph on "
                                  f"every rank: {final.reason}.", handle.key, handle.graph.name)
        if entry.track is not None:
            entry.track.add_diagnostic(diagnostic)
            entry.track.update(status="kept_inductor")


class _Liveness:
    """Tracks other ranks' heartbeat counters on this rank's own clock (no cross-host clock comparison)."""

    def __init__(self, board: Board, limit_s: float):
        self.board, self.limit_s = board, limit_s
        self._seen: dict[int, tuple[int | None, float]] = {}

    def silent_for(self, rank: int | None) -> float | None:
        """Seconds rank ``rank``'s heartbeat has not moved, once that exceeds the limit; else ``None``.

        A rank that never beat (its first ``tilesmith.compile`` has not run yet) is not declared lost here;
        the overall timeout covers it."""
        if rank is None:
            return None
        now = time.monotonic()
        count = self.board.heartbeat_of(rank)
        last, since = self._seen.get(rank, (None, now))
        if count != last or count is None:
            self._seen[rank] = (count, now)
            return None
        return now - since if now - since > self.limit_s else None
