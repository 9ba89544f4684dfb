"""Spot checks of timed calls, host side: the outputs a worker copied out of the calls the host picked after each
sample (:mod:`tilesmith.gate.host.timing` decides how many and which, from the operating system's randomness)
are compared with the trusted worker's reference on the same inputs. A candidate that computes correctly only
when it is checked outside the clock is caught here (docs/gate.md, "Spot checks")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tilesmith.errors import WorkerError
from tilesmith.gate.host.compare import compare_output
from tilesmith.gate.host.reference import OutputTooLarge, ReferenceRejected, RefResult, load_checked
from tilesmith.gate.host.timing import Schedule
from tilesmith.records import CheckFailure


def spot_failures(answer: dict[str, Any], schedule: Schedule, pool: list[Any], reference: Any,
                  expected: RefResult, tf32: bool, uses_rng: bool) -> list[CheckFailure]:
    """Compare the outputs of the spot-checked calls with the trusted worker's reference on the same inputs.

    Call ``c`` of a sample read the round's pool set × factors rolled by ``shift + c``, its static inputs
    (shared by the sample's calls) rolled by ``shift`` (:func:`tilesmith.gate.inputs.call_values`, rebuilt in
    the trusted worker from the pool recipe); each sample starts from its round's seed, so for a graph that
    draws random numbers the reference is run ``c + 1`` times from that seed.
    """
    fails: list[CheckFailure] = []
    picks_by_worker: dict[str, list[list[int]]] = {}
    for r, a, c in schedule.picks:
        picks_by_worker.setdefault(answer["arm_workers"][a], []).append([r, a, c])
    for pid, picks in picks_by_worker.items():
        spot = (answer.get("spots") or {}).get(pid) or {}
        if spot.get("spot_refused"):
            return [CheckFailure("timing_output_mismatch", f"outputs of a timed call were rejected before transfer: "
                                                           f"{spot['spot_refused']}")]
        path = spot.get("spot_path")
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
        runs = []
        for r, a, c in keys:
            rnd = schedule.rounds[int(r)]
            runs.append({"timing": {"pool": pool[rnd["set"]], "factors": rnd["factors"], "shift": int(rnd["shift"]),
                                    "call": int(c), "static": list(schedule.static)},
                         "seed": int(rnd["seed"]), "repeat": int(c) + 1 if uses_rng else 1})
        refs = reference.collect(reference.submit(runs), "reference runs for the spot-checked timed calls")
        for (r, a, c), outs, ref in zip(keys, spots, refs):
            where = f"timed call {int(c) + 1} of {answer.get('calls_per_sample', '?')} in round {r} of " \
                    f"{len(schedule.rounds)}, arm {schedule.arms[int(a)]}"
            if isinstance(ref, ReferenceRejected):
                fails.append(CheckFailure("exception", f"the original wrapper raised on the inputs of {where}: {ref}"))
                continue
            fails += _compare_spot(ref, outs, where, tf32)
            if fails:
                return fails
    return fails


def _compare_spot(ref: RefResult, outs: list[Any], where: str, tf32: bool) -> list[CheckFailure]:
    fails = []
    for i, (exp, got) in enumerate(zip(ref.outputs, outs)):
        if not isinstance(exp, torch.Tensor):
            continue
        if not isinstance(got, torch.Tensor) or got.shape != exp.shape or got.dtype != exp.dtype:
            fails.append(CheckFailure("timing_output_mismatch", f"output {i} of {where} has the wrong shape or dtype",
                                      output_index=i))
            continue
        failure = compare_output(i, exp, got, variant="timing", tf32=tf32, poison_byte=None, others={}, where=where)
        if failure is not None:
            fails.append(CheckFailure("timing_output_mismatch",
                                      failure.message + " The outputs of timed calls must be correct too (every "
                                                        "timed call reads its own input set, refreshed in place "
                                                        "between samples, with the parameters and buffers shared by "
                                                        "the calls of a sample; any call may be checked).",
                                      output_index=i, variant="timing", worst_index=failure.worst_index,
                                      expected=failure.expected, got=failure.got))
    return fails
