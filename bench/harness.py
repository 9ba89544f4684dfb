"""One benchmark case in one process: capture its graphs, cost them, compile every arm, then time the arms
**interleaved**.

Run by ``bench/suite.py`` as a subprocess per case (``python bench/harness.py case --case NAME ...``) so
that no case inherits another case's compiled code, CUDA graphs or allocator state; also
``python bench/harness.py limits --device cuda`` to measure the device ceilings once per suite run.

Method (the same for every arm; one call is end to end through the arm's callable, forward + ``backward(grad)``
for training cases):

1. **Compile.** Each arm gets its own copy of the module (``bench/arms.py``) and is compiled in the order of
   ``bench.arms.ARMS``; its first call, synchronized, is ``compile_s`` (for Tilesmith: ``first_call_s``, the
   first call including its optimization, and ``decided_s``, until ``tilesmith.wait`` returned: the same
   unless ``TILESMITH_OPTIMIZE=background``, where the optimization runs after the first call). Then ``warmup``
   calls per arm, and one untimed warm-up round.
2. **Rounds.** ``rounds`` rounds; each round runs every arm's *timed block* once, in the order of
   :func:`bench.stats.round_orders` (shuffled per cycle, rotated per round). A block is ``calls_per_round``
   timed calls; per call: untimed preparation (gradients set to ``None``,
   ``torch.compiler.cudagraph_mark_step_begin()``), an L2 flush (zeroing a 256 MiB buffer, as
   ``triton.testing.do_bench`` does), ``torch.cuda.synchronize()``, a CUDA event, the call, a CUDA event. The
   device is idle at the first event, so host launch overhead counts (what CUDA graphs remove). The block's
   statistic is the median of its calls.
3. **Statistics** (``bench/stats.py``): per arm the median over rounds; per pair of arms the median over rounds
   of the per-round ratio with a 95 % bootstrap interval.
4. **Checks.** One more call per arm, compared with eager (relative L2 error over outputs and, for training,
   parameter gradients); and the Dynamo compile counter around every timed block (an arm that compiles again
   while timed is flagged: ``recompiles_while_timed``).

An arm that fails (compile, warm-up, a round, the check) is reported with its error and the phase, and the
others go on. **Deadline:** ``SIGUSR1`` (sent by the suite shortly before it would kill the case) during a
compile interrupts that arm (a Tilesmith first call re-raises it, as it does ``KeyboardInterrupt``) and leaves
later arms uncompiled, then the compiled arms are timed as usual; during the rounds it ends them after the
current one. Either way the case still writes what it measured and says where it was ``interrupted``. On CPU (test mode) the host clock replaces the events, nothing is flushed and the process runs
one intra-op thread.

**Log.** The case writes its results only to its JSON file; what it prints is for the case's log (the suite sends
stdout and stderr to ``--out/logs/<case>.log``): a line per phase, arm and round with the seconds since the
process started (:func:`say`), the moment the deadline signal was handled, and Tilesmith's own log records at
INFO (graph decisions, ``tilesmith.progress``) on stderr.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import logging
import math
import os
import signal
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

from bench import stats  # noqa: E402
from bench.arms import ARMS, MODES, build_arm, jsonable, tilesmith_records  # noqa: E402
from bench.capture import CapturedFx, capture_graphs, cost_graphs  # noqa: E402, F401 - re-exported
from bench.cases import Workload, get_case  # noqa: E402
from tilesmith.roofline import DeviceLimits, measure_device_limits  # noqa: E402

FLUSH_BYTES = 256 * 2**20

DEFAULTS = {"cuda": {"rounds": 18, "calls_per_round": 5, "warmup": 3},
            "cpu": {"rounds": 6, "calls_per_round": 3, "warmup": 1}}
"""Per device type: ``rounds`` (18 = three full cycles of six arms), timed calls per round, warm-up calls per arm."""

RECOMPILE_LIMIT = 64
"""``torch._dynamo.config.recompile_limit`` while a case runs: all compiled arms add entries to one code object."""


class CaseDeadline(KeyboardInterrupt):
    """The suite's deadline for this case arrived during a compile (a ``KeyboardInterrupt``, so that Tilesmith's
    first call, which keeps the user's call alive on any other error, lets it through)."""


