"""Cost of the structural side-effect snapshots (docs/gate.md, "Side effects by structure"; docs/verification.md,
"Cost"): the class digest, the hook tables, the mode state, the gate's full comparison and production's checked-call
parts, with Inductor and Dynamo loaded the way a user's process has them (one ``torch.compile`` first).

    TILESMITH_ALLOW_CPU=1 python bench/snapshot_cost.py   # CPU, ~20 s; medians of 20 repeats, in ms
"""

from __future__ import annotations

import time
import timeit

import torch


def _ms(fn, n: int = 20) -> str:
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return f"median {times[n // 2]:6.2f} ms  (min {times[0]:.2f}, max {times[-1]:.2f})"


def main() -> None:
    compiled = torch.compile(lambda x, w: torch.tanh(x @ w) + 1)
    compiled(torch.randn(32, 64), torch.randn(64, 16))
    from tilesmith.gate import modes, torchstate
    from tilesmith.gate.classdigest import ClassDigest
    from tilesmith.gate.sidefx import ProductionSnapshot, SideEffects
    from tilesmith.gate.window import StateWindow

    source = "import torch\nfrom torch._inductor.select_algorithm import extern_kernels\naten = torch.ops.aten\n"
    names = torchstate.wrapper_namespaces(source)
    gate, prod = SideEffects(), ProductionSnapshot()
    print("gate SideEffects.baseline           ", _ms(lambda: gate.baseline(names), 10))
    print(f"  classes {len(gate.classes.entries)}, attributes {sum(len(e[2]) for e in gate.classes.entries)}, "
          f"hook containers {len(gate.classes.containers)}")
    print("gate comparison (identity + state)  ", _ms(lambda: (gate.identity_changes(), gate.state_changes())))
    print("  ClassDigest.changes               ", _ms(gate.classes.changes))
    print("  ClassDigest.baseline (a fresh one) ", _ms(lambda: ClassDigest().baseline(), 10))
    print("  hook tables (gate)                ", _ms(gate.hooks))
    print("torchstate.state_snapshot (+ modes) ", _ms(lambda: torchstate.state_snapshot("cpu")))
    print("production baseline                 ", _ms(lambda: prod.baseline(names), 10))
    prod.digest_interval_s = 0.0
    print("production changes, digest due      ", _ms(prod.changes))
    prod.digest_interval_s = 1e9
    print("production changes, digest not due  ", _ms(prod.changes))
    print("StateWindow open + changes          ", _ms(lambda: StateWindow("cpu", prod.classes.containers).changes()))
    print(f"modes.depths (per unchecked call, x2) {timeit.timeit(modes.depths, number=200_000) / 200_000 * 1e9:.0f} ns")


if __name__ == "__main__":
    main()
