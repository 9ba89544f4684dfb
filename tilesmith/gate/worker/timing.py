"""Timing samples inside one worker (the schedule, ``k``, the statistics and the spot-check choices live in the host).

Arms of one timing run live in different processes (the original in the trusted worker, the candidate in its
own worker, an incumbent in a third); each worker runs the arms it holds through a short conversation of
``time`` requests, each with a ``phase`` (the host side is :func:`tilesmith.gate.host.timing.run_timing`):

``prepare`` Make the input pool (≥ 2 recipes, :func:`tilesmith.gate.inputs.build`) on the device; warm up each
            arm this worker holds outside the samples (at least 3 calls and ``warmup_ms``); estimate its time
            per call; report what the host needs to choose ``k`` (bytes of one input set without the static
            inputs, bytes of one call's outputs, how many distinct input sets the pool allows, free memory).
``sets``    Build ``k`` live input sets whose tensors keep their addresses for the whole run. The inputs the
            host names ``static`` (the graph's parameters and buffers) are ONE buffer shared by all ``k`` sets,
            as they are in real use; every other input has ``k``.
``sample``  Refresh the ``k`` live sets **in place** with ``k`` distinct value sets (:func:`fill_set`; a static
            input once, with call 0's values), flush the cache (write a buffer larger than L2/LLC),
            synchronize, start the clock, run call ``j`` on set ``j`` for ``j < k``, keeping **every** output and
            synchronizing the whole device after each call (isolated calls, see :func:`_timed`; work left on
            other streams is inside the sample), stop the clock.
            CUDA: events recorded on the current stream; CPU (test mode): the worker process's CPU time
            (``CLOCK_PROCESS_CPUTIME_ID``, every thread of the process), so that time the scheduler gives to
            other processes on a busy machine is not counted.
``release`` Sent right after **every** sample: copy out the calls of that sample the host names in ``copy``
            (chosen by the host *after* the sample ended; usually none), then release all of its outputs. Every
            arm's sample is followed by the same request, so what a spot-check copy does to the process (its
            allocations, the caches it touches) happens after the sample it checks and before the host times
            anything else, never at the start of the worker's next sample (where it used to land, mostly
            before samples of the arm that was *not* picked).
``finish``  Copy out the last sample's picks (if the host names any), release everything, save the copies.

What a candidate can observe is the same for every sample and every call: all of its outputs from the
current sample are alive until the sample has ended (no flag says whether a sample or call is checked: the
host has not decided that in any form the worker holds), and each of the ``k`` calls of a sample reads a
different input set, so a result cache keyed on pointers, shapes, exact values or a few sampled values cannot
hit within a sample (nor, in practice, across samples: every sample's sets are shifted by a fresh host-chosen
offset). Static inputs are the same within a sample, so a cache keyed on them alone hits and returns the
previous call's result for different activations, which the spot checks see; when no non-static floating
input varies, ``k`` is 1 (:func:`tilesmith.gate.inputs.distinct_capacity`). Between samples of this worker
the host may have stopped the process (SIGSTOP) while another worker's arm was timed.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from tilesmith.gate.inputs import distinct_capacity, fill_set, static_indices
from tilesmith.gate.layout import plain_sequence
from tilesmith.gate.protocol import OUTSIDE_CLOCK
from tilesmith.gate.worker import confine, outside, seal
from tilesmith.gate.worker.bindings import T, against_expected, compact_cpu, not_plain, save_new
from tilesmith.gate.worker.runtime import InputSet, memory_facts, sync


def storage_bytes(values: Any, skip: Any = ()) -> int:
    """Bytes of the distinct storages of the tensors in ``values`` (indices in ``skip`` left out)."""
    seen: dict[int, int] = {}
    skipped = {int(i) for i in skip}
    for i, v in enumerate(plain_sequence(values) or []):
        if type(v) is torch.Tensor and i not in skipped:
            storage = v.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), int(storage.nbytes()))
    return sum(seen.values())


class _Session:
    """State of one timing run between its requests (lives in the worker only)."""

    def __init__(self, arms: dict[int, Any], pool: list[list[Any]], first: InputSet, flush: torch.Tensor,
                 static: tuple[int, ...], start: dict[str, Any]) -> None:
        self.arms, self.pool, self.first, self.flush, self.static = arms, pool, first, flush, static
        self.start = start
        """:func:`.outside.snapshot` (threads included) before the run's first timed call."""
        self.sets: list[InputSet] = []
        self.held: tuple[int, int, list[Any]] | None = None
        self.spots: list[list[Any]] = []
        self.keys: list[list[int]] = []
        self.refused: str | None = None


_STATE: dict[str, _Session | None] = {"session": None}


