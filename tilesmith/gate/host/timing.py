"""Host side of timing: the randomized schedule, the alternation between worker processes, quiescence, the
sequential stop, which timed calls are spot-checked (compared in :mod:`tilesmith.gate.host.spots`), the statistic.

Arms live in different processes: ``orig`` in the trusted worker (the original only, ever), ``cand`` in the
candidate's worker, ``inc`` (an accepted incumbent, itself candidate code) in its own worker. Samples of one
round are taken one after the other in a random arm order on the same device, paired as before. Before every
sample every *other* untrusted worker of the gate is stopped (SIGSTOP of its process group; it answered its
last request after synchronising its device, so none of its work is left on the device) and continued after
(SIGCONT, when it is next asked): a candidate's process cannot run anything — a thread, a stream, a compiler —
while the original is timed. The trusted worker is never stopped: it runs only the original and, while others
are timed, waits on its request pipe.

The worker only executes samples and returns raw times (:mod:`tilesmith.gate.worker.timing`); every number in
a :class:`~tilesmith.records.Timing` is computed here, in the host, from those samples. Which timed calls are
spot-checked is decided here from the operating system's randomness (``secrets``), never sent ahead: after
each sample the host names the calls of *that* sample whose outputs the worker copies out (usually none), in
that worker's next request. The run stops at the first look of the sequential test that decides
(:func:`tilesmith.gate.host.stats.decide`).
"""

from __future__ import annotations

import os
import secrets
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tilesmith.errors import WorkerError
from tilesmith.gate.host import stats
from tilesmith.gate.host.process import cpu_clock_ms, process_cpu_ms
from tilesmith.gate.inputs import static_indices, timing_factors
from tilesmith.records import CheckFailure, Timing

#: Target and ceiling of one sample's duration (ms). CUDA events resolve ~0.5 µs, so a ≥ 1 ms sample
#: keeps resolution error ≤ 0.05 %; CPU samples (the worker's CPU time, test mode) are longer so that cache
#: and frequency effects of other processes average out.
SAMPLE_TARGET_MS = {"cuda": 1.0, "cpu": 5.0}
SAMPLE_MAX_MS = {"cuda": 50.0, "cpu": 60.0}
#: Cache flush size: CUDA ≥ 2× L2 (H200: 2 × 60 MiB), CPU (test mode) 32 MiB.
MIN_FLUSH_BYTES = {"cuda": 64 * 1024 * 1024, "cpu": 32 * 1024 * 1024}
#: Spot checks per phase of full length: candidate samples (spread over the blocks of the sequential test,
#: and always the last sample taken) and samples of each untrusted baseline arm (an incumbent; the trusted
#: original is not spot-checked); in each chosen sample one call, uniform over the sample's ``k`` calls,
#: chosen after it ended. A candidate that returns wrong results on a fraction ``f`` of its timed calls (the
#: only cheat left once it cannot tell checked calls from others) escapes a 30-round phase with probability
#: ``(1 - f)^12``: 0.28 for f = 10 %, 0.03 for f = 25 %; the confirmation phase squares that. A phase the
#: sequential test stops after 10 rounds checks 5 samples (4 + the last). Each check costs one reference call
#: in the trusted worker and one output copy.
SPOT_CHECKS = 12
SPOT_CHECKS_BASELINE = 2
#: Bytes of spot-check outputs one worker writes for one timing run: past it, fewer candidate rounds are checked
#: (:func:`spot_count`; at least one per look block), so that a graph with a 1 GiB output writes and the host
#: reads a few GiB per phase, not 13.
SPOT_BYTES = 2 << 30


