"""Cost of production verification (:mod:`tilesmith.install.verify`) for a launch-bound and a compute-bound graph.

    python bench/verify_cost.py                      # CPU test mode (about 1 minute on 2 cores)
    python bench/verify_cost.py --device cuda        # the H200 variant (under 2 minutes with compiles)

Each graph is compiled with ``tilesmith.compile`` and an optimizer that proposes nothing; its canonical wrapper is
then loaded with Tilesmith's install path (``tilesmith.install.loader``), and four boxed callables are built on
that one loaded module:

- ``bare``: the loaded module's entry point, as installed with ``TILESMITH_VERIFY=off``;
- ``unchecked``: the verified entry with a policy that never checks (what every unchecked call pays: a counter);
- ``defaults``: the verified entry with the default policy (``TILESMITH_VERIFY`` unset), after its first-call
  checks; its mean gap between sampled checks adapts to the measured check cost (``budget``);
- ``checked``: the verified entry checking every call (the cost of one checked call).

The arms run in interleaved rounds (one block of calls per arm per round, order rotated and reshuffled per cycle
as in the benchmark suite, ``bench.stats.round_orders``); a block is timed with the host clock and, on CUDA, ends
with a device synchronization. Reported per graph: the bare time per call; for ``unchecked`` and ``checked`` the
median over rounds of the per-round ratio arm/bare with its 95 % bootstrap interval; for ``defaults``, whose checks
fall in a few rounds only, the ratio of total times over all rounds with a bootstrap interval over rounds, and the
verifier's state (checks run, mean gap, check cost, call time, wall time per call between checks), and the time of
a lone checked call after many unchecked ones (what a sampled check costs with cold caches). JSON goes to ``--out``
or ``$OUT``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.stats import median, quantile, ratio_stats, round_orders  # noqa: E402


class NoProposal:
    name = "none"

    def for_graph(self, session):
        return self

    def optimize(self, session):
        return None

    def close(self):
        return None


def _graphs(device: str):
    import torch

    if device == "cuda":
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) / 90.0
    else:
        a, b = torch.randn(256, 512), torch.randn(512, 512) / 22.0
    return {
        "launch_bound": (lambda t: t * 2 + 1, (torch.randn(16, device=device),)),
        "compute_bound": (lambda x, w: torch.tanh(x @ w), (a, b)),
    }


def _arms(fn, inputs, device):
    import torch

    import tilesmith
    from tilesmith.install import verify
    from tilesmith.install.loader import entry_point, load_wrapper
    from tilesmith.install.threads import ThreadCensus
    from tilesmith.settings import VerifyPolicy

    compiled = tilesmith.compile(fn, example_inputs=inputs, agent_model=NoProposal())
    compiled(*inputs)
    run = tilesmith.api._run_of(compiled)
    handle = run.handles[-1]
    module = load_wrapper(handle.graph.canonical_source, handle.constants)
    bare = entry_point(module, handle.graph.inputs_to_check, handle.graph.mutated_input_idxs)
    source = handle.graph.canonical_source

    def guarded(policy):
        prep = verify.Preparation(policy, ThreadCensus() if policy.threads else None)
        return verify.guard(run, handle, None, bare, module, source, prep)

    os.environ.pop("TILESMITH_VERIFY", None)
    defaults = verify.guard(run, handle, None, bare, module, source, verify.prepare())
    arms = {"bare": bare,
            "unchecked": guarded(VerifyPolicy(first=0, every=None, budget=None, interval_s=None)),
            "defaults": defaults,
            "checked": guarded(VerifyPolicy(first=1 << 60, every=None, budget=None, interval_s=None))}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    return arms, sync, run


def _block(call, inputs, n, sync) -> float:
    sync()
    start = time.perf_counter()
    for _ in range(n):
        call(list(inputs))
    sync()
    return (time.perf_counter() - start) * 1e3


def _ratio_of_totals(arm, base, seed=0):
    """sum(arm)/sum(base) and a 95 % percentile-bootstrap interval over rounds."""
    rng = random.Random(seed)
    n = len(arm)
    point = sum(arm) / sum(base)
    boots = []
    for _ in range(2000):
        idx = [rng.randrange(n) for _ in range(n)]
        boots.append(sum(arm[i] for i in idx) / sum(base[i] for i in idx))
    boots.sort()
    return point, (quantile(boots, 0.025), quantile(boots, 0.975))


def measure(name, fn, inputs, device, rounds, block_ms):
    from tilesmith.install import verify

    arms, sync, run = _arms(fn, inputs, device)
    for arm in arms.values():  # warm-up: kernels, allocator, the defaults arm's first-call checks
        for _ in range(20):
            arm(list(inputs))
    sync()
    probe = _block(arms["bare"], inputs, 20, sync) / 20
    probe_checked = _block(arms["checked"], inputs, 5, sync) / 5
    calls = {a: max(20, int(block_ms / max(probe, 1e-6))) for a in arms}
    calls["checked"] = max(5, int(block_ms / max(probe_checked, 1e-6)))  # a block of about block_ms too
    per_call: dict[str, list[float]] = {a: [] for a in arms}
    for order in round_orders(list(arms), rounds, seed=1):
        for a in order:
            per_call[a].append(_block(arms[a], inputs, calls[a], sync) / calls[a])
    v = verify.verifier_of_callable(arms["defaults"])
    out = {"graph": name, "device": device, "rounds": rounds, "calls_per_block": calls,
           "bare_us_per_call": median(per_call["bare"]) * 1e3}
    for a in ("unchecked", "checked"):
        stats = ratio_stats(per_call[a], per_call["bare"])
        out[a] = {"ratio": stats["ratio"], "ci": stats["ci"],
                  "added_us_per_call": (median(per_call[a]) - median(per_call["bare"])) * 1e3}
    point, ci = _ratio_of_totals(per_call["defaults"], per_call["bare"])
    out["defaults"] = {"ratio_of_totals": point, "ci": list(ci), "checks": v.checks, "calls": v.calls,
                       "mean_gap_calls": v.gap, "check_cost_us": (v.check_cost_s or 0) * 1e6,
                       "call_us": (v.call_s or 0) * 1e6, "spacing_us": (v.spacing_s or 0) * 1e6}
    # a lone check after many unchecked calls (caches cold), as the sampled checks are: median of 5
    gap = int(min(30000, 0.5e3 / max(probe, 1e-6)))
    lone = []
    for _ in range(5):
        for _ in range(gap):
            arms["bare"](list(inputs))
        sync()
        t0 = time.perf_counter()
        arms["checked"](list(inputs))
        sync()
        lone.append((time.perf_counter() - t0) * 1e6)
    out["lone_checked_call_us"] = {"after_unchecked_calls": gap, "median": median(lone), "all": lone}
    problems = [d.kind for d in run.diagnostics if d.kind.startswith("verification")]
    out["verification_diagnostics"] = problems
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rounds", type=int, default=None, help="rounds per graph (default 24 CPU, 30 CUDA)")
    parser.add_argument("--block-ms", type=float, default=None, help="target ms of a block (default 40)")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for verify_cost.json")
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["TILESMITH_ALLOW_CPU"] = "1"
    os.environ.setdefault("TILESMITH_PROGRESS", "off")
    os.environ.setdefault("TILESMITH_PRESTART_WORKER", "0")
    rounds = args.rounds or (30 if args.device == "cuda" else 24)
    block_ms = args.block_ms or 40.0
    started = time.monotonic()
    results = []
    for name, (fn, inputs) in _graphs(args.device).items():
        results.append(measure(name, fn, inputs, args.device, rounds, block_ms))
    import torch

    doc = {"results": results, "torch": torch.__version__, "wall_s": time.monotonic() - started,
           "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None}
    print(json.dumps(doc, indent=1))
    for r in results:
        d = r["defaults"]
        print(f"{r['graph']:>14} {r['device']}: bare {r['bare_us_per_call']:.1f} us/call; unchecked "
              f"{r['unchecked']['ratio']:.4f}x [{r['unchecked']['ci'][0]:.4f}, {r['unchecked']['ci'][1]:.4f}] "
              f"(+{r['unchecked']['added_us_per_call'] * 1e3:.0f} ns); checked call {r['checked']['ratio']:.2f}x "
              f"[{r['checked']['ci'][0]:.2f}, {r['checked']['ci'][1]:.2f}] (+{r['checked']['added_us_per_call']:.0f} "
              f"us); defaults {d['ratio_of_totals']:.4f}x [{d['ci'][0]:.4f}, {d['ci'][1]:.4f}] ({d['checks']} "
              f"checks in {d['calls']} calls, mean gap {d['mean_gap_calls']:.0f}, check {d['check_cost_us']:.0f} us, "
              f"call {d['call_us']:.1f} us, spacing {d['spacing_us']:.1f} us); a lone checked call after "
              f"{r['lone_checked_call_us']['after_unchecked_calls']} unchecked ones: "
              f"{r['lone_checked_call_us']['median']:.0f} us")
    if args.out:
        path = Path(args.out) / "verify_cost.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
