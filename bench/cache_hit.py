"""Time an artifact-cache hit adds to a warm start, compared with plain ``torch.compile`` (goal: ≤ 0.5 s).

Usage::

    python bench/cache_hit.py                     # CPU test mode (TILESMITH_ALLOW_CPU=1), scripted optimizer
    python bench/cache_hit.py --device cuda       # on a GPU, proposing the built-in CUDA-graph rewrite
    python bench/cache_hit.py --device cuda --repeats 5 --out results/
    python bench/cache_hit.py --device cuda --recheck background --profile   # where the added time goes

Method (every measurement is a fresh Python process, so nothing is shared in memory):

1. *seed*: one process runs ``tilesmith.compile`` on the model and calls it once, so the optimizer runs,
   the gate accepts a candidate and the artifact store gets an entry (the run also warms Inductor's FX
   graph cache in ``TORCHINDUCTOR_CACHE_DIR``).
2. *plain*: ``torch.compile(model)``; wall time of the first call (Dynamo trace + Inductor warm start).
   One discarded plain run first warms Inductor's caches for this arm too.
3. *hit*: ``tilesmith.compile(model, ...)`` with the same optimizer; wall time of the first call (the same
   warm start + cache lookup + the gate's re-check on this run's inputs + install). The child checks that
   the optimizer was NOT invoked and that the installed record says ``source == "cache"``.

With ``--recheck background`` the hit runs set ``TILESMITH_CACHE_RECHECK=background``: the first call returns
on Inductor while the re-check runs in a thread; the child then waits (``tilesmith.wait``) and also reports
when the artifact was installed (``installed_after_s``, from the start of the first call).

The time compared is *compile + first call*: from just before ``torch.compile(model)`` (plain) or ``import
tilesmith; tilesmith.compile(model, ...)`` (hit) until the first call has returned (after a device
synchronize), so both arms pay their own imports, Dynamo and Inductor's warm start. (Comparing first calls
alone would be unfair to plain ``torch.compile``, which imports Dynamo before its first call while
``tilesmith.compile`` defers that to the first call.) The first-call times are reported too.

Plain and hit runs alternate ``--repeats`` times; the script prints the medians and the added time
(median hit − median plain), and writes ``cache_hit.json`` to ``--out`` (default ``$OUT`` when set).
Nothing is asserted: this is a benchmark, not a test.

Models: CPU — ``tanh(x @ w)`` written as broadcast-multiply-sum (64×512·512×256), with a scripted optimizer
that replaces Inductor's C++ reduction loop by a BLAS ``mm`` (an honest, large win the gate accepts).
CUDA — six ``Linear(256, 256)`` + GELU layers on a 32×256 fp32 batch (12 short kernels per call, strongly
launch-bound) with a scripted optimizer that proposes the built-in agent's whole-call CUDA-graph rewrite (the
gate decides as always). The model is chosen so that the rewrite pays off clearly on any host: the benchmark
measures what a cache hit costs, which needs an artifact to hit. (With ``examples.models.MLPBlock``, whose
CUDA-graph gain is marginal on the H200, the seed run sometimes installed nothing: session 3, docs/h200-runs.md.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOAL_S = 0.5


# -- the child process -----------------------------------------------------------------------------------

class OneTurnFactory:
    """Scripted optimizer factory: one turn that rewrites the attempt with :meth:`edit` (``None``: no proposal).
    ``calls`` counts the graphs it was asked about (a cache hit must leave it at 0)."""

    name = "bench-one-turn"
    proposer = note = ""

    def __init__(self) -> None:
        self.calls = 0

    def for_graph(self, session):
        self.calls += 1
        return self

    def edit(self, text: str) -> str | None:
        raise NotImplementedError

    def optimize(self, session) -> None:
        if session.stop_reason():
            return
        path = session.new_turn()
        text = path.read_text()
        new = self.edit(text)
        if new is not None and new != text:
            path.write_text(new)
            session.evaluate(proposer=self.proposer, note=self.note)

    def close(self) -> None:
        pass


class MMFactory(OneTurnFactory):
    """CPU model: replace the C++ multiply-sum loop by a BLAS ``mm``."""

    name, proposer, note = "bench-mm", "bench:mm", "BLAS mm instead of the C++ reduction loop"
    _LOOP = re.compile(r"cpp_fused_mul_sum_tanh_unsqueeze_\d+\((buf\d+), (\w+), (\w+)\)")

    def edit(self, text: str) -> str | None:
        return self._LOOP.sub(r"extern_kernels.mm(\2, \3, out=\1); torch.tanh(\1, out=\1)", text, count=1)


class CudaGraphFactory(OneTurnFactory):
    """CUDA model: the built-in agent's whole-call CUDA-graph rewrite of the graph's own wrapper (deterministic,
    unlike the built-in agent's gain estimate, which decides from a short profile whether to propose it)."""

    name, proposer, note = "bench-cudagraph", "bench:cudagraph", "whole-call CUDA graph (built-in generator)"

    def edit(self, text: str) -> str | None:
        from tilesmith.agent.builtin.cudagraph import cudagraph_source
        from tilesmith.capture.source import strip_fx_header

        wrapper = strip_fx_header(text)
        return text.replace(wrapper, cudagraph_source(wrapper, device="cuda:0"))


def _model(device: str):
    import torch

    torch.manual_seed(0)
    if device == "cpu":
        class MulSum(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.w = torch.nn.Parameter(torch.randn(512, 256) / 512**0.5)

            def forward(self, x):
                return torch.tanh((x[:, :, None] * self.w[None]).sum(1))

        return MulSum().eval(), torch.randn(64, 512)
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(256, 256), torch.nn.GELU()]
    return torch.nn.Sequential(*layers).to(device).eval(), torch.randn(32, 256, device=device)


class StallSampler:
    """Diagnostic for ``--profile``: a thread that wakes every 5 ms while the first call runs. A wake-up late by
    more than 30 ms means another thread held the GIL (or the process was descheduled) that long; each such stall
    is recorded with the innermost frames of every thread right after it (whoever held the GIL is usually still
    in or just past that call)."""

    def __init__(self) -> None:
        import threading

        self.stalls: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-stall-sampler", daemon=True)

    def start(self) -> None:
        self.t0 = time.perf_counter()
        self._thread.start()

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join()
        return sorted(self.stalls, key=lambda s: -s["gap_s"])[:8]

    def _run(self) -> None:
        import threading
        import traceback

        last = time.perf_counter()
        while not self._stop.wait(0.005):
            now = time.perf_counter()
            if now - last > 0.035:
                names = {t.ident: t.name for t in threading.enumerate()}
                frames = {names.get(ident, str(ident)): [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}"
                                                         for f in traceback.extract_stack(frame)[-4:]]
                          for ident, frame in sys._current_frames().items() if ident != threading.get_ident()}
                self.stalls.append({"at_s": round(last - self.t0, 3), "gap_s": round(now - last - 0.005, 3),
                                    "threads": frames})
            last = now


