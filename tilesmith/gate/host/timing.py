"""Host side of timing: build the randomized schedule, drive the samples, spot-check timed outputs,
compute the statistic.

The worker only executes samples and returns raw times (see :mod:`tilesmith.gate.worker.timing`); every
number in a :class:`~tilesmith.records.Timing` is computed here, in the host, from those samples. Which
timed calls are spot-checked is decided here from the operating system's randomness (``secrets``), never
sent ahead: after each sample the host names the calls of *that* sample whose outputs the worker copies
out (usually none), in the request for the next sample.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tilesmith.gate.host import stats
from tilesmith.gate.host.compare import compare_output
from tilesmith.gate.inputs import apply_factors, clone_layout, roll_finite_, static_indices, timing_factors
from tilesmith.errors import WorkerError
from tilesmith.gate.host.reference import OutputTooLarge, RefResult, load_checked
from tilesmith.records import CheckFailure, Timing

#: Target and ceiling of one sample's duration (ms). CUDA events resolve ~0.5 µs, so a ≥ 1 ms sample
#: keeps resolution error ≤ 0.05 %; CPU samples (the worker's CPU time, test mode) are longer so that cache
#: and frequency effects of other processes average out.
SAMPLE_TARGET_MS = {"cuda": 1.0, "cpu": 5.0}
SAMPLE_MAX_MS = {"cuda": 50.0, "cpu": 60.0}
#: Cache flush size: CUDA ≥ 2× L2 (H200: 2 × 60 MiB), CPU (test mode) 32 MiB.
MIN_FLUSH_BYTES = {"cuda": 64 * 1024 * 1024, "cpu": 32 * 1024 * 1024}
#: Spot checks per phase: candidate samples (the last round's always among them) and samples of each
#: baseline arm; in each chosen sample one call, uniform over the sample's ``k`` calls, chosen after it
#: ended. A candidate that returns wrong results on a fraction ``f`` of its timed calls (the only cheat
#: left once it cannot tell checked calls from others) escapes one phase with probability ``(1 - f)^12``:
#: 0.28 for f = 10 %, 0.03 for f = 25 %; the confirmation phase squares that. Each check costs one
#: reference call and one output copy.
SPOT_CHECKS = 12
SPOT_CHECKS_BASELINE = 2


@dataclass
class Schedule:
    """``rounds``: per round the input set, arm order, factors, RNG seed and roll offset (sent per sample).
    ``spots``: the secret (round, arm) samples to check (never sent); ``picks``: (round, arm, call) as
    revealed to the worker after each chosen sample. ``static``: indices of the inputs that keep one buffer
    across the calls of a sample (see :func:`make_schedule`)."""

    arms: list[str]
    rounds: list[dict[str, Any]]
    spots: list[tuple[int, int]]
    picks: list[tuple[int, int, int]] = field(default_factory=list)
    static: tuple[int, ...] = ()


def flush_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)
        return max(MIN_FLUSH_BYTES["cuda"], 2 * l2)
    return MIN_FLUSH_BYTES["cpu"]


def make_schedule(arms: list[str], pool: list[list[Any]], rounds: int, seed: int,
                  static: Any = ()) -> Schedule:
    """Random arm order per round, random input set per round, exact sign/power-of-two factors, roll offsets
    (all deterministic in ``seed``), and the spot-checked samples (from ``secrets``: not derivable from
    anything the candidate can see).

    ``static`` (``GateProblem.static_input_idxs``: parameters and buffers of forward/inference graphs) names
    the inputs the worker keeps in ONE buffer for all ``k`` calls of a sample, refreshed in place between
    samples with call 0's values; indices that are not tensor inputs are dropped. Every other input gets a
    buffer per call.

    Spot checks: :data:`SPOT_CHECKS` rounds of the candidate arm (always including the last round, so a
    candidate that drifts after many calls is seen) and :data:`SPOT_CHECKS_BASELINE` rounds of every other arm.
    """
    gen = torch.Generator().manual_seed(int(seed))
    factors = timing_factors(pool[0], rounds, gen)
    table = []
    for r in range(rounds):
        order = torch.randperm(len(arms), generator=gen).tolist()
        table.append({"set": int(torch.randint(0, len(pool), (1,), generator=gen)), "order": order,
                      "factors": factors[r], "seed": int(torch.randint(0, 2**31 - 1, (1,), generator=gen)),
                      "shift": int(torch.randint(0, 2**31 - 1, (1,), generator=gen))})
    secret = secrets.SystemRandom()
    cand = arms.index("cand")
    picks = {rounds - 1} | set(secret.sample(range(rounds), min(SPOT_CHECKS, rounds)))
    while len(picks) > min(SPOT_CHECKS, rounds):
        picks.discard(secret.choice(sorted(picks - {rounds - 1})))
    spots = [(r, cand) for r in sorted(picks)]
    for a in range(len(arms)):
        if a != cand:
            spots += [(r, a) for r in sorted(secret.sample(range(rounds), min(SPOT_CHECKS_BASELINE, rounds)))]
    return Schedule(arms, table, spots, static=static_indices(static, pool[0] if pool else []))


def set_values(values: list[Any], factors: list[float], shift: int, *, static: Any = (),
               static_shift: int | None = None) -> list[Any]:
    """The inputs one timed call read (host copy of :func:`tilesmith.gate.worker.timing.fill_set`):
    ``values`` × ``factors``, finite floating values rolled by ``shift``; inputs in ``static`` (shared by
    the calls of a sample, written with call 0's values) rolled by ``static_shift`` instead (default
    ``shift``). Call ``c`` of a sample with base shift ``s``: ``set_values(v, f, s + c, static=…,
    static_shift=s)``. Bit-identical to the worker's."""
    scaled = apply_factors(values, factors)
    keep = {int(i) for i in static}
    out = []
    for i, value in enumerate(scaled):
        by = int(static_shift) if i in keep and static_shift is not None else int(shift)
        if by and isinstance(value, torch.Tensor) and value.is_floating_point():
            value = clone_layout(value)
            roll_finite_(value, by)
        out.append(value)
    return out


