"""One benchmark case in one process: capture its graphs, cost them, then time every arm the same way.

Run by ``bench/suite.py`` as a subprocess per case (``python bench/harness.py case --case NAME ...``) so
that no arm inherits another case's compiled code, CUDA graphs or allocator state; also
``python bench/harness.py limits --device cuda`` to measure the device ceilings once per suite run.

Timing (the same for every arm; end to end per call of the compiled callable, forward + backward for
training cases): the first call compiles (its wall time, synchronized, is ``compile_s``); then warm-up
calls; then per timed call: untimed preparation (gradients set to ``None``), an L2 flush (zeroing a
256 MiB buffer, as ``triton.testing.do_bench`` does), ``torch.cuda.synchronize()``, a CUDA event, the
call, a CUDA event. The device is idle when the first event is recorded, so host launch overhead counts
(that is what ``reduce-overhead`` removes). The statistic is the median over calls. On CPU (test mode)
the host clock replaces the events and nothing is flushed.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import torch  # noqa: E402

from bench.cases import Workload, get_case  # noqa: E402
from tilesmith.records import ScalarSpec, TensorSpec  # noqa: E402
from tilesmith.roofline import DeviceLimits, floor_from_cost, graph_cost, measure_device_limits  # noqa: E402

ARMS = ("eager", "inductor", "max-autotune-no-cudagraphs", "reduce-overhead", "tilesmith")
"""Arms in the order they run. ``inductor`` is ``torch.compile`` with the default mode."""

FLUSH_BYTES = 256 * 2**20


# ------------------------------------------------------------------------------------------- timing

@dataclasses.dataclass(frozen=True)
class TimingStats:
    """Per-call times of one arm in milliseconds."""

    method: str
    n: int
    median_ms: float
    mean_ms: float
    p10_ms: float
    p90_ms: float
    min_ms: float
    samples_ms: tuple[float, ...]


def summarize(samples_ms: list[float], method: str) -> TimingStats:
    """Median, mean, 10th/90th percentile (nearest rank) and minimum of ``samples_ms`` (non-empty)."""
    if not samples_ms:
        raise ValueError("summarize: no samples")
    ordered = sorted(samples_ms)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return TimingStats(method, len(ordered), statistics.median(ordered), statistics.fmean(ordered), pct(0.10),
                       pct(0.90), ordered[0], tuple(samples_ms))


def time_calls(run: Callable[[], Any], prepare: Callable[[], Any], device: torch.device, *,
               warmup: int, target_s: float, min_calls: int, max_calls: int) -> TimingStats:
    """Time ``run()`` per call as the module docstring describes; ``prepare()`` runs untimed before each call.

    The number of timed calls is ``target_s`` divided by the median warm-up call time, clamped to
    ``[min_calls, max_calls]``.
    """
    cuda = device.type == "cuda"
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=device) if cuda else None
    estimates = []
    for _ in range(max(1, warmup)):
        prepare()
        t0 = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize(device)
        estimates.append(time.perf_counter() - t0)
    per_call = max(statistics.median(estimates), 1e-6)
    n = int(min(max_calls, max(min_calls, target_s / per_call)))
    samples: list[float] = []
    if cuda:
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for start, end in pairs:
            prepare()
            flush.zero_()
            torch.cuda.synchronize(device)
            start.record()
            run()
            end.record()
        torch.cuda.synchronize(device)
        samples = [s.elapsed_time(e) for s, e in pairs]
        del flush
        return summarize(samples, "cuda_event")
    for _ in range(n):
        prepare()
        t0 = time.perf_counter()
        run()
        samples.append((time.perf_counter() - t0) * 1e3)
    return summarize(samples, "host_clock")


# ------------------------------------------------------------------------------------------ capture

@dataclasses.dataclass(frozen=True)
class CapturedFx:
    """One graph as it reached Inductor's ``compile_fx_inner`` (record only: nothing is compiled)."""

    name: str
    kind: str
    fx_program: str
    inputs: tuple[Any, ...]


