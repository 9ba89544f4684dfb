"""Paired timing samples inside the worker (the statistics and the spot-check choices live in the host).

A timing run is a short conversation of ``time`` requests, each with a ``phase`` (the host side is
:func:`tilesmith.gate.host.timing.run_samples`):

``start``   Load the input pool (≥ 2 sets) onto the device; warm up every arm outside the samples (at
            least 3 calls and ``warmup_ms`` per arm); estimate each arm's time per call; choose ``k``
            calls per sample (the fastest arm's sample lasts ≥ ``target_ms``, the slowest ≤
            ``max_sample_ms``), then cap ``k`` (see :func:`choose_k`) by the memory that ``k`` input
            sets and ``k`` output sets need and by how many distinct input sets the inputs allow; build
            ``k`` live input sets whose tensors keep their addresses for the whole run. The inputs the
            host names ``static`` (the graph's parameters and buffers) are ONE buffer shared by all ``k``
            sets, as they are in real use (one address across calls); every other input has ``k``.
``sample``  First copy out the outputs of the previous sample's calls that the host names in ``copy``
            (chosen by the host *after* that sample ended), release all of that sample's outputs;
            then refresh the ``k`` live sets **in place** with ``k`` distinct value sets
            (:func:`fill_set`; a static input once, with call 0's values), flush the cache (write a
            buffer larger than L2/LLC), synchronize, start the clock, run call ``j`` on set ``j`` for
            ``j < k``, keeping **every** output, synchronize the whole device (work left on other
            streams is inside the sample), stop the clock.
            CUDA: events recorded on the current stream; CPU (test mode): the worker process's CPU time
            (``CLOCK_PROCESS_CPUTIME_ID``, every thread of the process), so that time the scheduler gives to
            other processes on a busy machine is not counted.
``finish``  Copy out the last sample's picks, release everything, save the copies for the host.

What a candidate can observe is the same for every sample and every call: all of its outputs from the
current sample are alive until the sample has ended (no flag says whether a sample or call is checked:
the host has not decided that in any form the worker holds), and each of the ``k`` calls of a sample
reads a different input set, so a result cache keyed on pointers, shapes, exact values or a few sampled
values cannot hit within a sample (nor, in practice, across samples: every sample's sets are shifted by a
fresh host-chosen offset). Static inputs are the same within a sample, so a cache keyed on them alone hits
and returns the previous call's result for different activations, which the spot checks see; when no
non-static floating input varies, ``k`` is 1 (:func:`distinct_capacity`).
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from tilesmith.gate.inputs import distinct_capacity, fill_set, static_indices
from tilesmith.gate.worker.runtime import InputSet, sync

#: The worker's trusted bindings (clocks, events, ``torch.save``; see :data:`tilesmith.gate.worker.core.T`) and
#: output helpers, set by :func:`bind` when ``worker_core`` loads, before any candidate is imported; never looked
#: up again later (a candidate could have replaced ``sys.modules`` entries by then).
T: Any = None
_CORE: Any = None


def bind(trusted: Any, against_expected: Any, compact_cpu: Any) -> None:
    """Called once by :mod:`tilesmith.gate.worker.core` at import."""
    global T, _CORE
    T = trusted
    _CORE = (against_expected, compact_cpu)


#: Bytes that ``k`` live input sets plus ``k`` output sets may take: on CUDA this fraction of the memory
#: free on the device after warm-up (the rest stays for the wrappers' intermediates and the baseline);
#: on the CPU (test mode) a fixed amount.
TIMING_MEMORY_FRACTION = 0.5
TIMING_MEMORY_CPU_BYTES = 1 << 30


def choose_k(estimates_ms: list[float], target_ms: float, max_sample_ms: float, set_bytes: int, out_bytes: int,
             budget_bytes: int, distinct: int) -> tuple[int, dict[str, int]]:
    """Calls per sample: long enough for ``target_ms`` on the fastest arm, at most ``max_sample_ms`` on the
    slowest, then capped by memory (``k`` input sets + ``k`` output sets ≤ ``budget_bytes``) and by
    ``distinct`` (no input set is read twice in one sample). Never below 1. Returns ``(k, limits)``."""
    timed = int(max(1, min(-(-target_ms // min(estimates_ms)), max_sample_ms // max(estimates_ms))))
    by_memory = int(max(1, budget_bytes // max(1, set_bytes + out_bytes)))
    k = max(1, min(timed, by_memory, int(distinct)))
    return k, {"by_time": timed, "by_memory": by_memory, "by_distinct": int(distinct)}


def _storage_bytes(values: Any, skip: Any = ()) -> int:
    seen: dict[int, int] = {}
    skipped = {int(i) for i in skip}
    for i, v in enumerate(values if isinstance(values, (list, tuple)) else []):
        if isinstance(v, torch.Tensor) and i not in skipped:
            storage = v.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), int(storage.nbytes()))
    return sum(seen.values())


class _Session:
    """State of one timing run between its requests (lives in the worker only)."""

    def __init__(self, arms: list[Any], pool: list[list[Any]], sets: list[InputSet], flush: torch.Tensor,
                 k: int, static: tuple[int, ...] = ()) -> None:
        self.arms, self.pool, self.sets, self.flush, self.k = arms, pool, sets, flush, k
        self.static = static
        self.held: tuple[int, int, list[Any]] | None = None
        self.spots: list[list[Any]] = []
        self.keys: list[list[int]] = []
        self.refused: str | None = None


_STATE: dict[str, _Session | None] = {"session": None}


def _timed(device: torch.device, flush: torch.Tensor, fn: Any, argsets: list[list[Any]]) -> tuple[float, float, list[Any]]:
    """One sample: ``fn`` once per argument list, every output kept until the clock has stopped."""

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
        T.event_record(end)
        T.event_sync(end)
        ms = T.elapsed(start, end)
    else:  # CPU time of the whole process (all threads): a busy machine delays the calls, it does not lengthen them
        t0 = T.cpu_ns()
        for j, args in enumerate(argsets):
            outs[j] = fn(args)
        ms = (T.cpu_ns() - t0) / 1e6
    wall = (T.perf_ns() - wall0) / 1e6
    return ms, wall, outs


def _budget(device: torch.device) -> int:
    if device.type != "cuda":
        return TIMING_MEMORY_CPU_BYTES

    free, _total = T.mem_get_info(device)
    return int(TIMING_MEMORY_FRACTION * free)


def _start(worker: Any, msg: dict[str, Any]) -> dict[str, Any]:

    _STATE["session"] = None
    device = worker.device
    arms = [worker.modules[name] for name in msg["arms"]]
    pool_cpu = [worker.inputs(p) for p in msg["pool"]]
    pool = [InputSet(values, device, guarded=False).values for values in pool_cpu]
    first = InputSet(pool_cpu[0], device, guarded=False)
    static = static_indices(msg.get("static"), first.values)
    flush = torch.empty(int(msg["flush_bytes"]), dtype=torch.uint8, device=device)
    estimates: list[float] = []
    out_bytes = int(sum(int(e.get("nbytes", 0)) for e in worker.expected))
    with T.no_grad():
        warm_ms = float(msg.get("warmup_ms", 20.0))
        for arm in arms:
            spent, calls = 0.0, 0
            while calls < 3 or spent < warm_ms:
                ms, _, outs = _timed(device, flush, arm.fn, [first.args()])
                out_bytes = max(out_bytes, _storage_bytes(outs[0]))
                del outs
                spent += ms
                calls += 1
                if calls >= 1000:
                    break
            singles = [_timed(device, flush, arm.fn, [first.args()])[0] for _ in range(3)]
            estimates.append(max(statistics.median(singles), 1e-4))
    set_bytes = _storage_bytes(first.values, skip=static)  # what each further set adds (static inputs: once)
    distinct = min(distinct_capacity(values, static) for values in pool_cpu)
    k, limits = choose_k(estimates, float(msg["target_ms"]), float(msg["max_sample_ms"]), set_bytes, out_bytes,
                         _budget(device), distinct)
    if msg.get("calls_per_sample"):
        k = max(1, min(int(msg["calls_per_sample"]), limits["by_memory"], limits["by_distinct"]))
    # One buffer (one address) for a static input across the k calls: the other sets get no copy of it.
    rest = [None if i in static else v for i, v in enumerate(pool_cpu[0])]
    sets = [first] + [InputSet(rest, device, guarded=False) for _ in range(k - 1)]
    for iset in sets[1:]:
        for i in static:
            iset.values[i] = first.values[i]
    _STATE["session"] = _Session(arms, pool, sets, flush, k, static)
    return {"ok": True, "calls_per_sample": k, "estimates_ms": estimates, "k_limits": limits,
            "static_inputs": list(static),
            "set_bytes": set_bytes, "output_bytes": out_bytes,
            "method": "cuda_event" if device.type == "cuda" else "process_cpu_time"}


def _copy_out(worker: Any, session: _Session, calls: list[Any]) -> None:
    """Copy the named calls of the held sample to the CPU (after the sample; the host chose them)."""
    _against_expected, compact_cpu = _CORE

    if session.held is None:
        return
    r, a, outs = session.held
    session.held = None
    for c in sorted({int(c) for c in calls}):
        if not 0 <= c < len(outs):
            continue
        out = outs[c]
        problem = _against_expected(out, worker.expected)
        if problem:
            session.refused = session.refused or f"round {r}, arm {a}, call {c}: {problem}"
            continue
        session.spots.append([compact_cpu(o) if type(o) is torch.Tensor else None for o in out])
        session.keys.append([r, a, c])
    del outs


def _sample(worker: Any, msg: dict[str, Any]) -> dict[str, Any]:

    session = _STATE["session"]
    if session is None:
        raise RuntimeError("a timing sample was requested before the timing run started")
    _copy_out(worker, session, msg.get("copy", []))
    r, a = int(msg["round"]), int(msg["arm"])
    source = session.pool[int(msg["set"])]
    factors = list(msg.get("factors", []))
    shift = int(msg.get("shift", 0))
    for j, iset in enumerate(session.sets):  # static inputs: written once, with call 0's values (shift)
        fill_set(iset.values, source, factors, shift + j, skip=session.static if j else ())
    argsets = [iset.args() for iset in session.sets]
    with T.no_grad():
        T.manual_seed(int(msg.get("seed", r)))
        ms, wall, outs = _timed(worker.device, session.flush, session.arms[a].fn, argsets)
    session.held = (r, a, outs)
    del outs
    return {"ok": True, "ms": ms, "wall_ms": wall}


def _finish(worker: Any, msg: dict[str, Any]) -> dict[str, Any]:

    session = _STATE["session"]
    if session is None:
        raise RuntimeError("the timing run was finished before it started")
    _copy_out(worker, session, msg.get("copy", []))
    _STATE["session"] = None
    answer: dict[str, Any] = {"ok": True, "keys": session.keys}
    if session.refused:
        answer["spot_refused"] = session.refused
    elif session.spots:
        T.save({"spots": session.spots, "keys": session.keys}, msg["spot_path"])
        answer["spot_path"] = msg["spot_path"]
    del session
    return answer


def run_timing(worker: Any, msg: dict[str, Any]) -> dict[str, Any]:
    """Handle one ``time`` request (``phase``: ``start``, ``sample`` or ``finish``; see the module text)."""
    phase = msg.get("phase")
    if phase == "start":
        return _start(worker, msg)
    if phase == "sample":
        return _sample(worker, msg)
    if phase == "finish":
        return _finish(worker, msg)
    _STATE["session"] = None
    raise ValueError(f"unknown timing phase {phase!r} (expected start, sample or finish)")
