"""Search-worker side of the configuration generator: compile the graph again per variant, then screen it.

Runs only inside :mod:`tilesmith.agent.builtin.search_worker` (a process of Tilesmith's own, never the user's),
after the original wrapper was measured. For each :class:`~tilesmith.agent.builtin.configs.Variant` of the
request, in order, while the request's deadline allows:

1. **compile**: ``compile_fx_inner`` on the graph :mod:`tilesmith.capture.fxgraph` serialized, under
   ``torch._inductor.config.patch(variant patches)`` (``cpp_wrapper`` also gets Inductor's own
   ``get_cpp_wrapper_config()`` patches and ``cpp_wrapper=True``, exactly as ``compile_fx`` passes them). Options
   this torch does not have are dropped and named in the record (Inductor renames options between releases);
2. **load and warm up** the generated wrapper (its first calls run Inductor's runtime autotuning and coordinate
   descent, here rather than in the gate or the user's process);
3. **pin** every tunable Triton kernel to the launch configuration its autotuner chose
   (:func:`tilesmith.agent.builtin.launch_config.pin_source`, Inductor's ``fixed_config`` path), so the source the
   gate measures is exactly the source that is installed, and nothing autotunes again at the user's first call;
4. **screen correctness**: outputs against the original wrapper's on the same inputs (relative L2 error ≤ 1e-2,
   NaN/Inf positions equal: a cheap filter; the gate's checks decide);
5. **screen timing**: paired rounds against the original (alternating order, each a batch of calls; on CUDA each
   call synchronized, i.e. the latency of an isolated call as the gate times it, as ``eager_ms``), the median of
   per-round ratios; on CUDA also the time per synchronized replay of the variant captured into one CUDA graph
   (``graph_ms``), for the composition with the ``cudagraph`` generator.

Every record is written to the result file as soon as it is complete (the worker may be killed at its limit; the
host keeps what was written). Inputs: the wrapper's own ``get_args()`` (random floats, zero integers), the same
tensors for both arms.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: Paired rounds per variant and the minimum duration of one arm's batch in a round (seconds).
SCREEN_ROUNDS = 7
SCREEN_BATCH_S = {"cuda": 0.004, "cpu": 0.02}
#: Relative L2 error above which a variant is screened out as incorrect (the gate's per-dtype limits are far
#: tighter; this only keeps obviously broken compiles away from the gate).
SCREEN_REL_L2 = 1e-2


def screen_variants(request: dict[str, Any], original: Any, device: str, emit: Callable[[dict[str, Any]], None],
                    deadline: float, pool: CompilePool | None = None) -> None:
    """Compile (or take from ``pool``) and screen every variant of ``request["variants"]``, in order; ``emit(record)``
    after each one.

    ``original``: the loaded original wrapper module; ``deadline``: ``time.monotonic()`` value after which no
    new variant is started (a record with ``status="skipped"`` says so).
    """
    from tilesmith.capture import fxgraph

    payload = Path(request["fx_module_path"]).read_bytes() if pool is None else b""
    kwargs = dict(request.get("fx_kwargs") or {})
    kind = "cuda" if device.startswith("cuda") else "cpu"
    args = original.get_args()
    ref_out = _run(original.call, args)
    for variant in request["variants"]:
        name = variant["name"]
        record: dict[str, Any] = {"name": name, "patches": variant["patches"]}
        started = time.monotonic()
        try:
            if pool is not None:
                done = pool.result(name)
                if done.get("status"):
                    emit({**record, **done})
                    continue
                source, record["compile_s"], record["dropped_options"] = done["source"], done["compile_s"], \
                    done.get("dropped_options", [])
            elif time.monotonic() > deadline:
                emit({**record, "status": "skipped", "error": "the graph's time budget ran out before this variant"})
                continue
            else:
                source, record["dropped_options"] = _compile(payload, kwargs, variant, fxgraph)
                record["compile_s"] = round(time.monotonic() - started, 3)
            _screen(record, source, original, args, ref_out, kind, request.get("original_canonical", ""))
        except Exception as exc:  # noqa: BLE001 - a variant that fails to compile or run is recorded, not fatal
            record.setdefault("compile_s", round(time.monotonic() - started, 3))
            record.update(status="failed", error=f"{type(exc).__name__}: {str(exc)[:600]}",
                          traceback=traceback.format_exc(limit=6)[-1500:])
            _sync(kind)
        emit(record)


def compile_workers(n_variants: int, cpus: int | None = None) -> int:
    """How many processes compile variants side by side: one per 4 CPUs, at most 4 and at most one per
    variant; 1 (compile in the search worker itself, no extra process) on small machines such as CI's 2 cores.
    Compiling is mostly single-threaded Python per variant; Inductor's own compile pool uses the other cores."""
    cpus = cpus if cpus is not None else (os.cpu_count() or 1)
    return max(1, min(n_variants, cpus // 4, 4))


class CompilePool:
    """Variant compiles in ``compile_workers`` processes started before the original is measured (so the compiles
    overlap the search worker's own start-up work); :meth:`result` waits for one variant's source.

    Each process (``python -m tilesmith.agent.builtin.config_screen REQUEST OUT``) compiles its share in portfolio
    order and rewrites ``OUT`` atomically after each variant. The processes are in the search worker's process
    group, which the host kills at the graph's limit.
    """

    def __init__(self, request: dict[str, Any], folder: Path, deadline: float, workers: int) -> None:
        variants = list(request["variants"])
        self.folder = folder
        self.outs: dict[str, Path] = {}
        self.procs: list[tuple[subprocess.Popen, Path]] = []
        for w in range(workers):
            share = variants[w::workers]
            if not share:
                continue
            req, out = folder / f"compile_{w}.json", folder / f"compiled_{w}.json"
            req.write_text(json.dumps({"fx_module_path": request["fx_module_path"],
                                       "fx_kwargs": request.get("fx_kwargs") or {}, "variants": share,
                                       "deadline": deadline}), encoding="utf-8")
            log = (folder / f"compile_{w}.log").open("w", encoding="utf-8")
            proc = subprocess.Popen([sys.executable, "-m", "tilesmith.agent.builtin.config_screen", str(req), str(out)],
                                    stdout=log, stderr=subprocess.STDOUT)
            log.close()
            self.procs.append((proc, out))
            for v in share:
                self.outs[v["name"]] = out

    def result(self, name: str) -> dict[str, Any]:
        """``{"source", "compile_s", "dropped_options"}``, or a record with ``status`` (skipped/failed) and ``error``."""
        out = self.outs[name]
        proc = next(p for p, o in self.procs if o == out)
        while True:
            done = _read_json(out).get(name)
            if done is not None:
                return done
            if proc.poll() is not None:
                done = _read_json(out).get(name)
                if done is not None:
                    return done
                log = (out.parent / out.name.replace("compiled_", "compile_").replace(".json", ".log"))
                tail = log.read_text(encoding="utf-8", errors="replace")[-600:] if log.exists() else ""
                return {"status": "failed", "error": f"the compile process exited with status {proc.returncode} "
                                                     f"before this variant: {tail.strip()}"}
            time.sleep(0.05)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def compile_main(argv: list[str]) -> int:
    """Entry of one compile process: compile the request's variants in order, stop starting new ones past the
    request's ``deadline`` (a ``time.monotonic()`` value: the clock is system-wide on Linux)."""
    from tilesmith.agent.builtin.search_worker import write_json
    from tilesmith.capture import fxgraph

    request = json.loads(Path(argv[1]).read_text(encoding="utf-8"))
    payload = Path(request["fx_module_path"]).read_bytes()
    kwargs = dict(request.get("fx_kwargs") or {})
    done: dict[str, Any] = {}
    for variant in request["variants"]:
        name = variant["name"]
        if time.monotonic() > float(request["deadline"]):
            done[name] = {"status": "skipped", "error": "the graph's time budget ran out before this variant"}
        else:
            started = time.monotonic()
            try:
                source, dropped = _compile(payload, kwargs, variant, fxgraph)
                done[name] = {"source": source, "compile_s": round(time.monotonic() - started, 3),
                              "dropped_options": dropped}
            except Exception as exc:  # noqa: BLE001 - recorded for the screen
                done[name] = {"status": "failed", "compile_s": round(time.monotonic() - started, 3),
                              "error": f"{type(exc).__name__}: {str(exc)[:600]}",
                              "traceback": traceback.format_exc(limit=6)[-1500:]}
        write_json(Path(argv[2]), done)
    return 0


def _compile(payload: bytes, kwargs: dict[str, Any], variant: dict[str, Any], fxgraph: Any) -> tuple[str, list[str]]:
    """Inductor's wrapper source for the graph under ``variant``'s patches, and the options this torch lacks; for
    the ``aten`` variant (:data:`.aten_wrapper.MARKER`) the graph's ATen code as a wrapper."""
    from tilesmith.agent.builtin import aten_wrapper

    if variant["patches"].get(aten_wrapper.MARKER):
        gm, _, _ = fxgraph.load(payload)
        return aten_wrapper.wrapper_source(gm), []
    import torch._inductor.config as inductor_config
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx_inner

    patches, dropped = {}, []
    for key, value in variant["patches"].items():
        if _has_option(inductor_config, key):
            patches[key] = value
        else:
            dropped.append(key)
    call_kwargs = dict(kwargs)
    if patches.get("cpp_wrapper"):
        from torch._inductor import compile_fx as cfx

        extra = getattr(cfx, "get_cpp_wrapper_config", None)
        if extra is not None:
            patches = {**extra(), **patches}
        call_kwargs["cpp_wrapper"] = True
    if not patches:
        raise RuntimeError(f"none of the options {sorted(variant['patches'])} exist in this torch's Inductor config")
    gm, inputs, fake_mode = fxgraph.load(payload)
    with inductor_config.patch(patches), tracing(TracingContext(fake_mode)), fake_mode:
        compiled = compile_fx_inner(gm, inputs, **call_kwargs)
    source = getattr(compiled, "source_code", None)
    if not source:
        raise RuntimeError("Inductor returned no wrapper source for this variant")
    return str(source), dropped


def _has_option(config: Any, dotted: str) -> bool:
    node = config
    for part in dotted.split("."):
        if not hasattr(node, part):
            return False
        node = getattr(node, part)
    return True


def _screen(record: dict[str, Any], source: str, original: Any, args: list[Any], ref_out: Any, kind: str,
            original_canonical: str) -> None:
    from tilesmith.agent.builtin.launch_config import pin_source
    from tilesmith.agent.builtin.search_worker import _load, measure_call
    from tilesmith.capture.source import canonicalize

    canonical = canonicalize(source)
    if original_canonical and canonical == original_canonical:
        record.update(status="identical", error="the configuration generated the original wrapper again")
        return
    module = _load(canonical)
    out = _run(module.call, args)  # first call: runtime autotuning and coordinate descent happen here
    for _ in range(2):
        out = _run(module.call, args)
    _sync(kind)
    pins, unpinned = tuned_configs(canonical, module)
    pinned = pin_source(canonical, pins) if pins else canonical
    record.update(pinned_kernels=len(pins), unpinned_kernels=unpinned)
    error = _screen_error(ref_out, out)
    record["screen_rel_l2"] = error
    from tilesmith.agent.builtin import aten_wrapper

    layout = aten_wrapper.strides_differ(ref_out, out) if record.get("patches", {}).get(aten_wrapper.MARKER) else None
    if layout:  # the gate would reject it (output layout): not worth an evaluation
        record.update(status="incorrect", error=f"{layout} on the screen inputs", source=None)
        return
    if error is None or error > SCREEN_REL_L2:
        record.update(status="incorrect", error=f"outputs differ from the original's (relative L2 {error}) on the "
                                                f"screen inputs", source=None)
        return
    ratio, orig_ms, var_ms = paired_ratio(lambda: _run(original.call, args), lambda: _run(module.call, args), kind)
    record.update(status="ok", ratio=ratio, original_ms=orig_ms, eager_ms=var_ms, source=pinned)
    if kind == "cuda":
        _, graph_ms, capture_error = measure_call(module.call, lambda: args, eager=False)
        record.update(graph_ms=graph_ms, capture_error=capture_error)


def tuned_configs(source: str, module: Any) -> tuple[dict[str, dict[str, Any]], int]:
    """``(pins, unpinned)``: the launch configuration each tunable Triton kernel's autotuner settled on (kernel
    variable → config dict) after the module ran, and how many Triton kernels keep their decorator (templates,
    multi-kernels, untuned, or one not yet launched)."""
    from tilesmith.agent.builtin.launch_config import untunable_reason
    from tilesmith.agent.builtin.wrapper_text import triton_kernels

    pins: dict[str, dict[str, Any]] = {}
    unpinned = 0
    for kernel in triton_kernels(source):
        tuner = getattr(module, kernel.var, None)
        launchers = getattr(tuner, "launchers", None) or []
        if untunable_reason(kernel) is not None or len(launchers) != 1:
            unpinned += 1
            continue
        config = getattr(launchers[0], "config", None)
        if config is None:
            unpinned += 1
            continue
        params = set(kernel.params)
        cfg = {k: v for k, v in dict(config.kwargs).items() if k in params or not k.endswith("BLOCK")}
        cfg.update(num_warps=int(config.num_warps), num_stages=int(config.num_stages))
        pins[kernel.var] = cfg
    return pins, unpinned


def paired_ratio(run_a: Callable[[], Any], run_b: Callable[[], Any], kind: str, rounds: int = SCREEN_ROUNDS
                 ) -> tuple[float, float, float]:
    """``(median of per-round time_a / time_b, median ms per call of a, of b)`` over ``rounds`` paired rounds.

    Each round times a batch of calls of each arm (order alternating between rounds; on CUDA every call
    synchronized: :func:`_batch`); the batch size makes arm ``a``'s batch last ≥ :data:`SCREEN_BATCH_S`.
    """
    target = SCREEN_BATCH_S[kind]
    n = 1
    while True:
        t = _batch(run_a, n, kind)
        if t >= target or n >= 4096:
            break
        n = min(4096, max(n * 2, int(math.ceil(n * target / max(t, 1e-6)))))
    ratios, a_ms, b_ms = [], [], []
    for r in range(rounds):
        if r % 2 == 0:
            ta, tb = _batch(run_a, n, kind), _batch(run_b, n, kind)
        else:
            tb, ta = _batch(run_b, n, kind), _batch(run_a, n, kind)
        ratios.append(ta / tb if tb > 0 else math.inf)
        a_ms.append(ta / n * 1e3)
        b_ms.append(tb / n * 1e3)
    return statistics.median(ratios), statistics.median(a_ms), statistics.median(b_ms)


def _batch(fn: Callable[[], Any], n: int, kind: str) -> float:
    """Seconds for ``n`` calls of ``fn``; on CUDA each call is synchronized (isolated calls, as the gate times
    them: :func:`tilesmith.gate.worker.timing._timed`)."""
    _sync(kind)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
        _sync(kind)
    return time.perf_counter() - t0


def _run(call: Any, args: list[Any]) -> Any:
    return call(list(args))


def _sync(kind: str) -> None:
    if kind == "cuda":
        import torch

        torch.cuda.synchronize()


def _screen_error(expected: Any, got: Any) -> float | None:
    """Largest relative L2 error over the tensor outputs (``None``: different structure or NaN/Inf positions)."""
    import torch

    exp = [t for t in _flatten(expected) if isinstance(t, torch.Tensor)]
    out = [t for t in _flatten(got) if isinstance(t, torch.Tensor)]
    if len(exp) != len(out):
        return None
    worst = 0.0
    for e, g in zip(exp, out):
        if e.shape != g.shape or e.dtype != g.dtype:
            return None
        if not (e.is_floating_point() or e.is_complex()):
            if not torch.equal(e, g):
                return math.inf
            continue
        e64, g64 = e.detach().double(), g.detach().double()
        finite = torch.isfinite(e64)
        if not torch.equal(finite, torch.isfinite(g64)):
            return None
        diff = float(torch.linalg.vector_norm((g64 - e64)[finite]))
        norm = float(torch.linalg.vector_norm(e64[finite]))
        worst = max(worst, diff / norm if norm > 0 else diff)
    return worst


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, list | tuple):
        return [leaf for item in value for leaf in _flatten(item)]
    return [value]


if __name__ == "__main__":
    sys.exit(compile_main(sys.argv))