def capture_graphs(workload: Workload) -> list[CapturedFx]:
    """Trace ``workload`` through Dynamo and AOTAutograd exactly as Inductor would and keep each graph's FX text.

    The inner compiler records ``print_readable(include_stride=True, include_device=True)`` and returns
    the graph to run eagerly, so no kernel is generated; the AOT cache is off so that every graph is
    seen. Dynamo is reset afterwards.
    """
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import compile_fx

    records: list[CapturedFx] = []

    def inner(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        kind = "backward" if kwargs.get("is_backward") else "inference" if kwargs.get("is_inference") else "forward"
        specs = tuple(
            TensorSpec(tuple(t.shape), tuple(t.stride()), str(t.dtype), str(t.device), int(t.storage_offset()))
            if isinstance(t, torch.Tensor) else ScalarSpec(t if isinstance(t, (int, float, bool)) else 0)
            for t in example_inputs)
        text = gm.print_readable(print_output=False, include_stride=True, include_device=True)
        records.append(CapturedFx(f"{kwargs.get('graph_id', len(records))}_{kind}", kind, text, specs))
        return make_boxed_func(gm.forward)

    def backend(gm: torch.fx.GraphModule, example_inputs: Any, **_: Any) -> Any:
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, inner_compile=inner)

    torch._dynamo.reset()
    fn = torch.compile(workload.model, backend=backend)
    try:
        _call(fn, workload)
        _sync(workload)
    finally:
        torch._dynamo.reset()
    return records


# --------------------------------------------------------------------------------------------- arms

def _call(fn: Callable[..., Any], workload: Workload) -> Any:
    if workload.train:
        out = fn(*workload.inputs)
        out.backward(workload.grad)
        return out
    with torch.no_grad():
        return fn(*workload.inputs)


def _sync(workload: Workload) -> None:
    if workload.inputs and workload.inputs[0].device.type == "cuda":
        torch.cuda.synchronize()


def _zero_grads(workload: Workload) -> None:
    if workload.train:
        workload.model.zero_grad(set_to_none=True)


def _snapshot(fn: Callable[..., Any], workload: Workload) -> list[torch.Tensor]:
    """Outputs (and for training, parameter gradients) of one call, copied to fp32 on the device."""
    _zero_grads(workload)
    if hasattr(torch.compiler, "cudagraph_mark_step_begin"):
        torch.compiler.cudagraph_mark_step_begin()
    out = _call(fn, workload)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    if workload.train:
        outs += [p.grad for p in workload.model.parameters() if p.grad is not None]
    return [o.detach().float().clone() if o.is_floating_point() else o.detach().clone() for o in outs]