def _instrument_recheck(result: dict) -> None:
    """Diagnostic for ``--profile``/``--recheck-delay``: wrap the re-check thread's body to report when it
    started (from the first call's start), its wall and CPU time (``time.thread_time``), and optionally hold
    it back ``TILESMITH_BENCH_RECHECK_DELAY`` seconds (to test whether its work slows the first call)."""
    import tilesmith.optimize as optimize

    inner, delay = optimize._stages, float(os.environ.get("TILESMITH_BENCH_RECHECK_DELAY") or 0)

    def stages(*args, **kwargs):
        if not args[-1]:  # blocking re-check: runs inside the first call, nothing to instrument
            return inner(*args, **kwargs)
        time.sleep(delay)
        start, cpu0 = time.perf_counter(), time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            result["recheck_thread"] = {"started_s": round(start - result["_t0"], 3), "delay_s": delay,
                                        "wall_s": round(time.perf_counter() - start, 3),
                                        "cpu_s": round(time.thread_time() - cpu0, 3)}

    optimize._stages = stages


def child(mode: str, device: str) -> None:
    import torch

    if device == "cpu":
        try:
            from tilesmith._compat import fast_cpu_isa_probe

            fast_cpu_isa_probe()
        except ImportError:
            pass
    model, x = _model(device)
    factory = MMFactory() if device == "cpu" else CudaGraphFactory()
    agent = factory
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    profile_dir = os.environ.get("TILESMITH_BENCH_PROFILE")
    profiler = sampler = None
    result: dict = {"mode": mode}
    if profile_dir and mode != "seed":
        import cProfile

        profiler, sampler = cProfile.Profile(), StallSampler()
        profiler.enable()
    started = time.perf_counter()
    if mode == "plain":
        compiled = torch.compile(model)
    else:
        import tilesmith

        _instrument_recheck(result)
        compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=agent, loops=1)
    with torch.no_grad():
        t0 = result["_t0"] = time.perf_counter()
        if sampler is not None:
            sampler.start()
        compiled(x)
        sync()
        first_call_s = time.perf_counter() - t0
    result.update(first_call_s=first_call_s, total_s=time.perf_counter() - started)
    if profiler is not None:
        profiler.disable()
        result["stalls"] = sampler.stop()
        path = Path(profile_dir) / f"{mode}-{os.getpid()}.prof"
        profiler.dump_stats(path)
        result["profile"] = str(path)
    if mode != "plain":
        import tilesmith

        tilesmith.wait(compiled)  # TILESMITH_CACHE_RECHECK=background: until the re-check has installed it
        result["installed_after_s"] = time.perf_counter() - t0

        result["sources"] = [r.source for r in tilesmith.benchmarks(compiled)]
        result["speedups"] = [r.speedup for r in tilesmith.benchmarks(compiled)]
        result["diagnostics"] = [d.kind for d in tilesmith.diagnostics(compiled)]
        result["messages"] = [d.message[:600] for d in tilesmith.diagnostics(compiled)]
        result["optimizer_calls"] = factory.calls if factory is not None else None
    result.pop("_t0", None)
    print("RESULT " + json.dumps(result), flush=True)


# -- the driver ------------------------------------------------------------------------------------------

