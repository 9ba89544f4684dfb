"""Measured ceilings of a device (:class:`~tilesmith.roofline.cost.DeviceLimits`): device-to-device copy
bandwidth and ``torch.mm`` rates, measured once per process and device on the device itself.

The cost model (:mod:`tilesmith.roofline.cost`) turns them into a graph's floor; this module is the only part of
:mod:`tilesmith.roofline` that needs the device.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from typing import Any

from tilesmith.roofline.cost import DeviceLimits

__all__ = ["clear_limits_cache", "measure_device_limits"]

_LIMITS: dict[str, DeviceLimits] = {}
_LIMITS_LOCK = threading.Lock()


def clear_limits_cache() -> None:
    """Forget every measured :class:`DeviceLimits` (tests; a process that changed its TF32 setting)."""
    with _LIMITS_LOCK:
        _LIMITS.clear()


def measure_device_limits(device: Any = "cuda") -> DeviceLimits:
    """Measure (once per process and device) the copy bandwidth and matrix rates of ``device``.

    CUDA: a 256 MiB device-to-device ``copy_`` (512 MiB moved: read + write) and random-data
    ``torch.mm`` products, bf16 8192³ and fp32 4096³, each timed with CUDA events, 3 warm-ups then the
    median of 10 (copy: 20) calls. About 0.2 s and ~0.6 GB of transient device memory, returned to
    PyTorch's caching allocator afterwards (not to the driver). CPU (test mode only): the same with
    32 MiB / 256³ and the host clock.

    Raises:
        RuntimeError: CUDA requested but unavailable; ``torch.OutOfMemoryError`` when the buffers do not fit.
    """
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    key = str(dev)
    with _LIMITS_LOCK:
        cached = _LIMITS.get(key)
        if cached is not None:
            return cached
        limits = _measure(dev)
        _LIMITS[key] = limits
        return limits


def _measure(dev: Any) -> DeviceLimits:
    import torch

    start_wall = time.perf_counter()
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise RuntimeError(f"cannot measure {dev}: CUDA is not available")
    copy_elems = (256 if cuda else 32) * 2**20 // 4
    sizes = {"bf16": 8192, "f32": 4096} if cuda else {"bf16": 256, "f32": 256}
    with torch.no_grad(), (torch.cuda.device(dev) if cuda else contextlib.nullcontext()):
        src = torch.randn(copy_elems, device=dev)
        dst = torch.empty_like(src)
        copy_s = _median_seconds(lambda: dst.copy_(src), dev, warmup=3, reps=20 if cuda else 5)
        del src, dst
        rates = {}
        for abbr, n in sizes.items():
            dtype = torch.bfloat16 if abbr == "bf16" else torch.float32
            a = torch.randn(n, n, device=dev, dtype=dtype)
            b = torch.randn(n, n, device=dev, dtype=dtype)
            out = torch.empty(n, n, device=dev, dtype=dtype)
            seconds = _median_seconds(lambda a=a, b=b, out=out: torch.mm(a, b, out=out), dev, warmup=3,
                                      reps=10 if cuda else 3)
            rates[abbr] = 2 * n**3 / seconds / 1e12
            del a, b, out
    name = torch.cuda.get_device_name(dev) if cuda else "cpu"
    return DeviceLimits(
        device=str(dev), device_name=name, copy_gbps=2 * copy_elems * 4 / copy_s / 1e9,
        matmul_bf16_tflops=rates["bf16"], matmul_fp32_tflops=rates["f32"],
        method="cuda_event" if cuda else "host_clock", copy_bytes=copy_elems * 4,
        matmul_sizes=tuple(sizes.items()), allow_tf32=bool(torch.backends.cuda.matmul.allow_tf32),
        measured_s=time.perf_counter() - start_wall)


def _median_seconds(fn: Any, dev: Any, *, warmup: int, reps: int) -> float:
    import torch

    for _ in range(warmup):
        fn()
    if dev.type != "cuda":
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    torch.cuda.synchronize(dev)
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(dev)
    return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3
