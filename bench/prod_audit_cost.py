"""Cost of production verification's audit hook (:mod:`tilesmith.install.audit`, docs/verification.md "Cost").

    TILESMITH_ALLOW_CPU=1 python bench/prod_audit_cost.py [--rounds 40] [--calls 2000] [--events 200000]

Two measurements in one process:

1. **Unchecked calls.** A launch-bound CPU graph (``t * 2 + 1`` on 16 floats, as ``bench/verify_cost.py``) is compiled
   with an optimizer that proposes nothing; its canonical wrapper is loaded with Tilesmith's install path and three
   boxed callables are built on that one module: ``bare`` (``TILESMITH_VERIFY=off``), ``unchecked`` (the verified
   entry, never checking, ``audit=off``: the counter only) and ``audited`` (the same with ``audit=on``: the calling
   thread armed and disarmed around every call). Interleaved rounds (order rotated per round), ``--calls`` calls
   per block; reported: the median over rounds of (arm − bare) per call in ns, with its 10th/90th percentiles.
2. **Events.** Audit events the process raises for reasons unrelated to a wrapper, timed per event before the hook
   exists and after :func:`tilesmith.install.audit.ensure_hook` added it: ``open('/dev/null')`` in another thread
   (a data loader's file I/O: the hook reads one thread-local and returns), ``id()`` (the ``builtins.id`` event) on
   an unarmed thread, and ``id()`` on an armed thread (an event the rules do not judge: one more set lookup); the
   first two (and an ``open`` 30 frames deeper) again once a wrapper file is registered (``*_wrapper_installed``:
   judged events on unarmed threads then walk the stack for the wrapper's frames).
   Reported: ns per event before and after, and the difference (medians over ``--repeats`` blocks).

JSON on stdout (and to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.stats import median, quantile  # noqa: E402
from bench.verify_cost import NoProposal  # noqa: E402


def _per_event(action, n: int, repeats: int, in_thread: bool) -> float:
    """Median ns per call of ``action`` over ``repeats`` blocks of ``n`` calls (in a fresh thread if asked)."""
    results: list[float] = []

    def blocks() -> None:
        for _ in range(repeats):
            t0 = time.perf_counter_ns()
            for _ in range(n):
                action()
            results.append((time.perf_counter_ns() - t0) / n)

    if in_thread:
        thread = threading.Thread(target=blocks)
        thread.start()
        thread.join()
    else:
        blocks()
    return median(results)


def _events(n: int, repeats: int) -> dict[str, dict[str, float]]:
    from tilesmith.install import audit

    def open_null() -> None:
        open("/dev/null", "rb").close()

    def write_null() -> None:
        open("/dev/null", "wb").close()

    def deep(depth: int, leaf=open_null) -> None:
        if depth:
            deep(depth - 1, leaf)
        else:
            leaf()

    probe = object()
    cases = {"open_other_thread": (open_null, max(1, n // 20), True), "id_unarmed": (lambda: id(probe), n, False),
             "open_other_thread_30_frames_deeper": (lambda: deep(30), max(1, n // 20), True),
             "write_other_thread_30_frames_deeper": (lambda: deep(30, write_null), max(1, n // 20), True)}
    before = {name: _per_event(fn, k, repeats, t) for name, (fn, k, t) in cases.items()}
    audit.ensure_hook()
    after = {name: _per_event(fn, k, repeats, t) for name, (fn, k, t) in cases.items()}
    # With a wrapper installed, production judges events on unarmed threads by code origin (a walk of the stack
    # looking for the wrapper's frames) where the hook once returned at once; the wrapper file here never runs.
    try:
        audit.add_wrapper_file("/nonexistent/bench_wrapper.py", audit.Watch("bench"))
    except TypeError:  # the hook before code-origin judging (one argument)
        audit.add_wrapper_file("/nonexistent/bench_wrapper.py")
    for name, (fn, k, t) in cases.items():
        after[name + "_wrapper_installed"] = _per_event(fn, k, repeats, t)
        before[name + "_wrapper_installed"] = before[name]
    with audit.watching(audit.Watch("bench")):
        after["id_armed"] = _per_event(lambda: id(probe), n, repeats, False)
    before["id_armed"] = before["id_unarmed"]
    return {name: {"before_ns": round(before[name], 1), "after_ns": round(after[name], 1),
                   "hook_ns": round(after[name] - before[name], 1)} for name in after}


def _calls(rounds: int, calls: int) -> dict[str, object]:
    import torch

    import tilesmith
    from tilesmith.install import audit, verify
    from tilesmith.install.loader import entry_point, load_wrapper
    from tilesmith.settings import VerifyPolicy

    fn, inputs = (lambda t: t * 2 + 1), (torch.randn(16),)
    compiled = tilesmith.compile(fn, example_inputs=inputs, agent_model=NoProposal())
    compiled(*inputs)
    run = tilesmith.api._run_of(compiled)
    handle = run.handles[-1]
    source = handle.graph.canonical_source
    module = load_wrapper(source, handle.constants)
    bare = entry_point(module, handle.graph.inputs_to_check, handle.graph.mutated_input_idxs)
    never = dict(first=0, every=None, budget=None, interval_s=None, threads=False, state=False, memory=False)

    def guarded(with_audit: bool):
        policy = VerifyPolicy(**never, audit=with_audit)
        watch = audit.Watch(handle.label) if with_audit else None
        return verify.guard(run, handle, None, bare, module, source, verify.Preparation(policy, None, None, watch))

    arms = {"bare": bare, "unchecked": guarded(False), "audited": guarded(True)}
    names = list(arms)
    per_round: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            call = arms[name]
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                call(list(inputs))
            per_round[name].append((time.perf_counter_ns() - t0) / calls)
    out: dict[str, object] = {"bare_ns_per_call": round(median(per_round["bare"]), 1)}
    for name in ("unchecked", "audited"):
        diffs = sorted(a - b for a, b in zip(per_round[name], per_round["bare"]))
        out[f"{name}_minus_bare_ns"] = {"median": round(median(diffs), 1), "p10": round(quantile(diffs, 0.1), 1),
                                        "p90": round(quantile(diffs, 0.9), 1)}
    arming = sorted(a - u for a, u in zip(per_round["audited"], per_round["unchecked"]))
    out["audited_minus_unchecked_ns"] = {"median": round(median(arming), 1), "p10": round(quantile(arming, 0.1), 1),
                                         "p90": round(quantile(arming, 0.9), 1)}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    os.environ.setdefault("TILESMITH_ALLOW_CPU", "1")
    os.environ.setdefault("TILESMITH_PROGRESS", "off")
    os.environ.setdefault("TILESMITH_PRESTART_WORKER", "0")
    events = _events(args.events, args.repeats)  # before anything installs the hook
    result = {"events": events, "calls": _calls(args.rounds, args.calls),
              "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    text = json.dumps(result)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