def _timed(device: torch.device, flush: torch.Tensor, fn: Any,
           argsets: list[list[Any]]) -> tuple[float, float, list[Any], list[str]]:
    """One sample: ``fn`` once per argument list, every output kept until the clock has stopped; also what
    :func:`.seal.seal` found, run inside the clock right after the last call (red team 20).

    CUDA: the calls are **isolated**: the whole device is synchronized after each call, so a sample is the sum of
    the calls' latencies as a caller that waits for each result sees them (the host's launch work for the call
    included, not hidden behind the previous call's kernels). Without it a graph whose host work is as long as
    its kernels timed the same under a CUDA graph as without one, while a caller that synchronizes per call (a
    decode loop, a step that reads a loss) sees the difference (H200, 2026-12-04: a GPT-2 block's wrapper screened
    at 0.30 ms per call back to back; the suite, synchronizing per call, measured 0.56 ms for it end to end and
    0.46 ms under ``mode="reduce-overhead"``).
    """
    outs: list[Any] = [None] * len(argsets)
    flush.fill_(0)
    sync(device)
    wall0 = T.perf_ns()
    if device.type == "cuda":
        start, end = T.Event(enable_timing=True), T.Event(enable_timing=True)
        T.event_record(start)
        for j, args in enumerate(argsets):
            outs[j] = fn(args)
            T.cuda_sync(device)
        sealed = seal.seal()
        T.event_record(end)
        T.event_sync(end)
        ms = T.elapsed(start, end)
    else:  # CPU time of the whole process (all threads): a busy machine delays the calls, it does not lengthen them
        t0 = T.cpu_ns()
        for j, args in enumerate(argsets):
            outs[j] = fn(args)
        sealed = seal.seal()
        ms = (T.cpu_ns() - t0) / 1e6
    wall = (T.perf_ns() - wall0) / 1e6
    return ms, wall, outs, sealed


def _no_call(args: list[Any]) -> None:
    return None


def _prepare(worker: Any, msg: dict[str, Any]) -> dict[str, Any]:
    _STATE["session"] = None
    seal.start()  # every signal blocked in the main thread until the run's end, the pending-call queue measured
    device = worker.device
    flush = torch.empty(int(msg["flush_bytes"]), dtype=torch.uint8, device=device)
    # The clock's own machinery once, before the baseline, so that whatever the runtime starts lazily for it (an
    # event's first record or synchronize) is not counted as the candidate's; the candidate's calls come after it.
    sealed: list[str] = list(_timed(device, flush, _no_call, [[]])[3])
    start = outside.snapshot(threads=True)
    # Arm indices are the host's (positions in the schedule's arm list); this worker holds some of them.
    arms = {int(a): worker.modules[name] for a, name in dict(msg["arms"]).items()}
    pool = [worker.inputs(spec) for spec in msg["pool"]]
    first = InputSet(pool[0], device, guarded=False)
    pool = [InputSet(values, device, guarded=False).values for values in pool]  # private copies, fixed addresses
    getattr(worker, "variants", {}).clear()
    static = static_indices(msg.get("static"), first.values)
    estimates: dict[str, float] = {}
    out_bytes = int(sum(int(e.get("nbytes", 0)) for e in worker.expected))
    with T.no_grad():
        warm_ms = float(msg.get("warmup_ms", 20.0))
        for a, arm in arms.items():
            spent, calls = 0.0, 0
            while calls < 3 or spent < warm_ms:
                ms, _, outs, found = _timed(device, flush, arm.fn, [first.args()])
                sealed += found
                out_bytes = max(out_bytes, storage_bytes(outs[0]))
                del outs
                spent += ms
                calls += 1
                if calls >= 1000:
                    break
            singles = []
            for _ in range(3):
                ms, _, outs, found = _timed(device, flush, arm.fn, [first.args()])
                singles.append(ms)
                sealed += found
                del outs
            estimates[str(a)] = max(statistics.median(singles), 1e-4)
    _STATE["session"] = _Session(arms, pool, first, flush, static, start)
    # From here on a candidate's process starts no process (threads stay possible and are counted): work a child
    # does is work this clock may not see (red team 18). Its warm-up above compiled whatever it compiles lazily.
    processes = confine.no_new_processes() if getattr(worker, "role", "candidate") != "trusted" else "trusted worker"
    # One forked during the warm-up, before the filter, would work through the run unseen (red team 19).
    alive, before = outside.session_processes(), int(getattr(worker, "base_processes", 0))
    found = {f"{OUTSIDE_CLOCK}processes in the worker's session after the timing warm-up": [before, alive]} \
        if alive > before else {}
    found.update({f"{OUTSIDE_CLOCK}{what} (timing warm-up)": [None, True] for what in sorted(set(sealed))})
    return {"ok": True, "estimates_ms": estimates, "static_inputs": list(static), "new_processes": processes,
            **({"state_changes": found} if found else {}),
            "set_bytes": storage_bytes(first.values, skip=static),  # what each further set adds (static: once)
            "output_bytes": out_bytes, "distinct": min(distinct_capacity(values, static) for values in pool),
            "memory": memory_facts(device),
            "method": "cuda_event" if device.type == "cuda" else "process_cpu_time"}


