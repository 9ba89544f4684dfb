"""Cost of the side-effect re-check production verification adds to a checked call
(:class:`tilesmith.gate.sidefx.ProductionSnapshot`, docs/verification.md "Cost").

    python bench/verify_state_cost.py [--wrapper tests/fixtures/wrappers/cpu_mlp_infer.wrapper.py] [--repeats 300]

Takes the baseline for the namespaces the given Inductor wrapper names (after importing them, as the user's process
has) and times :meth:`ProductionSnapshot.changes` (the whole per-check work: attribute identities, torch.backends
values, the denormal probe) ``--repeats`` times with the host clock, then a state window's opening and reading
(:class:`tilesmith.gate.window.StateWindow`, once per checked call). Prints the namespaces and attributes watched,
the median and the 10th/90th percentiles of each in milliseconds (``snapshot_ms_*``, ``window_ms_*``), as JSON.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wrapper", default="tests/fixtures/wrappers/cpu_mlp_infer.wrapper.py")
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    import torch  # noqa: F401

    from tilesmith.gate import torchstate
    from tilesmith.gate.sidefx import ProductionSnapshot
    from tilesmith.gate.window import StateWindow

    names = torchstate.wrapper_namespaces(Path(args.wrapper).read_text(encoding="utf-8"))
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # a name imported from a module, not a module
    snap = ProductionSnapshot()
    snap.baseline(names)
    assert snap.changes() == [], snap.changes()
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        snap.changes()
        times.append((time.perf_counter() - t0) * 1e3)
    window = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        StateWindow("cpu").changes()  # opened before the wrapper runs, read after it
        window.append((time.perf_counter() - t0) * 1e3)
    print(json.dumps({"wrapper": args.wrapper, "namespaces": len(snap.base_attrs),
                      "attributes": sum(len(a) for a, _ in snap.base_attrs.values()),
                      "values": len(snap.base_values), "repeats": args.repeats,
                      **_quantiles("snapshot", times), **_quantiles("window", window)}))
    return 0


def _quantiles(name: str, times: list[float]) -> dict[str, float]:
    times = sorted(times)
    pick = lambda q: round(times[min(len(times) - 1, int(q * len(times)))], 3)  # noqa: E731
    return {f"{name}_ms_median": pick(0.5), f"{name}_ms_p10": pick(0.1), f"{name}_ms_p90": pick(0.9)}


if __name__ == "__main__":
    sys.exit(main())
