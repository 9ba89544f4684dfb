"""Paired timing samples inside the worker (the statistics are computed by the host, not here).

Protocol of one ``time`` request (the host chooses everything random: arm order per round, which input
set each round uses, the sign/power-of-two factors, which samples are spot-checked):

1. Load the input pool (≥ 2 sets) onto the device; build one live argument set whose tensors keep their
   addresses for the whole request.
2. Warm up every arm outside the samples (at least 3 calls and ``warmup_ms`` per arm), then estimate
   each arm's time per call and choose ``k`` calls per sample so that the fastest arm's sample lasts at
   least ``target_ms`` and the slowest at most ``max_sample_ms`` (never below 1).
3. For each round: refresh the live inputs **in place** from the round's set times its factors (so a
   cache keyed on pointers, shapes or a few input values returns stale results, which the spot checks
   then catch), then for each arm in the round's order: flush the cache (write a buffer larger than
   L2/LLC), synchronize, start the clock, run ``k`` calls, synchronize the whole device (work left on
   other streams is inside the sample), stop the clock.
   CUDA: events recorded on the current stream; CPU (test mode): ``time.perf_counter_ns``.
4. Spot checks: for the (round, arm) pairs the host chose, the last call's outputs are copied to the
   host after the sample (outside the timed region) and saved for comparison with the reference.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from tilesmith.gate.worker_runtime import InputSet, flat_view, sync, write_values

_FLOAT_KINDS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _scale(t: torch.Tensor, factor: float) -> None:
    if factor == 1.0 or not t.is_floating_point():
        return
    flat = torch.as_strided(t, (flat_view(t).numel() // t.element_size(),), (1,), t.storage_offset())
    if t.dtype in _FLOAT_KINDS:
        flat.mul_(factor)
    else:  # float8 and other formats without in-place arithmetic: round-trip through float32
        flat.copy_(flat.float().mul_(factor).to(t.dtype))


def run_timing(worker: Any, msg: dict[str, Any]) -> dict[str, Any]:
    from tilesmith.gate.worker_core import T, compact_cpu

    device = worker.device
    arms = [worker.modules[name] for name in msg["arms"]]
    pool_cpu = [worker.inputs(p) for p in msg["pool"]]
    pool = [InputSet(values, device, guarded=False).values for values in pool_cpu]
    live = InputSet(pool_cpu[0], device, guarded=False)
    flush = torch.empty(int(msg["flush_bytes"]), dtype=torch.uint8, device=device)
    is_cuda = device.type == "cuda"

    def refresh(set_index: int, factors: list[float]) -> None:
        for i, value in enumerate(pool[set_index]):
            if isinstance(value, torch.Tensor):
                write_values(live.values[i], value)
                _scale(live.values[i], float(factors[i]) if i < len(factors) else 1.0)

    def timed(fn: Any, k: int, keep: bool) -> tuple[float, float, Any]:
        flush.fill_(0)
        sync(device)
        wall0 = T.perf_ns()
        out = None
        if is_cuda:
            start, end = T.Event(enable_timing=True), T.Event(enable_timing=True)
            T.event_record(start)
            for _ in range(k):
                out = fn(live.args())
                if not keep:
                    out = None
            T.cuda_sync(device)
            T.event_record(end)
            T.event_sync(end)
            ms = T.elapsed(start, end)
        else:
            t0 = T.perf_ns()
            for _ in range(k):
                out = fn(live.args())
                if not keep:
                    out = None
            ms = (T.perf_ns() - t0) / 1e6
        wall = (T.perf_ns() - wall0) / 1e6
        return ms, wall, out

    with T.no_grad():
        estimates = []
        warm_ms = float(msg.get("warmup_ms", 20.0))
        for arm in arms:
            spent, calls = 0.0, 0
            while calls < 3 or spent < warm_ms:
                ms, _, _ = timed(arm.fn, 1, False)
                spent += ms
                calls += 1
                if calls >= 1000:
                    break
            singles = [timed(arm.fn, 1, False)[0] for _ in range(3)]
            estimates.append(max(statistics.median(singles), 1e-4))
        k = msg.get("calls_per_sample")
        if not k:
            target, longest = float(msg["target_ms"]), float(msg["max_sample_ms"])
            k = max(1, min(-(-target // min(estimates)), longest // max(estimates)))
        k = int(k)
        samples: list[list[float]] = [[] for _ in arms]
        walls: list[list[float]] = [[] for _ in arms]
        spots = {(int(r), int(a)) for r, a in msg.get("spots", [])}
        spot_out: list[list[Any]] = []
        spot_keys: list[list[int]] = []
        for r, rnd in enumerate(msg["schedule"]):
            refresh(int(rnd["set"]), rnd.get("factors", []))
            for a in rnd["order"]:
                keep = (r, int(a)) in spots
                T.manual_seed(int(rnd.get("seed", r)))
                ms, wall, out = timed(arms[int(a)].fn, k, keep)
                samples[int(a)].append(ms / k)
                walls[int(a)].append(wall)
                if keep:
                    spot_out.append([compact_cpu(o) if type(o) is torch.Tensor else None
                                     for o in (out if isinstance(out, (tuple, list)) else [])])
                    spot_keys.append([r, int(a)])
                del out
    answer: dict[str, Any] = {"ok": True, "calls_per_sample": k, "estimates_ms": estimates, "samples_ms": samples,
                              "walls_ms": walls, "method": "cuda_event" if is_cuda else "host_clock"}
    if spot_out:
        from tilesmith.gate.worker_core import _against_expected

        problems = [p for p in (_against_expected(o, worker.expected) for o in spot_out) if p]
        if problems:
            answer["spot_refused"] = problems[0]
        else:
            T.save({"spots": spot_out, "keys": spot_keys}, msg["spot_path"])
            answer["spot_path"] = msg["spot_path"]
    return answer