def spot_count(output_bytes: int, rounds: int) -> int:
    """Candidate rounds to spot-check in a run of ``rounds``: :data:`SPOT_CHECKS`, fewer where that many copies
    of ``output_bytes`` (one call's outputs) would pass :data:`SPOT_BYTES` (the host adds the last sample),
    never fewer than one per look block of the sequential rule."""
    blocks = len(stats.looks(rounds)) if rounds > 0 else 1
    if output_bytes <= 0:
        return SPOT_CHECKS
    return max(blocks, min(SPOT_CHECKS, SPOT_BYTES // output_bytes - 1))


def spot_file_limit(output_bytes: int) -> int:
    """An upper bound on the spot-check file of one worker in one run, in bytes: every candidate round checked,
    the last sample, and the baseline checks of an arm it might hold, plus 64 MiB of serialization overhead.
    The gate's ``RLIMIT_FSIZE`` for candidate workers stays above it (seen on the H200: a limit of 8× the
    outputs cut the spot file of an 8192×8192 bf16 output at its eighth copy, ``unexpected pos`` in torch.save)."""
    return (SPOT_CHECKS + 1 + SPOT_CHECKS_BASELINE) * max(0, int(output_bytes)) + (64 << 20)


#: Bytes that ``k`` live input sets plus ``k`` output sets may take in each timing worker: this fraction of the
#: smallest free device memory the workers reported after warm-up, shared among them (the rest stays for the
#: wrappers' intermediates); on the CPU (test mode) a fixed amount.
TIMING_MEMORY_FRACTION = 0.5
TIMING_MEMORY_CPU_BYTES = 1 << 30


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
                  static: Any = (), trusted: Any = ("orig",), output_bytes: int = 0) -> Schedule:
    """Random arm order per round, random input set per round, exact sign/power-of-two factors, roll offsets
    (all deterministic in ``seed``), and the spot-checked samples (from ``secrets``: not derivable from
    anything the candidate can see). ``pool``: one value list per pool set (only the first's kinds of inputs —
    floating tensor, other tensor, scalar — and the number of sets are used; the host passes the base inputs).

    ``static`` (``GateProblem.static_input_idxs``: parameters and buffers of forward/inference graphs) names
    the inputs the worker keeps in ONE buffer for all ``k`` calls of a sample, refreshed in place between
    samples with call 0's values; indices that are not tensor inputs are dropped. Every other input gets a
    buffer per call.

    Spot checks: in every block of :data:`tilesmith.gate.host.stats.LOOK_EVERY` rounds, its share of
    :func:`spot_count` candidate rounds (:data:`SPOT_CHECKS`, fewer for outputs of ``output_bytes`` bytes per
    call past :data:`SPOT_BYTES`; the host adds the last sample taken when the run stops), and
    :data:`SPOT_CHECKS_BASELINE` rounds of every arm not in ``trusted``.
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
    picks: set[int] = set()
    start = 0
    for end in stats.looks(rounds):
        block = range(start, end)
        share = max(1, round(spot_count(output_bytes, rounds) * len(block) / rounds))
        picks |= set(secret.sample(block, min(share, len(block))))
        start = end
    spots = [(r, cand) for r in sorted(picks)]
    for a, name in enumerate(arms):
        if a != cand and name not in trusted:
            spots += [(r, a) for r in sorted(secret.sample(range(rounds), min(SPOT_CHECKS_BASELINE, rounds)))]
    return Schedule(arms, table, spots, static=static_indices(static, pool[0] if pool else []))


def choose_k(estimates_ms: list[float], target_ms: float, max_sample_ms: float, set_bytes: int, out_bytes: int,
             budget_bytes: int, distinct: int) -> tuple[int, dict[str, int]]:
    """Calls per sample: long enough for ``target_ms`` on the fastest arm, at most ``max_sample_ms`` on the
    slowest, then capped by memory (``k`` input sets + ``k`` output sets ≤ ``budget_bytes``) and by
    ``distinct`` (no input set is read twice in one sample). Never below 1. Returns ``(k, limits)``."""
    timed = int(max(1, min(-(-target_ms // min(estimates_ms)), max_sample_ms // max(estimates_ms))))
    by_memory = int(max(1, budget_bytes // max(1, set_bytes + out_bytes)))
    k = max(1, min(timed, by_memory, int(distinct)))
    return k, {"by_time": timed, "by_memory": by_memory, "by_distinct": int(distinct)}


class Quiescence:
    """Stops every untrusted worker of the gate except the one about to be timed (see the module text).

    A CUDA spare that was never sent wrapper code (``loaded`` false: it runs only Tilesmith's worker code — its
    interpreter start, torch's import, its ``init``: a device context, a trivial Triton kernel, its inputs copied
    to the device) is not stopped but kept off ``timing_cpus`` (the CPU the timed workers run on) until
    :meth:`release`, where the machine has another. Its ``init`` may overlap samples: the gate sends it early
    only where the inputs are small (``Gate._early_init_fits``), and paired samples of the two arms alternate
    within milliseconds while an ``init`` lasts a second or two, so what it costs the device falls on both arms."""

    def __init__(self, untrusted: list[Any], timing_cpus: set[int] | None = None) -> None:
        self.untrusted = [w for w in untrusted if w is not None]
        self.failed_stops: list[str] = []
        self.others: set[int] | None = None
        if timing_cpus and hasattr(os, "sched_getaffinity"):
            try:
                self.others = set(os.sched_getaffinity(0)) - set(timing_cpus) or None
            except OSError:
                self.others = None
        self.moved: list[Any] = []

    def _starting(self, worker: Any) -> bool:
        return getattr(worker, "device_type", "cpu") == "cuda" and getattr(worker, "loaded", True) is False

    def only(self, active: Any) -> None:
        for worker in self.untrusted:
            if worker is active or not worker.alive():
                continue
            if self._starting(worker) and self.others is not None:
                if worker not in self.moved:
                    worker.pin(self.others)
                    self.moved.append(worker)
                continue
            if not worker.stopped and not worker.stop():
                self.failed_stops.append(worker.label)
        if active is not None:
            active.resume()

    def release(self) -> None:
        for worker in self.untrusted:
            worker.resume()
        for worker in self.moved:
            worker.pin(None)
        self.moved = []


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
    for record in answer.get("audit") or []:
        found = True
        into.setdefault("audit", []).append(record)
    return found


@dataclass
class TimingRun:
    """What :func:`run_timing` needs besides the schedule: which worker holds each arm, every untrusted worker
    of the gate (stopped while another arm is timed), the pool recipes, sizes and deadlines."""

    holders: dict[str, Any]
    untrusted: list[Any]
    pool: list[Any]
    target_ms: float
    max_sample_ms: float
    flush: int
    expected: list[dict[str, Any]]
    start_timeout_s: float
    sample_timeout_s: float
    spot_dir: Path
    baseline: str = "orig"
    min_improvement: float = 0.02
    decision_seed: int = 0
    warmup_ms: float = 20.0
    calls_per_sample: int | None = None
    budget_bytes: int | None = None
    sequential: bool = True
    allowance: float = 0.0
    control: str | None = None
    """Arm holding the baseline's code in the candidate's own worker: the sequential looks then decide with
    :func:`tilesmith.gate.host.stats.decide_controlled` (candidate vs control, guarded by the baseline)."""


def run_timing(run: TimingRun, schedule: Schedule) -> dict[str, Any]:
    """Drive one timing run (``prepare``/``sets`` in every holder, one ``sample`` per (round, arm) in a random
    arm order with the others quiescent, ``finish``), stopping at the first deciding look.

    Returns one answer dict: ``ok``, ``calls_per_sample``, ``estimates_ms``, ``k_limits``, ``samples_ms`` (per
    arm, ms per call), ``walls_ms``, ``method``, ``spots`` (per worker label: file path or refusal), ``keys``,
    ``decision`` (``pass``/``slower``/``marginal``/``None`` without sequential stops) and ``rounds_run``, the
    per-worker host measurements (``host_ms``) and the accumulated global facts of the untrusted workers;
    ``ok: False`` with ``error`` when a request failed (the run stops there, and also once an untrusted
    worker reports a global fact). Fills ``schedule.picks``.

    Raises:
        WorkerError: a worker crashed, timed out or broke the protocol (from ``worker.request``).
    """
    arms = schedule.arms
    workers: list[Any] = []
    for name in arms:
        if run.holders[name] not in workers:
            workers.append(run.holders[name])
    trusted = {id(w) for w in workers if getattr(w, "role", "candidate") == "trusted"}
    cpu = timing_cpu()
    quiet = Quiescence(run.untrusted, cpu)
    answer: dict[str, Any] = {"ok": True, "static_inputs": list(schedule.static)}
    for w in workers:
        getattr(w, "pin", lambda cpus: None)(cpu)
    try:
        answer["timing_cpu"] = sorted(cpu) if cpu else None
        return _run(run, schedule, arms, workers, trusted, quiet, answer)
    finally:
        quiet.release()
        for w in workers:
            getattr(w, "pin", lambda cpus: None)(None)


def timing_cpu() -> set[int] | None:
    """The one CPU every arm's worker runs on during a timing run: the highest this process may use.

    Why: with arms in different processes the scheduler keeps each process on the CPU it last ran on, so on a
    shared machine (hyperthread siblings, other tenants of a VM) one arm's samples could systematically run on
    a busier core than the other's — measured on the 2-core CI VM: identical code timed 0.82–1.36× between two
    processes, moving with the placement. On one CPU both arms meet the same interference (the other workers are
    stopped meanwhile, so they do not compete for it). ``None`` where affinity cannot be set."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    try:
        allowed = os.sched_getaffinity(0)
    except OSError:
        return None
    return {max(allowed)} if allowed else None


def _run(run: TimingRun, schedule: Schedule, arms: list[str], workers: list[Any], trusted: set[int],
         quiet: Quiescence, answer: dict[str, Any]) -> dict[str, Any]:
    prepared: dict[int, dict[str, Any]] = {}
    cpu0 = {id(w): process_cpu_ms(w.pid) for w in workers}
    for w in workers:
        quiet.only(w)
        held = {str(a): name for a, name in enumerate(arms) if run.holders[name] is w}
        got = w.request("time", run.start_timeout_s, "the timing warm-up", phase="prepare", arms=held,
                        pool=run.pool, flush_bytes=run.flush, expected=run.expected, warmup_ms=run.warmup_ms,
                        static=list(schedule.static))
        if id(w) not in trusted:
            _merge_facts(answer, got)
        if not got.get("ok"):
            return {**answer, "ok": False, "error": got.get("error", {})}
        prepared[id(w)] = got
    estimates = [0.0] * len(arms)
    for got in prepared.values():
        for a, ms in dict(got["estimates_ms"]).items():
            estimates[int(a)] = float(ms)
    frees = [int((got.get("memory") or {}).get("free", 0)) for got in prepared.values()]
    if run.budget_bytes is not None:
        budget = run.budget_bytes
    elif _device_kind(prepared) == "cuda" and min(frees, default=0) > 0:
        budget = int(TIMING_MEMORY_FRACTION * min(frees) / len(workers))
    else:
        budget = TIMING_MEMORY_CPU_BYTES
    set_bytes = max(int(g["set_bytes"]) for g in prepared.values())
    out_bytes = max(int(g["output_bytes"]) for g in prepared.values())
    distinct = min(int(g["distinct"]) for g in prepared.values())
    k, limits = choose_k(estimates, run.target_ms, run.max_sample_ms, set_bytes, out_bytes, budget, distinct)
    if run.calls_per_sample:
        k = max(1, min(int(run.calls_per_sample), limits["by_memory"], limits["by_distinct"]))
    for w in workers:
        quiet.only(w)
        got = w.request("time", run.start_timeout_s, "building the timing input sets", phase="sets", k=k)
        if id(w) not in trusted:
            _merge_facts(answer, got)
        if not got.get("ok"):
            return {**answer, "ok": False, "error": got.get("error", {}), "calls_per_sample": k}
    method = next(iter(prepared.values())).get("method", "process_cpu_time")
    answer.update(calls_per_sample=k, estimates_ms=estimates, k_limits={**limits, "budget_bytes": budget},
                  method=method, set_bytes=set_bytes, output_bytes=out_bytes)
    # Round r's sets are rolled by base + r·k + j (j < k): no two timed calls of the run read the same
    # values as long as a floating input has ≥ rounds·k finite elements (and different rounds also differ
    # in input set and factors). The trusted worker rebuilds a picked call's inputs from the same shifts.
    base = int(schedule.rounds[0].get("shift", 0)) % (1 << 20) if schedule.rounds else 0
    for r, rnd in enumerate(schedule.rounds):
        rnd["shift"] = base + r * k
    samples: list[list[float]] = [[] for _ in arms]
    walls: list[list[float]] = [[] for _ in arms]
    # CPU time: what the kernel's clock of the worker process counted over each sample request (all of it: the
    # input fill, the flush, the calls, the seal, the answer), beside what the worker reported for its calls. Only
    # recorded (the phase's ``timing_raw.kernel_cpu``): red team 20's clock rewrite shows as a larger gap than the
    # trusted worker's, but the fill and the flush in the same request vary by more than that (docs/gate.md).
    by_kernel = method == "process_cpu_time"
    kernel: list[list[tuple[float, float]]] = [[] for _ in arms]
    host_ms = {id(w): 0.0 for w in workers}
    chosen = set(schedule.spots)
    secret = secrets.SystemRandom()
    pending: dict[int, list[int]] = {id(w): [] for w in workers}
    schedule.picks = []
    looks = set(stats.looks(len(schedule.rounds))) if run.sequential else set()
    base_idx, cand_idx = arms.index(run.baseline), arms.index("cand")
    cand_worker = run.holders["cand"]
    decision: str | None = None
    facts = {"stop": False}
    rounds_run = 0
    kept: tuple[int, int] | None = None  # a candidate sample whose outputs wait for the look's decision

    def pick(r: int, a: int) -> list[int]:
        call = secret.randrange(k)
        schedule.picks.append((r, a, call))
        return [call]

    def release(w: Any, copy: list[int]) -> dict[str, Any] | None:
        quiet.only(w)
        got = w.request("time", run.sample_timeout_s, "releasing a sample's outputs", phase="release", copy=copy)
        if id(w) not in trusted:
            facts["stop"] = _merge_facts(answer, got) or facts["stop"]
        return None if got.get("ok") else {**answer, "ok": False, "error": got.get("error", {})}

    for r, rnd in enumerate(schedule.rounds):
        deciding = (r + 1) in looks or r == len(schedule.rounds) - 1
        for a in rnd["order"]:
            w = run.holders[arms[int(a)]]
            if kept is not None and w is cand_worker:  # the worker samples again: check the kept sample now
                failed = release(w, pick(*kept))
                kept = None
                if failed:
                    return failed
            quiet.only(w)
            c0 = cpu_clock_ms(w.pid) if by_kernel else None
            t0 = time.monotonic()
            got = w.request("time", run.sample_timeout_s, "a timing sample", phase="sample", round=r, arm=int(a),
                            set=rnd["set"], factors=rnd["factors"], seed=rnd["seed"], shift=rnd["shift"])
            host_ms[id(w)] += (time.monotonic() - t0) * 1e3
            c1 = cpu_clock_ms(w.pid) if c0 is not None else None
            if id(w) not in trusted:
                facts["stop"] = _merge_facts(answer, got) or facts["stop"]
            if not got.get("ok"):
                return {**answer, "ok": False, "error": got.get("error", {})}
            samples[int(a)].append(float(got["ms"]) / k)
            if c0 is not None and c1 is not None:
                kernel[int(a)].append((c1 - c0, float(got["ms"])))
            walls[int(a)].append(float(got["wall_ms"]))
            # Picks are decided now that the sample has ended and revealed with its release, which follows
            # every sample: each arm's process does the same steps between its samples, picked or not. The
            # candidate's sample of a deciding round is kept until the look: if the run stops there, it is
            # the always-checked last sample (a candidate that drifts after many calls is seen).
            if (r, int(a)) in chosen:
                failed = release(w, pick(r, int(a)))
            elif deciding and int(a) == cand_idx and not facts["stop"]:
                kept, failed = (r, int(a)), None
            else:
                failed = release(w, [])
            if failed:
                return failed
            if facts["stop"]:
                break
        rounds_run = r + 1
        if facts["stop"]:
            break
        if rounds_run in looks:
            if run.control is not None:
                decision, _ = stats.decide_controlled(samples[base_idx], samples[arms.index(run.control)],
                                                      samples[cand_idx], len(schedule.rounds), run.min_improvement,
                                                      seed=run.decision_seed, allowance=run.allowance)
            else:
                decision, _ = stats.decide(samples[base_idx], samples[cand_idx], len(schedule.rounds),
                                           run.min_improvement, seed=run.decision_seed, allowance=run.allowance)
            if decision != "continue":
                break
            decision = None
        if kept is not None and rounds_run < len(schedule.rounds):
            failed = release(cand_worker, [])
            kept = None
            if failed:
                return failed
    if kept is not None:  # the run stopped at this look (or ran out of rounds): check the kept sample
        pending[id(cand_worker)] = pick(*kept)
    spots: dict[str, Any] = {}
    for w in workers:
        quiet.only(w)
        path = Path(getattr(w, "dir", None) or run.spot_dir) / f"spots_{w.pid}.pt"  # a worker writes only its own
        done = w.request("time", run.sample_timeout_s, "the timing spot-check copies", phase="finish",
                         copy=pending[id(w)], spot_path=str(path))
        if id(w) not in trusted:
            _merge_facts(answer, done)
        if not done.get("ok"):
            return {**answer, "ok": False, "error": done.get("error", {})}
        spots[str(w.pid)] = {k2: done.get(k2) for k2 in ("spot_path", "spot_refused", "keys")}
    cpu = {}
    for w in workers:
        before, after = cpu0[id(w)], process_cpu_ms(w.pid)
        cpu[str(w.pid)] = after - before if before is not None and after is not None else None
    answer.update(samples_ms=samples, walls_ms=walls,
                  spots=spots, decision=decision, rounds_run=rounds_run, stopped_early=facts["stop"],
                  host_ms={str(w.pid): host_ms[id(w)] for w in workers}, host_cpu_ms=cpu,
                  arm_workers=[str(run.holders[name].pid) for name in arms], failed_stops=quiet.failed_stops)
    if by_kernel and all(kernel):
        answer["kernel_cpu"] = {name: {"sample_ms": statistics.median(kc for kc, _ in kernel[a]),
                                       "gap_ms": statistics.median(kc - rep for kc, rep in kernel[a]),
                                       "trusted": id(run.holders[name]) in trusted}
                                for a, name in enumerate(arms)}
    return answer


def _device_kind(prepared: dict[int, dict[str, Any]]) -> str:
    methods = {g.get("method") for g in prepared.values()}
    return "cuda" if "cuda_event" in methods else "cpu"


def build_timing(answer: dict[str, Any], schedule: Schedule, baseline: str, seed: int,
                 control: str | None = None) -> Timing:
    """The :class:`Timing` record from raw samples: pairs of (baseline, cand) from the same rounds; the interval
    is the sequential test's corrected one (:func:`tilesmith.gate.host.stats.look_alpha`). With ``control`` (the
    in-process control arm) also the candidate's ratio over it, which the rule decides on."""
    samples = answer["samples_ms"]
    idx = {name: i for i, name in enumerate(schedule.arms)}
    alpha = stats.look_alpha(len(schedule.rounds))
    base = [float(x) for x in samples[idx[baseline]]]
    cand = [float(x) for x in samples[idx["cand"]]]
    n = min(len(base), len(cand))
    base, cand = base[:n], cand[:n]
    st = stats.paired_speedup(base, cand, seed=seed, alpha=alpha)
    original = None
    vs_original = None
    vs_original_ci = None
    if baseline != "orig" and "orig" in idx:
        original = tuple(float(x) for x in samples[idx["orig"]][:n])
        st_orig = stats.paired_speedup(list(original), cand, seed=seed + 1, alpha=alpha)
        vs_original, vs_original_ci = st_orig.speedup, (st_orig.ci_low, st_orig.ci_high)
    control_ms = vs_control = vs_control_ci = None
    if control is not None and control in idx:
        control_ms = tuple(float(x) for x in samples[idx[control]][:n])
        st_ctl = stats.paired_speedup(list(control_ms), cand, seed=seed + 2, alpha=alpha)
        vs_control, vs_control_ci = st_ctl.speedup, (st_ctl.ci_low, st_ctl.ci_high)
    return Timing(method=answer.get("method", "process_cpu_time"), calls_per_sample=int(answer["calls_per_sample"]),
                  baseline_ms=tuple(base), candidate_ms=tuple(cand), speedup=st.speedup, ci_low=st.ci_low,
                  ci_high=st.ci_high, baseline_label="inductor" if baseline == "orig" else "incumbent",
                  original_ms=original, speedup_vs_original=vs_original, speedup_vs_original_ci=vs_original_ci,
                  control_ms=control_ms, speedup_vs_control=vs_control, speedup_vs_control_ci=vs_control_ci)


def consistency_failure(answer: dict[str, Any], host_wall_ms: float | None = None,
                        host_cpu_ms: float | None = None) -> CheckFailure | None:
    """Reported sample time cannot exceed what the host measured itself (forged samples), per worker: the
    wall-clock duration of its sample requests (CUDA events), or, for CPU-time samples (``process_cpu_time``),
    the CPU time the worker process used over the run as the host read it from ``/proc`` (one 10 ms tick of
    resolution at each end). ``host_wall_ms``/``host_cpu_ms`` override the per-worker figures (one worker)."""
    k = int(answer.get("calls_per_sample", 1))
    per_worker: dict[str, float] = {}
    arm_workers = answer.get("arm_workers") or ["0"] * len(answer.get("samples_ms", []))
    for arm, pid in zip(answer.get("samples_ms", []), arm_workers):
        per_worker[pid] = per_worker.get(pid, 0.0) + sum(float(x) for x in arm) * k
    for pid, total in per_worker.items():
        wall = host_wall_ms if host_wall_ms is not None else (answer.get("host_ms") or {}).get(pid)
        cpu = host_cpu_ms if host_cpu_ms is not None else (answer.get("host_cpu_ms") or {}).get(pid)
        if answer.get("method") == "process_cpu_time":
            if cpu is None:
                continue
            bound, what = cpu * 1.01 + 25.0, f"the CPU time the host read for that worker ({cpu:.1f} ms)"
        else:
            if wall is None:
                continue
            bound, what = wall * 1.01 + 5.0, f"the host-measured {wall:.1f} ms of its sample requests"
        if total > bound:
            return CheckFailure("timing_inconsistent", f"worker {pid} reported {total:.1f} ms of samples, more than "
                                                       f"{what}")
    return None


def predicted_s(rounds: int, arms: int, per_sample_ms: float, ref_call_ms: float) -> float:
    """A generous duration (s) for a timing run's requests, for deadlines: every sample at its ceiling plus 2 ms."""
    return (rounds * arms * (per_sample_ms + 2.0) + 40 * ref_call_ms * arms) / 1e3


__all__ = ["Schedule", "TimingRun", "build_timing", "choose_k", "consistency_failure", "flush_bytes",
           "make_schedule", "predicted_s", "run_timing", "spot_failures"]