def _merge_facts(into: dict[str, Any], answer: dict[str, Any]) -> bool:
    """Accumulate the global facts every worker answer carries; True when one of them is not empty."""
    found = False
    for key in ("threads_new", "identity_changes"):
        for item in answer.get(key) or []:
            found = True
            if item not in into.setdefault(key, []):
                into[key].append(item)
    for name, change in dict(answer.get("state_changes") or {}).items():
        found = True
        into.setdefault("state_changes", {}).setdefault(name, change)
    for key, value in answer.items():  # facts other helpers add (e.g. audit findings): first non-empty wins
        if key not in into and key not in _SAMPLE_KEYS and value:
            into[key] = value
    return found


_SAMPLE_KEYS = {"ok", "id", "ms", "wall_ms", "keys", "spot_path", "spot_refused", "calls_per_sample", "static_inputs",
                "estimates_ms", "k_limits", "set_bytes", "output_bytes", "method", "threads_new",
                "identity_changes", "state_changes"}


def run_samples(worker: Any, schedule: Schedule, pool_files: list[Path], *, target_ms: float, max_sample_ms: float,
                flush: int, expected: list[dict[str, Any]], start_timeout_s: float, sample_timeout_s: float,
                spot_path: Path, warmup_ms: float = 20.0, calls_per_sample: int | None = None) -> dict[str, Any]:
    """Drive one timing run in ``worker`` (``start``, one ``sample`` request per (round, arm), ``finish``).

    Returns one answer dict: ``ok``, ``calls_per_sample``, ``estimates_ms``, ``k_limits``, ``samples_ms``
    (per arm, ms per call), ``walls_ms``, ``method``, ``spot_path`` or ``spot_refused``, ``keys`` and the
    accumulated global facts; ``ok: False`` with ``error`` when a request failed (the run stops there, and
    also stops early once a global fact is reported). Fills ``schedule.picks``. ``calls_per_sample`` fixes
    ``k`` (tests; still capped by memory and distinct input sets).

    Raises:
        WorkerError: the worker crashed, timed out or broke the protocol (from ``worker.request``).
    """
    answer: dict[str, Any] = {}
    start = worker.request("time", start_timeout_s, "the timing warm-up", phase="start", arms=schedule.arms,
                           pool=[str(p) for p in pool_files], target_ms=target_ms, max_sample_ms=max_sample_ms,
                           flush_bytes=flush, expected=expected, warmup_ms=warmup_ms,
                           calls_per_sample=calls_per_sample, static=list(schedule.static))
    _merge_facts(answer, start)
    if not start.get("ok"):
        return {**answer, "ok": False, "error": start.get("error", {})}
    k = int(start["calls_per_sample"])
    answer.update(ok=True, calls_per_sample=k, estimates_ms=start.get("estimates_ms"),
                  k_limits=start.get("k_limits"), method=start.get("method", "host_clock"),
                  static_inputs=list(schedule.static))  # the host's list: spot checks rebuild with it
    # Round r's sets are rolled by base + r·k + j (j < k): no two timed calls of the run read the same
    # values as long as a floating input has ≥ rounds·k finite elements (and different rounds also differ
    # in input set and factors). set_values / spot_failures read the same shifts from the schedule.
    base = int(schedule.rounds[0].get("shift", 0)) % (1 << 20) if schedule.rounds else 0
    for r, rnd in enumerate(schedule.rounds):
        rnd["shift"] = base + r * k
    samples: list[list[float]] = [[] for _ in schedule.arms]
    walls: list[list[float]] = [[] for _ in schedule.arms]
    chosen = set(schedule.spots)
    secret = secrets.SystemRandom()
    pending: list[int] = []
    schedule.picks = []
    stop = False
    for r, rnd in enumerate(schedule.rounds):
        for a in rnd["order"]:
            got = worker.request("time", sample_timeout_s, "a timing sample", phase="sample", round=r, arm=int(a),
                                 set=rnd["set"], factors=rnd["factors"], seed=rnd["seed"], shift=rnd["shift"],
                                 copy=pending)
            stop = _merge_facts(answer, got)
            if not got.get("ok"):
                return {**answer, "ok": False, "error": got.get("error", {})}
            samples[int(a)].append(float(got["ms"]) / k)
            walls[int(a)].append(float(got["wall_ms"]))
            pending = []
            if (r, int(a)) in chosen:  # decided now that the sample has ended; revealed with the next request
                pending = [secret.randrange(k)]
                schedule.picks.append((r, int(a), pending[0]))
            if stop:
                break
        if stop:
            break
    done = worker.request("time", sample_timeout_s, "the timing spot-check copies", phase="finish", copy=pending,
                          spot_path=str(spot_path))
    _merge_facts(answer, done)
    if not done.get("ok"):
        return {**answer, "ok": False, "error": done.get("error", {})}
    answer.update(samples_ms=samples, walls_ms=walls, keys=done.get("keys", []), stopped_early=stop)
    for key in ("spot_path", "spot_refused"):
        if done.get(key):
            answer[key] = done[key]
    return answer


