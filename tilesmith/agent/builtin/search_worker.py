"""Search worker: measures the original wrapper, its kernels' launch configurations, and configuration variants.

Run as ``python -m tilesmith.agent.builtin.search_worker REQUEST.json RESULT.json`` by
:func:`tilesmith.agent.builtin.profile.run_search` (a separate process, so that a kernel that fails to
compile, a compile that hangs or a crash of the CUDA context costs only the search). The request holds the
wrapper source, ``device``, ``max_configs``, and for the configuration generator ``variants``,
``fx_module_path``, ``fx_kwargs`` and ``deadline_s`` (seconds from the worker's start after which no new variant
is compiled); the result JSON, rewritten atomically whenever a part is complete (so a worker killed at its
limit leaves what it finished), holds:

- ``eager_ms``: per-call time of ``call(args)``, each call followed by a device synchronize (best of 3
  batches; the batch grows until it lasts ≥ 50 ms), i.e. the latency of an isolated call, host launch work
  included, as the gate times calls (:func:`tilesmith.gate.worker.timing._timed`);
- ``graph_ms``: the same for replays of one CUDA graph captured from ``call`` (GPU time without the host
  launch work), or ``capture_error`` when the capture raised;
- ``kernels``: per tunable kernel, every planned configuration with its time in ms from Inductor's own
  ``CachingAutotuner.benchmark_all_configs`` (``benchmarker.benchmark_gpu``: L2 flushed, in-place arguments
  cloned, minimum of the runs) and whether it is one of Inductor's defaults; ``kernel_skips`` why other
  kernels were not searched (CUDA only); ``errors``;
- ``variants``: one record per configuration variant (:mod:`tilesmith.agent.builtin.config_screen`).

On the CPU (test mode) ``eager_ms`` is the host time per call, ``graph_ms`` is absent and no launch
configuration is searched.

Inputs come from the wrapper's own ``get_args()`` (``rand_strided``: normal floats, zero integers), drawn
afresh for each phase because bodies may write into inputs they consume.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m tilesmith.agent.builtin.search_worker REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    request = json.loads(Path(argv[1]).read_text(encoding="utf-8"))
    started = time.monotonic()
    out = Path(argv[2])
    result: dict[str, Any] = {"kernels": {}, "kernel_skips": {}, "errors": [], "variants": []}

    def emit() -> None:
        result["wall_s"] = time.monotonic() - started
        write_json(out, result)

    try:
        run(request, result, emit, started)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which skips the generator
        result["errors"] += [f"{type(exc).__name__}: {exc}", traceback.format_exc(limit=8)]
    emit()
    return 0


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Replace ``path`` with ``data`` atomically (the parent may read it after killing this process)."""
    from tilesmith._atomic import write_json_atomic

    write_json_atomic(path, data, indent=None, sort_keys=False)


def run(request: dict[str, Any], result: dict[str, Any], emit: Any, started: float) -> None:
    """Fill ``result`` (module docstring), calling ``emit()`` whenever a part is complete."""
    import torch

    from tilesmith.agent.builtin import launch_config as lc

    source = request["source"]
    device = str(request.get("device", "cuda"))
    deadline = started + float(request.get("deadline_s", 1e9))
    pool = None
    if request.get("variants") and request.get("fx_module_path"):
        from tilesmith.agent.builtin.config_screen import CompilePool, compile_workers

        workers = int(request.get("compile_workers") or compile_workers(len(request["variants"])))
        if workers > 1:  # compiles overlap the original's load and measurement below
            pool = CompilePool(request, Path(request["fx_module_path"]).parent, deadline, workers)
    original = _load(source)
    if device.startswith("cuda"):
        eager, graph, capture_error = measure_call(original.call, original.get_args)
    else:
        eager, graph, capture_error = cpu_rate(original.call, original.get_args), None, "CPU graph"
    result.update(eager_ms=eager, graph_ms=graph, capture_error=capture_error)
    emit()
    if request.get("variants") and request.get("fx_module_path"):
        from tilesmith.agent.builtin.config_screen import screen_variants

        def add(record: dict[str, Any]) -> None:
            result["variants"].append(record)
            emit()

        screen_variants(request, original, device, add, deadline, pool)
    # Launch configurations last: the variants (coordinate descent among them) are worth more per second.
    if device.startswith("cuda") and request.get("launch_configs", True) and time.monotonic() < deadline:
        plans, skips = lc.plan_search(source, int(request.get("max_configs", lc.MAX_CONFIGS)))
        result["kernel_skips"] = skips
        if plans:
            search = _load(lc.search_source(source, plans))
            timings: dict[str, list[dict[str, Any]]] = {}
            for plan in plans:
                _instrument(getattr(search, plan.var), plan, timings, result["errors"])
            search.call(list(search.get_args()))
            torch.cuda.synchronize()
            result["kernels"] = timings
            emit()
    elif device.startswith("cuda") and request.get("launch_configs", True):
        result["errors"].append("launch-configuration search skipped: the graph's time budget was spent on the "
                                "configuration variants")


