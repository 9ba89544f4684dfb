"""Host side of timing: build the randomized schedule, spot-check timed outputs, compute the statistic.

The worker only executes the schedule and returns raw samples (see
:mod:`tilesmith.gate.worker_timing`); every number in a :class:`~tilesmith.records.Timing` is computed
here, in the host, from those samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tilesmith.gate import stats
from tilesmith.gate.compare import compare_output
from tilesmith.gate.inputs import apply_factors, timing_factors
from tilesmith.errors import WorkerError
from tilesmith.gate.reference import OutputTooLarge, RefResult, load_checked
from tilesmith.records import CheckFailure, Timing

#: Target and ceiling of one sample's duration (ms). CUDA events resolve ~0.5 µs, so a ≥ 1 ms sample
#: keeps resolution error ≤ 0.05 %; the host clock on a busy CPU needs longer samples.
SAMPLE_TARGET_MS = {"cuda": 1.0, "cpu": 5.0}
SAMPLE_MAX_MS = {"cuda": 50.0, "cpu": 60.0}
#: Cache flush size: CUDA ≥ 2× L2 (H200: 2 × 60 MiB), CPU (test mode) 32 MiB.
MIN_FLUSH_BYTES = {"cuda": 64 * 1024 * 1024, "cpu": 32 * 1024 * 1024}
SPOT_CHECKS = 3


@dataclass
class Schedule:
    arms: list[str]
    rounds: list[dict[str, Any]]
    spots: list[tuple[int, int]]


def flush_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)
        return max(MIN_FLUSH_BYTES["cuda"], 2 * l2)
    return MIN_FLUSH_BYTES["cpu"]


def make_schedule(arms: list[str], pool: list[list[Any]], rounds: int, seed: int) -> Schedule:
    """Random arm order per round, random input set per round, exact sign/power-of-two factors, spot picks.

    Spot checks: :data:`SPOT_CHECKS` rounds of the candidate arm (always including the last round, so a
    candidate that drifts after many calls is seen) and one round of the baseline arm.
    """
    gen = torch.Generator().manual_seed(int(seed))
    factors = timing_factors(pool[0], rounds, gen)
    table = []
    for r in range(rounds):
        order = torch.randperm(len(arms), generator=gen).tolist()
        table.append({"set": int(torch.randint(0, len(pool), (1,), generator=gen)), "order": order,
                      "factors": factors[r], "seed": int(torch.randint(0, 2**31 - 1, (1,), generator=gen))})
    cand = arms.index("cand")
    picks = {rounds - 1}
    while len(picks) < min(SPOT_CHECKS, rounds):
        picks.add(int(torch.randint(0, rounds, (1,), generator=gen)))
    spots = [(r, cand) for r in sorted(picks)]
    spots.append((int(torch.randint(0, rounds, (1,), generator=gen)), 1 - cand if len(arms) > 1 else cand))
    return Schedule(arms, table, spots)


def spot_failures(answer: dict[str, Any], schedule: Schedule, pool: list[list[Any]], reference: Any,
                  expected: RefResult, tf32: bool, uses_rng: bool) -> list[CheckFailure]:
    """Compare the outputs of the spot-checked samples with the reference on the same refreshed inputs.

    Each sample starts from its round's seed; for a graph that draws random numbers the reference is run
    ``calls_per_sample`` times from that seed (the spot output is the sample's last call).
    """
    if answer.get("spot_refused"):
        return [CheckFailure("timing_output_mismatch", f"outputs of a timed call were rejected before transfer: "
                                                       f"{answer['spot_refused']}")]
    path = answer.get("spot_path")
    if not path:
        return [CheckFailure("protocol", "the worker returned no spot-check outputs for the timed calls")]
    try:
        data = load_checked(Path(path), expected.total_bytes() * max(1, len(schedule.spots)),
                            len(expected.outputs) * len(schedule.spots))
    except OutputTooLarge as exc:
        return [CheckFailure("output_too_large", f"spot-check outputs: {exc}")]
    except WorkerError as exc:
        return [CheckFailure("protocol", f"spot-check outputs: {exc}")]
    spots = data.get("spots") if isinstance(data, dict) else None
    keys = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(spots, list) or not isinstance(keys, list) or len(spots) != len(keys) or \
            any(not isinstance(k, list) or len(k) != 2 for k in keys) or \
            any(not isinstance(o, list) for o in spots):
        return [CheckFailure("protocol", "malformed spot-check file")]
    expected_keys = [list(s) for s in schedule.spots]
    if sorted(keys) != sorted(expected_keys):
        return [CheckFailure("protocol", f"spot-check file covers samples {keys}, the host asked for {expected_keys}")]
    fails: list[CheckFailure] = []
    for (r, a), outs in zip(keys, spots):
        rnd = schedule.rounds[int(r)]
        values = apply_factors(pool[rnd["set"]], rnd["factors"])
        repeat = int(answer.get("calls_per_sample", 1)) if uses_rng else 1
        ref = reference.run(values, rnd["seed"], repeat=repeat)
        arm = schedule.arms[int(a)]
        for i, (exp, got) in enumerate(zip(ref.outputs, outs)):
            if not isinstance(exp, torch.Tensor):
                continue
            if not isinstance(got, torch.Tensor) or got.shape != exp.shape or got.dtype != exp.dtype:
                fails.append(CheckFailure("timing_output_mismatch", f"output {i} of timed call (round {r}, arm {arm}) "
                                                                    f"has the wrong shape or dtype", output_index=i))
                continue
            failure = compare_output(i, exp, got, variant="timing", tf32=tf32, poison_byte=None, others={},
                                     where=f"timed call in round {r} of {len(schedule.rounds)}, arm {arm}")
            if failure is not None:
                fails.append(CheckFailure("timing_output_mismatch",
                                          failure.message + " The outputs of timed calls must be correct too "
                                                            "(inputs change in place between samples).",
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


def consistency_failure(answer: dict[str, Any], host_wall_ms: float) -> CheckFailure | None:
    """Reported sample time cannot exceed the host-measured duration of the request (forged samples)."""
    k = int(answer.get("calls_per_sample", 1))
    total = sum(sum(float(x) for x in arm) for arm in answer.get("samples_ms", [])) * k
    if total > host_wall_ms * 1.01 + 5.0:
        return CheckFailure("timing_inconsistent", f"the worker reported {total:.1f} ms of samples in a request the "
                                                   f"host measured at {host_wall_ms:.1f} ms")
    return None