_DEADLINE = {"hit": False, "raise": False}
_T0 = time.perf_counter()


def say(text: str) -> None:
    """One line of the case's log (module docstring, "Log"): seconds since the process started, then ``text``."""
    print(f"[{time.perf_counter() - _T0:7.1f} s] {text}", flush=True)


def _on_deadline(signum: int, frame: Any) -> None:
    _DEADLINE["hit"] = True
    where = frame.f_code.co_name if frame is not None else "?"
    # os.write, not print: the handler may run inside a print of the main thread, and a buffered stream refuses
    # a reentrant call
    os.write(2, f"[{time.perf_counter() - _T0:7.1f} s] deadline signal (SIGUSR1) handled in {where}: "
                f"{'interrupting the compile' if _DEADLINE['raise'] else 'no compile running'}\n".encode())
    if _DEADLINE["raise"]:
        raise CaseDeadline("the suite's deadline for this case (SIGUSR1)")


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


def time_block(run: Callable[[], Any], prepare: Callable[[], Any], device: torch.device, calls: int,
               flush: torch.Tensor | None) -> list[float]:
    """``calls`` timed calls of ``run()`` in ms, ``prepare()`` untimed before each (module docstring, step 2)."""
    if device.type == "cuda":
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
        for start, end in pairs:
            prepare()
            if flush is not None:
                flush.zero_()
            torch.cuda.synchronize(device)
            start.record()
            run()
            end.record()
        torch.cuda.synchronize(device)
        return [s.elapsed_time(e) for s, e in pairs]
    samples = []
    for _ in range(calls):
        prepare()
        t0 = time.perf_counter()
        run()
        samples.append((time.perf_counter() - t0) * 1e3)
    return samples


def compile_count() -> int:
    """Graphs Dynamo has compiled in this process (``torch._dynamo.utils.counters["stats"]["unique_graphs"]``)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - another torch version: the check is skipped (always 0)
        return 0


# ---------------------------------------------------------------------------------------- one call

def call(fn: Callable[..., Any], model: torch.nn.Module, workload: Workload) -> Any:
    """One call of ``fn`` on the workload's inputs: ``no_grad`` for inference, ``out.backward(grad)`` for training."""
    if workload.train:
        out = fn(*workload.inputs)
        out.backward(workload.grad)
        return out
    with torch.no_grad():
        return fn(*workload.inputs)


def prepare(model: torch.nn.Module, workload: Workload) -> None:
    """Untimed, before every call: gradients to ``None`` (training) and a new CUDA-graph step."""
    if workload.train:
        model.zero_grad(set_to_none=True)
    mark = getattr(torch.compiler, "cudagraph_mark_step_begin", None)
    if mark is not None:
        mark()


def _sync(workload: Workload) -> None:
    if workload.inputs and workload.inputs[0].device.type == "cuda":
        torch.cuda.synchronize()


def snapshot(fn: Callable[..., Any], model: torch.nn.Module, workload: Workload) -> list[torch.Tensor]:
    """Outputs (and for training, parameter gradients) of one call, cloned at once (a CUDA-graph replay would
    overwrite them) and as fp32 for floating tensors."""
    prepare(model, workload)
    out = call(fn, model, workload)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    if workload.train:
        outs += [p.grad for p in model.parameters() if p.grad is not None]
    snap = [o.detach().float().clone() if o.is_floating_point() else o.detach().clone() for o in outs]
    _sync(workload)
    return snap