def spot_failures(answer: dict[str, Any], schedule: Schedule, pool: list[list[Any]], reference: Any,
                  expected: RefResult, tf32: bool, uses_rng: bool) -> list[CheckFailure]:
    """Compare the outputs of the spot-checked calls with the reference on the same inputs.

    Call ``c`` of a sample read the round's input set rolled by ``shift + c``, its static inputs (shared
    by the sample's calls) rolled by ``shift`` (:func:`set_values`, ``schedule.static``); each
    sample starts from its round's seed, so for a graph that draws random numbers the reference is run
    ``c + 1`` times from that seed.
    """
    if answer.get("spot_refused"):
        return [CheckFailure("timing_output_mismatch", f"outputs of a timed call were rejected before transfer: "
                                                       f"{answer['spot_refused']}")]
    picks = [list(p) for p in schedule.picks]
    if not picks:
        return []
    path = answer.get("spot_path")
    if not path:
        return [CheckFailure("protocol", "the worker returned no spot-check outputs for the timed calls")]
    try:
        data = load_checked(Path(path), expected.total_bytes() * max(1, len(picks)),
                            len(expected.outputs) * len(picks))
    except OutputTooLarge as exc:
        return [CheckFailure("output_too_large", f"spot-check outputs: {exc}")]
    except WorkerError as exc:
        return [CheckFailure("protocol", f"spot-check outputs: {exc}")]
    spots = data.get("spots") if isinstance(data, dict) else None
    keys = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(spots, list) or not isinstance(keys, list) or len(spots) != len(keys) or \
            any(not isinstance(k, list) or len(k) != 3 for k in keys) or \
            any(not isinstance(o, list) for o in spots):
        return [CheckFailure("protocol", "malformed spot-check file")]
    if sorted(keys) != sorted(picks):
        return [CheckFailure("protocol", f"spot-check file covers calls {keys}, the host asked for {picks}")]
    fails: list[CheckFailure] = []
    for (r, a, c), outs in zip(keys, spots):
        rnd = schedule.rounds[int(r)]
        shift = int(rnd.get("shift", 0))
        values = set_values(pool[rnd["set"]], rnd["factors"], shift + int(c), static=schedule.static,
                            static_shift=shift)
        repeat = int(c) + 1 if uses_rng else 1
        ref = reference.run(values, rnd["seed"], repeat=repeat)
        arm = schedule.arms[int(a)]
        where = f"timed call {int(c) + 1} of {answer.get('calls_per_sample', '?')} in round {r} of " \
                f"{len(schedule.rounds)}, arm {arm}"
        for i, (exp, got) in enumerate(zip(ref.outputs, outs)):
            if not isinstance(exp, torch.Tensor):
                continue
            if not isinstance(got, torch.Tensor) or got.shape != exp.shape or got.dtype != exp.dtype:
                fails.append(CheckFailure("timing_output_mismatch", f"output {i} of {where} has the wrong shape "
                                                                    f"or dtype", output_index=i))
                continue
            failure = compare_output(i, exp, got, variant="timing", tf32=tf32, poison_byte=None, others={},
                                     where=where)
            if failure is not None:
                fails.append(CheckFailure("timing_output_mismatch",
                                          failure.message + " The outputs of timed calls must be correct too "
                                                            "(every timed call reads its own input set, refreshed "
                                                            "in place between samples, with the parameters and "
                                                            "buffers shared by the calls of a sample; any call "
                                                            "may be checked).",
                                          output_index=i, variant="timing", worst_index=failure.worst_index,
                                          expected=failure.expected, got=failure.got))
        if fails:
            break
    return fails