def max_rel_error(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """Largest ``‖got - ref‖₂ / ‖ref‖₂`` over tensors (fp64); ``inf`` on a shape mismatch or a NaN/Inf position
    mismatch; exact comparison for integer and boolean tensors (0 or ``inf``)."""
    if len(got) != len(ref):
        return math.inf
    worst = 0.0
    for g, r in zip(got, ref, strict=True):
        if g.shape != r.shape:
            return math.inf
        if not r.is_floating_point():
            worst = max(worst, 0.0 if torch.equal(g, r) else math.inf)
            continue
        g64, r64 = g.double(), r.double()
        if not torch.equal(torch.isfinite(g64), torch.isfinite(r64)):
            return math.inf
        mask = torch.isfinite(r64)
        denom = float(torch.linalg.vector_norm(r64[mask])) if mask.any() else 0.0
        num = float(torch.linalg.vector_norm((g64 - r64)[mask])) if mask.any() else 0.0
        worst = max(worst, num / denom if denom > 0 else (0.0 if num == 0 else math.inf))
    return worst


def build_arm(arm: str, workload: Workload, options: dict[str, Any]) -> tuple[Callable[..., Any], Any]:
    """The callable an arm times, and (Tilesmith only) the handle for ``benchmarks``/``diagnostics``."""
    if arm == "eager":
        return workload.model, None
    if arm == "inductor":
        return torch.compile(workload.model), None
    if arm in ("max-autotune-no-cudagraphs", "reduce-overhead"):
        return torch.compile(workload.model, mode=arm), None
    if arm == "tilesmith":
        import tilesmith

        kwargs = {k: options[k] for k in ("agency", "loops", "max_model_calls") if options.get(k) is not None}
        m = tilesmith.compile(workload.model, example_inputs=workload.inputs, agent_model=options["agent"], **kwargs)
        return m, m
    raise ValueError(f"unknown arm {arm!r}; known: {', '.join(ARMS)}")


def run_arm(arm: str, workload: Workload, options: dict[str, Any], reference: list[torch.Tensor] | None,
            ) -> tuple[dict[str, Any], list[torch.Tensor] | None]:
    """Compile (first call), warm up, time and check one arm. Never raises: errors go into the result."""
    device = workload.inputs[0].device
    result: dict[str, Any] = {"status": "error"}
    snapshot = handle = None
    try:
        torch._dynamo.reset()
        t0 = time.perf_counter()
        fn, handle = build_arm(arm, workload, options)
        _zero_grads(workload)
        _call(fn, workload)
        _sync(workload)
        result["compile_s"] = None if arm == "eager" else time.perf_counter() - t0
        result["first_call_s"] = time.perf_counter() - t0

        def run() -> None:
            _call(fn, workload)

        def prepare() -> None:
            _zero_grads(workload)
            if hasattr(torch.compiler, "cudagraph_mark_step_begin"):
                torch.compiler.cudagraph_mark_step_begin()

        cuda = device.type == "cuda"
        stats = time_calls(run, prepare, device, warmup=options.get("warmup", 5),
                           target_s=options.get("target_s", 0.4 if cuda else 0.05),
                           min_calls=options.get("min_calls", 20 if cuda else 5),
                           max_calls=options.get("max_calls", 200 if cuda else 20))
        result["timing"] = dataclasses.asdict(stats)
        snapshot = _snapshot(fn, workload)
        result["max_rel_err"] = 0.0 if reference is None else max_rel_error(snapshot, reference)
        result["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - one arm's failure must not lose the others
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc(limit=8)
    finally:
        if handle is not None:
            _tilesmith_records(handle, result)
        _zero_grads(workload)
        torch._dynamo.reset()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result, snapshot


def _tilesmith_records(handle: Any, result: dict[str, Any]) -> None:
    """Copy ``tilesmith.benchmarks`` and ``tilesmith.diagnostics`` of ``handle`` into ``result``."""
    import tilesmith

    for key, getter in (("benchmarks", tilesmith.benchmarks), ("diagnostics", tilesmith.diagnostics)):
        try:
            result[key] = [_jsonable(dataclasses.asdict(r)) for r in getter(handle)]
        except Exception as exc:  # noqa: BLE001
            result[f"{key}_error"] = f"{type(exc).__name__}: {exc}"


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------------- case

def cost_graphs(graphs: list[CapturedFx], limits: DeviceLimits) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per-graph costs and floors, and the end-to-end floor (the sum over graphs; ``None`` if any is uncostable)."""
    rows = []
    total_ms: float | None = 0.0
    total_bytes = total_flops = 0
    for g in graphs:
        row: dict[str, Any] = {"name": g.name, "kind": g.kind}
        try:
            cost = graph_cost(g.fx_program, g.inputs)
            floor = floor_from_cost(cost, limits)
            row.update(bytes_read=cost.bytes_read, bytes_written=cost.bytes_written, flops=cost.flops,
                       flops_by_dtype=dict(cost.flops_by_dtype), floor_ms=floor.floor_ms,
                       memory_ms=1e3 * cost.bytes_moved / (limits.copy_gbps * 1e9),
                       flops_tflops=floor.flops_tflops)
            total_bytes += cost.bytes_moved
            total_flops += cost.flops
            total_ms = None if total_ms is None else total_ms + floor.floor_ms
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {exc}"
            total_ms = None
        rows.append(row)
    memory_ms = 1e3 * total_bytes / (limits.copy_gbps * 1e9)
    bound = None if total_ms is None else ("memory" if memory_ms >= 0.999 * total_ms else "compute")
    return rows, {"floor_ms": total_ms, "bytes_moved": total_bytes, "flops": total_flops,
                  "memory_ms": memory_ms, "bound": bound}


def run_case(name: str, device: torch.device, limits: DeviceLimits, options: dict[str, Any],
             out_path: Path | None = None) -> dict[str, Any]:
    """Run every requested arm of case ``name``; the JSON is rewritten at ``out_path`` after each step."""
    start = time.perf_counter()
    case = get_case(name)
    torch.manual_seed(0)
    workload = case.build(device, bool(options.get("tiny")))
    result: dict[str, Any] = {"case": name, "description": case.description, "train": case.train,
                              "tiny": bool(options.get("tiny")), "device": str(device), "inputs": workload.shapes,
                              "arms": {}}

    def save() -> None:
        result["wall_s"] = time.perf_counter() - start
        if out_path is not None:
            tmp = out_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(_jsonable(result), indent=1))
            os.replace(tmp, out_path)

    try:
        t0 = time.perf_counter()
        graphs = capture_graphs(workload)
        result["capture_s"] = time.perf_counter() - t0
        result["graphs"], result["floor"] = cost_graphs(graphs, limits)
    except Exception as exc:  # noqa: BLE001
        result["capture_error"] = f"{type(exc).__name__}: {exc}"
        result["graphs"], result["floor"] = [], {"floor_ms": None}
    save()
    reference = None
    for arm in options.get("arms") or ARMS:
        arm_result, snapshot = run_arm(arm, workload, options, reference)
        if arm == "eager" and snapshot is not None:
            reference = snapshot
        result["arms"][arm] = arm_result
        save()
    return result


# ----------------------------------------------------------------------------------------------- CLI

def _prepare_process(device: str) -> None:
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
    try:
        from tilesmith import _compat

        probe = getattr(_compat, "fast_cpu_isa_probe", None)
        if probe is not None and device == "cpu":
            probe()
    except Exception:  # noqa: BLE001 - an optimisation of CPU test runs only
        pass


def environment() -> dict[str, str]:
    """Versions that change the numbers: Python, torch, Triton, CUDA, the GPU."""
    info = {"python": sys.version.split()[0], "torch": str(torch.__version__),
            "cuda": str(getattr(torch.version, "cuda", None) or "none"), "triton": "none", "gpu": "none"}
    try:
        import triton

        info["triton"] = str(getattr(triton, "__version__", "unknown"))
    except Exception:  # noqa: BLE001 - CPU-only machines may lack Triton
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    lim = sub.add_parser("limits", help="measure copy bandwidth and matmul rates; print JSON")
    lim.add_argument("--device", default="cuda")
    lim.add_argument("--out", type=Path)
    one = sub.add_parser("case", help="run one case; write its JSON")
    one.add_argument("--case", required=True)
    one.add_argument("--device", default="cuda")
    one.add_argument("--limits", type=Path, required=True, help="JSON written by the limits command")
    one.add_argument("--out", type=Path, required=True)
    one.add_argument("--options", default="{}", help="JSON: agent, agency, loops, max_model_calls, arms, tiny")
    args = parser.parse_args(argv)
    _prepare_process(args.device)
    device = torch.device(args.device)
    if args.command == "limits":
        limits = measure_device_limits(device)
        text = json.dumps({"limits": dataclasses.asdict(limits), "environment": environment()}, indent=1)
        if args.out:
            args.out.write_text(text)
        print(text)
        return 0
    fields = json.loads(args.limits.read_text())["limits"]
    fields["matmul_sizes"] = tuple(tuple(x) for x in fields.get("matmul_sizes", ()))
    limits = DeviceLimits(**fields)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    run_case(args.case, device, limits, json.loads(args.options), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