def max_rel_error(got: list[torch.Tensor], ref: list[torch.Tensor], chunk: int = 1 << 24) -> float:
    """Largest ``‖got - ref‖₂ / ‖ref‖₂`` over tensors (fp64, in chunks of ``chunk`` elements so a 1 GiB output
    needs no 8 GiB temporaries); ``inf`` on a shape mismatch or a NaN/Inf position mismatch; exact comparison
    for integer and boolean tensors (0 or ``inf``)."""
    if len(got) != len(ref):
        return math.inf
    worst = 0.0
    for g, r in zip(got, ref, strict=True):
        if g.shape != r.shape:
            return math.inf
        if not r.is_floating_point():
            worst = max(worst, 0.0 if torch.equal(g, r) else math.inf)
            continue
        gf, rf = g.reshape(-1), r.reshape(-1)
        num = den = 0.0
        for start in range(0, rf.numel(), chunk):
            g64, r64 = gf[start:start + chunk].double(), rf[start:start + chunk].double()
            finite = torch.isfinite(r64)
            if not torch.equal(torch.isfinite(g64), finite):
                return math.inf
            num += float(torch.where(finite, g64 - r64, 0.0).square().sum())
            den += float(torch.where(finite, r64, 0.0).square().sum())
        err = math.sqrt(num) / math.sqrt(den) if den > 0 else (0.0 if num == 0 else math.inf)
        worst = max(worst, err)
    return worst


# ---------------------------------------------------------------------------------------------- case

@dataclasses.dataclass
class _Arm:
    name: str
    model: torch.nn.Module
    result: dict[str, Any]
    fn: Any = None
    handle: Any = None
    samples: list[float] = dataclasses.field(default_factory=list)
    round_ms: list[float | None] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.result.get("status") != "error"

    def fail(self, phase: str, exc: BaseException) -> None:
        self.result.update(status="error", failed_in=phase, error=f"{type(exc).__name__}: {exc}",
                           traceback=traceback.format_exc(limit=8))


Builder = Callable[[str, torch.nn.Module, tuple[torch.Tensor, ...], dict[str, Any]], tuple[Any, Any]]