def _sets(worker: Any, msg: dict[str, Any]) -> dict[str, Any]:
    session = _session("the input sets were requested")
    k = max(1, int(msg["k"]))
    # One buffer (one address) for a static input across the k calls: the other sets get no copy of it.
    rest = [None if i in session.static else v for i, v in enumerate(session.pool[0])]
    sets = [session.first] + [InputSet(rest, worker.device, guarded=False) for _ in range(k - 1)]
    for iset in sets[1:]:
        for i in session.static:
            iset.values[i] = session.first.values[i]
    session.sets = sets
    return {"ok": True, "calls_per_sample": k, "memory": memory_facts(worker.device)}


def _session(what: str) -> _Session:
    session = _STATE["session"]
    if session is None:
        raise RuntimeError(f"{what} before the timing run was prepared")
    return session


def _copy_out(worker: Any, session: _Session, calls: list[Any]) -> None:
    """Copy the named calls of the held sample to the CPU (after the sample; the host chose them)."""
    if session.held is None:
        return
    r, a, outs = session.held
    session.held = None
    for c in sorted({int(c) for c in calls}):
        if not 0 <= c < len(outs):
            continue
        out = outs[c]
        problem = against_expected(out, worker.expected)
        if problem:
            session.refused = session.refused or f"round {r}, arm {a}, call {c}: {problem}"
            continue
        session.spots.append([compact_cpu(o) if type(o) is torch.Tensor else None for o in out])
        session.keys.append([r, a, c])
    del outs


def _sample(worker: Any, msg: dict[str, Any]) -> dict[str, Any]:
    session = _session("a timing sample was requested")
    if not session.sets:
        raise RuntimeError("a timing sample was requested before the input sets were built")
    _copy_out(worker, session, msg.get("copy", []))  # the host sends ``release`` first; kept for safety
    r, a = int(msg["round"]), int(msg["arm"])
    source = session.pool[int(msg["set"])]
    factors = list(msg.get("factors", []))
    shift = int(msg.get("shift", 0))
    for j, iset in enumerate(session.sets):  # static inputs: written once, with call 0's values (shift)
        fill_set(iset.values, source, factors, shift + j, skip=session.static if j else ())
    argsets = [iset.args() for iset in session.sets]
    with T.no_grad():
        T.manual_seed(int(msg.get("seed", r)))
        ms, wall, outs, sealed = _timed(worker.device, session.flush, session.arms[a].fn, argsets)
    # Right after the clock: a thread, a signal handler or a timer left by the calls could still compute their
    # outputs before the release copies one out, in no sample (red team 19); what the seal inside the clock found
    # (red team 20).
    found = outside.changes(session.start, outside.snapshot(threads=True), f"after timing sample {r}, arm {a}")
    found.update({f"{OUTSIDE_CLOCK}{what} (timing sample {r}, arm {a})": [None, True] for what in sealed})
    # Every call's result, picked or not, after the clock: a tuple subclass could do its work when read.
    odd = next(((j, why) for j, why in enumerate(map(not_plain, outs)) if why), None)
    if odd is not None and session.refused is None:
        session.refused = f"round {r}, arm {a}, call {odd[0]}: {odd[1]}"
    session.held = (r, a, outs)
    del outs
    return {"ok": True, "ms": ms, "wall_ms": wall, **({"state_changes": found} if found else {})}


def _release(worker: Any, msg: dict[str, Any]) -> dict[str, Any]:
    session = _session("a sample's outputs were released")
    _copy_out(worker, session, msg.get("copy", []))
    return {"ok": True}


def _finish(worker: Any, msg: dict[str, Any]) -> dict[str, Any]:
    session = _STATE["session"]
    if session is None:
        raise RuntimeError("the timing run was finished before it started")
    _copy_out(worker, session, msg.get("copy", []))
    _STATE["session"] = None
    seal.stop()
    answer: dict[str, Any] = {"ok": True, "keys": session.keys}
    if session.refused:
        answer["spot_refused"] = session.refused
    elif session.spots:
        save_new({"spots": session.spots, "keys": session.keys}, msg["spot_path"])
        answer["spot_path"] = msg["spot_path"]
    del session
    return answer


def run_timing(worker: Any, msg: dict[str, Any]) -> dict[str, Any]:
    """Handle one ``time`` request (``phase``: ``prepare``, ``sets``, ``sample``, ``release`` or ``finish``)."""
    phase = msg.get("phase")
    handler = {"prepare": _prepare, "sets": _sets, "sample": _sample, "release": _release,
               "finish": _finish}.get(str(phase))
    if handler is None:
        _STATE["session"] = None
        raise ValueError(f"unknown timing phase {phase!r} (expected prepare, sets, sample, release or finish)")
    return handler(worker, msg)