def cpu_rate(call: Any, get_args: Any) -> float:
    """ms per call of ``call(get_args())`` on the CPU (best of 3 batches of ≥ 50 ms)."""
    args = get_args()

    def once() -> None:
        call(list(args))

    for _ in range(3):
        once()
    return _best_rate(once, sync=False)


def measure_call(call: Any, get_args: Any, *, eager: bool = True) -> tuple[float | None, float | None, str | None]:
    """(eager ms/call or None, graph-replay ms/call or None, capture error or None) for ``call(get_args())``.

    ``eager=False`` skips the eager measurement (the caller timed the call itself)."""
    import torch

    args = get_args()

    def once() -> None:
        call(list(args))

    for _ in range(3):
        once()
    torch.cuda.synchronize()
    eager_ms = _best_rate(once) if eager else None
    graph_ms, error = None, None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            once()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
            once()
        graph.replay()
        torch.cuda.synchronize()
        graph_ms = _best_rate(graph.replay)
    except Exception as exc:  # noqa: BLE001 - the body cannot be captured: report why
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - a broken context shows up in the kernel search next
            pass
    return eager_ms, graph_ms, error


def _best_rate(fn: Any, *, sync: bool = True) -> float:
    """Best of 3 batches (the batch doubles until it lasts ≥ 50 ms), in ms per call; with ``sync`` (CUDA) every
    call is followed by a device synchronize (isolated calls)."""
    import torch

    def wait() -> None:
        if sync:
            torch.cuda.synchronize()

    n = 1
    while True:
        wait()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
            wait()
        if time.perf_counter() - t0 >= 0.05 or n >= 4096:
            break
        n *= 2
    best = float("inf")
    for _ in range(3):
        wait()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
            wait()
        best = min(best, (time.perf_counter() - t0) / n * 1e3)
    return best


def _load(source: str) -> Any:
    from torch._inductor.codecache import PyCodeCache

    key, path = PyCodeCache.write(source)
    return PyCodeCache.load_by_key_path(key, path, [], {})


def _instrument(kernel: Any, plan: Any, timings: dict[str, list[dict[str, Any]]], errors: list[str]) -> None:
    """Make ``kernel``'s first launch time every configuration, record them, and keep the fastest."""
    original_run = kernel.run
    defaults = [dict(c) for c in plan.configs[: plan.n_default]]

    def run(*args: Any, stream: Any, **kwargs: Any) -> Any:
        if plan.var not in timings:
            timings[plan.var] = []
            try:
                if not kernel.launchers:
                    kernel.precompile()
                extra = {k: v for k, v in kwargs.items() if k != "benchmark_run"}
                measured = kernel.benchmark_all_configs(*args, **extra)
                for launcher, ms in measured.items():
                    cfg = _config_dict(launcher.config, plan)
                    timings[plan.var].append({"config": cfg, "ms": float(ms), "default": cfg in defaults})
                kernel.launchers = [min(measured, key=measured.get)]
            except Exception as exc:  # noqa: BLE001 - this kernel keeps Inductor's decorator
                errors.append(f"{plan.var}: {type(exc).__name__}: {exc}")
                timings.pop(plan.var, None)
        return original_run(*args, stream=stream, **kwargs)

    kernel.run = run


def _config_dict(config: Any, plan: Any) -> dict[str, Any]:
    """The planned dict this launcher config came from (XBLOCK=1 may have been dropped by Inductor)."""
    got = {**dict(config.kwargs), "num_warps": int(config.num_warps), "num_stages": int(config.num_stages)}
    for planned in plan.configs:
        trimmed = {k: v for k, v in planned.items() if k in got}
        if trimmed == got and all(v == 1 for k, v in planned.items() if k not in got):
            return dict(planned)
    return got


if __name__ == "__main__":
    sys.exit(main(sys.argv))