def run_case(name: str, device: torch.device, limits: DeviceLimits, options: dict[str, Any],
             out_path: Path | None = None, build: Builder = build_arm) -> dict[str, Any]:
    """Run case ``name`` as the module docstring describes; the JSON is rewritten at ``out_path`` after each
    phase. ``options``: ``arms``, ``tiny``, ``rounds``, ``calls_per_round``, ``warmup``, ``seed`` and the
    Tilesmith options of :func:`bench.arms.build_arm`. ``build`` makes an arm's callable (tests pass fakes)."""
    start = time.perf_counter()
    case = get_case(name)
    defaults = DEFAULTS["cuda" if device.type == "cuda" else "cpu"]
    rounds = int(options.get("rounds") or defaults["rounds"])
    calls = int(options.get("calls_per_round") or defaults["calls_per_round"])
    warmup = int(options.get("warmup") if options.get("warmup") is not None else defaults["warmup"])
    seed = int(options.get("seed") or 0)
    requested = [a for a in ARMS if a in (options.get("arms") or ARMS)]
    torch.manual_seed(0)
    workload = case.build(device, bool(options.get("tiny")))
    result: dict[str, Any] = {
        "case": name, "description": case.description, "train": case.train, "tiny": bool(options.get("tiny")),
        "device": str(device), "inputs": workload.shapes, "estimate_s": case.estimate_s, "status": "running",
        "method": {"timer": "cuda_event" if device.type == "cuda" else "host_clock", "rounds": rounds,
                   "calls_per_round": calls, "warmup_calls": warmup, "order_seed": seed,
                   "flush_bytes": FLUSH_BYTES if device.type == "cuda" else 0, "compile_order": requested,
                   "statistic": "median over rounds of the per-round median; ratios: median over rounds of "
                                "the per-round ratio, 95 % percentile bootstrap"},
        "arms": {}, "rounds": []}
    say(f"case {name} on {device}: arms {', '.join(requested)}; {rounds} rounds x {calls} calls, {warmup} warm-up")

    def save() -> None:
        result["wall_s"] = time.perf_counter() - start
        if out_path is not None:
            tmp = out_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(jsonable(result), indent=1))
            os.replace(tmp, out_path)

    try:
        t0 = time.perf_counter()
        result["graphs"], result["floor"] = cost_graphs(capture_graphs(workload), limits)
        result["capture_s"] = time.perf_counter() - t0
        say(f"captured {len(result['graphs'])} graph(s) in {result['capture_s']:.1f} s; floor "
            f"{result['floor'].get('floor_ms') or float('nan'):.4g} ms")
    except Exception as exc:  # noqa: BLE001
        result["capture_error"] = f"{type(exc).__name__}: {exc}"
        result["graphs"], result["floor"] = [], {"floor_ms": None}
        say(f"capture failed: {result['capture_error']}")
    result["method"]["recompile_limit"] = _raise_recompile_limit()
    save()

    arms = []
    for name_ in requested:
        if _DEADLINE["hit"]:
            result["arms"][name_] = {"status": "error", "failed_in": "not compiled",
                                     "error": "the case's deadline came before this arm was compiled"}
            say(f"{name_}: not compiled (the deadline came first)")
            continue
        arms.append(_compile_arm(name_, workload, options, build, result, save, warmup))
        if _DEADLINE["hit"]:
            result["interrupted"] = f"while compiling {name_}"
    t0 = time.perf_counter()
    _run_rounds([a for a in arms if a.ok], workload, device, rounds, calls, seed, result, save)
    result["rounds_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    _check(arms, workload)
    result["check_s"] = time.perf_counter() - t0
    for arm in arms:
        if arm.handle is not None:
            arm.result.update(tilesmith_records(arm.handle))
        if arm.ok and arm.samples:
            stats_ = summarize(arm.samples, result["method"]["timer"])
            valid = [v for v in arm.round_ms if v is not None]
            arm.result["timing"] = dataclasses.asdict(stats_) | {
                "median_ms": stats.median(valid), "median_of_calls_ms": stats_.median_ms, "round_ms": arm.round_ms}
    result["comparison"] = compare(result["arms"])
    result["status"] = "done"
    save()
    vs_best = result["comparison"].get("tilesmith_vs_best") or {}
    say(f"done in {result['wall_s']:.1f} s: best mode {result['comparison']['best_mode']}"
        + (f", tilesmith over it {vs_best['ratio']:.3f}x" if vs_best.get("ratio") else "")
        + (f"; interrupted {result['interrupted']}" if result.get("interrupted") else ""))
    return result


def _raise_recompile_limit() -> int | None:
    config = torch._dynamo.config
    for attr in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, attr):
            setattr(config, attr, max(int(getattr(config, attr)), RECOMPILE_LIMIT))
            return int(getattr(config, attr))
    return None


def _compile_arm(name: str, workload: Workload, options: dict[str, Any], build: Builder,
                 result: dict[str, Any], save: Callable[[], None], warmup: int) -> _Arm:
    arm = _Arm(name, copy.deepcopy(workload.model), {"status": "compiling"})
    result["arms"][name] = arm.result
    phase = "build"
    say(f"{name}: compiling")  # this line and the result line are printed where the deadline cannot raise
    _DEADLINE["raise"] = True
    restore = _cold_caches(name) if options.get("cold_caches", True) and name != "eager" else {}
    arm.result["cold_caches"] = bool(restore)
    try:
        before = compile_count()
        t0 = time.perf_counter()
        arm.fn, arm.handle = build(name, arm.model, workload.inputs, options)
        phase = "first_call"
        prepare(arm.model, workload)
        call(arm.fn, arm.model, workload)
        _sync(workload)
        elapsed = time.perf_counter() - t0
        arm.result.update(compile_s=None if name == "eager" else elapsed, first_call_s=elapsed,
                          graphs_compiled=compile_count() - before)
        if arm.handle is not None:
            import tilesmith

            tilesmith.wait(arm.handle)  # TILESMITH_OPTIMIZE=background: the optimization finishes here
            arm.result["decided_s"] = time.perf_counter() - t0
        phase = "warmup"
        for _ in range(warmup):
            prepare(arm.model, workload)
            call(arm.fn, arm.model, workload)
        _sync(workload)
        arm.result["status"] = "ok"
    except (Exception, CaseDeadline) as exc:  # noqa: BLE001 - one arm's failure must not lose the others
        _DEADLINE["raise"] = False
        arm.fail(phase, exc)
        if arm.handle is not None:
            arm.result.update(tilesmith_records(arm.handle))
    finally:
        _DEADLINE["raise"] = False
        for var, value in restore.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
    if arm.ok:
        say(f"{name}: ok, first call {arm.result['first_call_s']:.1f} s"
            + (f", decided {arm.result['decided_s']:.1f} s" if "decided_s" in arm.result else ""))
    else:
        say(f"{name}: failed in {phase}: {arm.result['error']}")
    save()
    return arm