def _spawn(mode: str, device: str, env: dict[str, str], timeout_s: float) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", mode, "--device", device], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=timeout_s)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{mode} child failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (test mode) or cuda")
    parser.add_argument("--repeats", type=int, default=3, help="plain/hit pairs to measure (default 3)")
    parser.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per child process")
    parser.add_argument("--recheck", choices=["blocking", "background"], default="blocking",
                        help="TILESMITH_CACHE_RECHECK for the hit runs (the seed run always blocks)")
    parser.add_argument("--profile", action="store_true",
                        help="diagnostics: a cProfile of every plain and hit run's compile + first call, saved as "
                             "<out>/profiles/<mode>-<pid>.prof; GIL stalls of the first call and the background "
                             "re-check thread's start, wall and CPU time in the results")
    parser.add_argument("--recheck-delay", type=float, default=0.0,
                        help="diagnostics: hold the background re-check thread back this many seconds")
    parser.add_argument("--child", choices=["plain", "seed", "hit"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = "cuda:0" if args.device == "cuda" else args.device
    if args.child:
        child(args.child, device)
        return 0

    with tempfile.TemporaryDirectory(prefix="tilesmith-cache-hit-") as tmp:
        env = {**os.environ, "TILESMITH_CACHE_DIR": str(Path(tmp) / "ts"), "TILESMITH_PROGRESS": "off",
               "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO / ".cache" / "inductor"))
        if device == "cpu":
            env["TILESMITH_ALLOW_CPU"] = "1"
            env.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
        seed = _spawn("seed", device, env, args.timeout)
        print(f"seed run: first call {seed['first_call_s']:.2f} s, installed from {seed.get('sources')} "
              f"with speedups {seed.get('speedups')}, diagnostics {seed.get('diagnostics')}")
        if "optimizer" not in (seed.get("sources") or []):
            print("the seed run installed nothing, so there is no artifact to hit; nothing to measure")
            return 1
        env["TILESMITH_CACHE_RECHECK"] = args.recheck
        if args.profile:
            profiles = (args.out or Path(tmp)) / "profiles"
            profiles.mkdir(parents=True, exist_ok=True)
            env["TILESMITH_BENCH_PROFILE"] = str(profiles)
        if args.recheck_delay:
            env["TILESMITH_BENCH_RECHECK_DELAY"] = str(args.recheck_delay)
        _spawn("plain", device, env, args.timeout)  # warm Inductor's caches for the plain arm too (discarded)
        plain, hit = [], []
        for i in range(args.repeats):
            plain.append(_spawn("plain", device, env, args.timeout))
            hit.append(_spawn("hit", device, env, args.timeout))
            print(f"pair {i + 1}: compile + first call: plain {plain[-1]['total_s']:.3f} s, hit "
                  f"{hit[-1]['total_s']:.3f} s (first call alone {plain[-1]['first_call_s']:.3f} s, "
                  f"{hit[-1]['first_call_s']:.3f} s; installed {hit[-1]['installed_after_s']:.3f} s after the call "
                  "started) "
                  f"(sources {hit[-1].get('sources')}, optimizer calls {hit[-1].get('optimizer_calls')})")
            for name, run in (("plain", plain[-1]), ("hit", hit[-1])):
                if "recheck_thread" in run:
                    print(f"  {name} re-check thread: {run['recheck_thread']}")
                for stall in run.get("stalls", [])[:3]:
                    print(f"  {name} GIL stall {stall['gap_s']:.3f} s at {stall['at_s']:.3f} s: {stall['threads']}")
    all_hits = all(h.get("sources") == ["cache"] for h in hit)
    not_optimized = all(h.get("optimizer_calls") in (0, None) for h in hit)
    plain_s = statistics.median(p["total_s"] for p in plain)
    hit_s = statistics.median(h["total_s"] for h in hit)
    added = hit_s - plain_s
    first_added = statistics.median(h["first_call_s"] for h in hit) - statistics.median(p["first_call_s"] for p in plain)
    installed_s = statistics.median(h["installed_after_s"] for h in hit)
    summary = {"device": device, "recheck": args.recheck, "installed_after_s": installed_s, "repeats": args.repeats, "plain_compile_and_first_call_s": plain_s,
               "hit_compile_and_first_call_s": hit_s, "added_s": added, "first_call_added_s": first_added, "goal_s": GOAL_S, "meets_goal": added <= GOAL_S, "every_hit_from_cache": all_hits,
               "optimizer_skipped": not_optimized, "plain": plain, "hit": hit, "seed": seed}
    print()
    print("| device | re-check | plain compile + first call (s) | cache hit compile + first call (s) | added (s) | "
          "goal (s) | first call alone, added (s) | installed after (s) | all hits |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {device} | {args.recheck} | {plain_s:.3f} | {hit_s:.3f} | {added:+.3f} | {GOAL_S} | {first_added:+.3f} | "
          f"{installed_s:.3f} | {all_hits and not_optimized} |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cache_hit.json").write_text(json.dumps(summary, indent=2))
        print(f"wrote {args.out / 'cache_hit.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
