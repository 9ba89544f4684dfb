"""Time an artifact-cache hit adds to a warm start, compared with plain ``torch.compile`` (goal: ≤ 0.5 s).

Usage::

    python bench/cache_hit.py                     # CPU test mode (TILESMITH_ALLOW_CPU=1), scripted optimizer
    python bench/cache_hit.py --device cuda       # on a GPU, proposing the built-in CUDA-graph rewrite
    python bench/cache_hit.py --device cuda --repeats 5 --out results/

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
    started = time.perf_counter()
    if mode == "plain":
        compiled = torch.compile(model)
    else:
        import tilesmith

        compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=agent, loops=1)
    profiler = None
    if os.environ.get("TILESMITH_BENCH_PROFILE") and mode == "hit":
        import cProfile

        profiler = cProfile.Profile()
    with torch.no_grad():
        t0 = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        compiled(x)
        sync()
        first_call_s = time.perf_counter() - t0
        if profiler is not None:
            import pstats

            profiler.disable()
            pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(
                r"tilesmith/|subprocess|threading|serialization|synchronize|compile_fx_inner|load_with_key", 40)
    result = {"mode": mode, "first_call_s": first_call_s, "total_s": time.perf_counter() - started}
    if mode != "plain":
        import tilesmith

        tilesmith.wait(compiled)  # TILESMITH_CACHE_RECHECK=background: until the re-check has installed it
        result["installed_after_s"] = time.perf_counter() - t0

        result["sources"] = [r.source for r in tilesmith.benchmarks(compiled)]
        result["speedups"] = [r.speedup for r in tilesmith.benchmarks(compiled)]
        result["diagnostics"] = [d.kind for d in tilesmith.diagnostics(compiled)]
        result["optimizer_calls"] = factory.calls if factory is not None else None
    print("RESULT " + json.dumps(result), flush=True)


# -- the driver ------------------------------------------------------------------------------------------

def _spawn(mode: str, device: str, env: dict[str, str], timeout_s: float) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", mode, "--device", device], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=timeout_s)
    if env.get("TILESMITH_BENCH_PROFILE") and mode == "hit":
        print("\n".join(line for line in proc.stderr.splitlines()
                        if "function calls" in line or "cumtime" in line or ".py:" in line))
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
                        help="print a cProfile of every hit run's first call (stderr of the child, to stdout)")
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
            env["TILESMITH_BENCH_PROFILE"] = "1"
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