#: Compiler caches each arm gets empty for its compile (Inductor and Triton read them from the environment at
#: every lookup; processes Tilesmith starts inherit them): no arm's compile time or autotuning benefits from
#: another arm's — e.g. Tilesmith's max-autotune variant from the max-autotune arm's autotuning results.
COLD_CACHE_VARS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def _cold_caches(arm: str) -> dict[str, str | None]:
    """Point :data:`COLD_CACHE_VARS` at a new empty folder for ``arm``; returns the previous values."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix=f"bench-{arm}-"))
    previous = {var: os.environ.get(var) for var in COLD_CACHE_VARS}
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(folder / "triton")
    return previous


def _run_rounds(arms: list[_Arm], workload: Workload, device: torch.device, rounds: int, calls: int, seed: int,
                result: dict[str, Any], save: Callable[[], None]) -> None:
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=device) if device.type == "cuda" else None
    by_name = {a.name: a for a in arms}
    orders = stats.round_orders([a.name for a in arms], rounds + 1, seed)
    signalled_before = _DEADLINE["hit"]  # during a compile: the rounds of the compiled arms still run
    for r, order in enumerate(orders):  # round 0 is the untimed warm-up round
        if _DEADLINE["hit"] and not signalled_before and r > 1:
            result["interrupted"] = f"after round {r - 1} of {rounds}"
            say(f"rounds interrupted {result['interrupted']}")
            break
        entry: dict[str, Any] = {"order": order, "ms": {}}
        for name in order:
            arm = by_name[name]
            if not arm.ok:
                continue
            before = compile_count()
            try:
                samples = time_block(lambda a=arm: call(a.fn, a.model, workload),
                                     lambda a=arm: prepare(a.model, workload), device, calls, flush)
            except Exception as exc:  # noqa: BLE001
                arm.fail("warmup_round" if r == 0 else f"round {r}", exc)
                say(f"{name}: failed in {arm.result['failed_in']}: {arm.result['error']}")
                continue
            again = compile_count() - before
            if again:
                arm.result["recompiles_while_timed"] = arm.result.get("recompiles_while_timed", 0) + again
            if r > 0:
                entry["ms"][name] = stats.median(samples)
                arm.samples += samples
        if r > 0:
            result["rounds"].append(entry)
            for arm in arms:
                arm.round_ms.append(entry["ms"].get(arm.name))
            save()
            say(f"round {r}/{rounds}: " + " ".join(f"{a}={ms:.4f}ms" for a, ms in entry["ms"].items()))
    del flush


def _check(arms: list[_Arm], workload: Workload) -> None:
    """Compare every arm's outputs with the eager arm's (``max_rel_err``; ``None`` without an eager reference)."""
    reference = None
    for arm in sorted(arms, key=lambda a: a.name != "eager"):
        if not arm.ok:
            continue
        try:
            snap = snapshot(arm.fn, arm.model, workload)
            if arm.name == "eager":
                reference = snap
                arm.result["max_rel_err"] = 0.0
            else:
                arm.result["max_rel_err"] = None if reference is None else max_rel_error(snap, reference)
            del snap
        except Exception as exc:  # noqa: BLE001
            arm.fail("check", exc)
            say(f"{arm.name}: failed in check: {arm.result['error']}")
    say("check: max rel. error vs eager " + " ".join(f"{a.name}={a.result['max_rel_err']:.1e}" for a in arms
                                                      if a.ok and a.result.get("max_rel_err") is not None))
    if workload.train:
        for arm in arms:
            arm.model.zero_grad(set_to_none=True)
    del reference
    gc.collect()


def compare(arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """From the arms' per-round medians: the best mode (lowest median of :data:`bench.arms.MODES`), Tilesmith's
    per-round ratio over every other arm and over the best mode (``other / tilesmith``, > 1: Tilesmith faster),
    each arm's ratio over default Inductor (``inductor / arm``), and Tilesmith's first call over the
    ``max-autotune-no-cudagraphs`` compile time."""
    def rounds_of(arm: str) -> list[float | None] | None:
        entry = arms.get(arm) or {}
        if entry.get("status") != "ok":
            return None
        return (entry.get("timing") or {}).get("round_ms")

    def median_of(arm: str) -> float | None:
        return ((arms.get(arm) or {}).get("timing") or {}).get("median_ms") if rounds_of(arm) else None

    modes = [m for m in MODES if median_of(m) is not None]
    best = min(modes, key=lambda m: median_of(m)) if modes else None
    out: dict[str, Any] = {"best_mode": best, "best_mode_ms": median_of(best) if best else None}
    ts = rounds_of("tilesmith")
    out["tilesmith_vs"] = {a: stats.ratio_stats(r, ts) for a in ARMS
                           if a != "tilesmith" and ts and (r := rounds_of(a))}
    out["tilesmith_vs_best"] = out["tilesmith_vs"].get(best) if best else None
    base = rounds_of("inductor")
    out["over_inductor"] = {a: stats.ratio_stats(base, r) for a in ARMS
                            if a != "inductor" and base and (r := rounds_of(a))}
    first = (arms.get("tilesmith") or {}).get("first_call_s")
    manc = (arms.get("max-autotune-no-cudagraphs") or {}).get("compile_s")
    out["tilesmith_first_call_s"], out["max_autotune_nc_compile_s"] = first, manc
    out["first_call_over_max_autotune_nc"] = first / manc if first and manc else None
    out["tilesmith_decided_s"] = (arms.get("tilesmith") or {}).get("decided_s")
    return out


# ----------------------------------------------------------------------------------------------- CLI

def _prepare_process(device: str) -> None:
    """CPU test mode: the Vec-ISA probe skipped, and one intra-op thread, so that eager ATen kernels and the
    OpenMP threads of Inductor's C++ kernels do not spin against each other on a small machine (seen: eager
    calls of 0.05 ms taking 15–24 ms in some rounds on 2 cores)."""
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
    if device == "cpu":
        torch.set_num_threads(1)
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


def load_limits(path: Path) -> DeviceLimits:
    """The :class:`DeviceLimits` in a JSON file written by ``harness.py limits``."""
    fields = json.loads(Path(path).read_text())["limits"]
    fields["matmul_sizes"] = tuple(tuple(x) for x in fields.get("matmul_sizes", ()))
    return DeviceLimits(**fields)


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
    one.add_argument("--options", default="{}", help="JSON: agent, agency, loops, max_model_calls, arms, tiny, "
                     "rounds, calls_per_round, warmup, seed")
    args = parser.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s: "
                        "%(message)s")
    logging.getLogger("tilesmith").setLevel(logging.INFO)  # its graph decisions belong in the case's log
    _prepare_process(args.device)
    if hasattr(signal, "SIGUSR1"):
        signal.signal(signal.SIGUSR1, _on_deadline)
    device = torch.device(args.device)
    if args.command == "limits":
        limits = measure_device_limits(device)
        text = json.dumps({"limits": dataclasses.asdict(limits), "environment": environment()}, indent=1)
        if args.out:
            args.out.write_text(text)
        print(text)
        return 0
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    run_case(args.case, device, load_limits(args.limits), json.loads(args.options), args.out)
    say(f"wrote {args.out}; exiting")  # what follows, until the process ends, is Python's and Tilesmith's exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