def build_timing(answer: dict[str, Any], schedule: Schedule, baseline: str, seed: int) -> Timing:
    """The :class:`Timing` record from raw samples: pairs of (baseline, cand) from the same rounds."""
    samples = answer["samples_ms"]
    idx = {name: i for i, name in enumerate(schedule.arms)}
    base = [float(x) for x in samples[idx[baseline]]]
    cand = [float(x) for x in samples[idx["cand"]]]
    st = stats.paired_speedup(base, cand, seed=seed)
    original = None
    vs_original = None
    vs_original_ci = None
    if baseline != "orig" and "orig" in idx:
        original = tuple(float(x) for x in samples[idx["orig"]])
        st_orig = stats.paired_speedup(list(original), cand, seed=seed + 1)
        vs_original, vs_original_ci = st_orig.speedup, (st_orig.ci_low, st_orig.ci_high)
    return Timing(method=answer.get("method", "host_clock"), calls_per_sample=int(answer["calls_per_sample"]),
                  baseline_ms=tuple(base), candidate_ms=tuple(cand), speedup=st.speedup, ci_low=st.ci_low,
                  ci_high=st.ci_high, baseline_label="inductor" if baseline == "orig" else "incumbent",
                  original_ms=original, speedup_vs_original=vs_original, speedup_vs_original_ci=vs_original_ci)


def consistency_failure(answer: dict[str, Any], host_wall_ms: float,
                        host_cpu_ms: float | None = None) -> CheckFailure | None:
    """Reported sample time cannot exceed what the host measured itself (forged samples): the wall-clock
    duration of the requests (CUDA events), or, for CPU-time samples (``process_cpu_time``), the CPU time the
    worker process used meanwhile as the host read it from ``/proc`` (``host_cpu_ms``: one 10 ms tick of
    resolution at each end); without that reading, the wall time × the CPUs this process may use."""
    k = int(answer.get("calls_per_sample", 1))
    total = sum(sum(float(x) for x in arm) for arm in answer.get("samples_ms", [])) * k
    if answer.get("method") == "process_cpu_time":
        if host_cpu_ms is not None:
            bound, what = host_cpu_ms * 1.01 + 25.0, f"the worker's CPU time the host read meanwhile ({host_cpu_ms:.1f} ms)"
        else:
            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            bound, what = host_wall_ms * cpus * 1.01 + 5.0, f"{cpus} CPUs × the host-measured {host_wall_ms:.1f} ms"
    else:
        bound, what = host_wall_ms * 1.01 + 5.0, f"the host-measured {host_wall_ms:.1f} ms of the requests"
    if total > bound:
        return CheckFailure("timing_inconsistent", f"the worker reported {total:.1f} ms of samples, more than {what}")
    return None
