"""Per-call overhead of an installed graph against calling the loaded module directly (issue 2).

    python bench/call_overhead.py [--device cpu|cuda] [--calls 20000]

A tiny graph (``x * 2 + 1`` on 16 elements) is compiled with ``tilesmith.compile`` and an optimizer that
proposes nothing; the script then installs the canonical wrapper with Tilesmith's own install path
(``tilesmith.install.loader``: load, alignment wrapper, swap), exactly as an accepted candidate would be
installed. It times, in the same process, interleaved in blocks:

- ``installed``: ``CompiledFxGraph.__call__(args)``, the path AOTAutograd takes on every call (it
  dispatches to ``current_callable``, the installed module's ``call``, alignment-wrapped on GPU);
- ``direct``: the loaded module's ``call(args)`` (with the same alignment wrapper on GPU).

Both build a fresh argument list per call (``call`` clears it). Reported: median ns per call of each and
their difference, i.e. what the installed path adds over the module itself. Goal: ≤ 1 µs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--calls", type=int, default=20000, help="calls per arm, split in 20 blocks")
    args = parser.parse_args()

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        os.environ["TILESMITH_ALLOW_CPU"] = "1"
    import tilesmith
    from tilesmith.agent.protocol import Session
    from tilesmith.install.loader import entry_point, load_wrapper, swap

    class NoProposal:
        name = "none"

        def for_graph(self, session: Session):
            return self

        def optimize(self, session: Session) -> None:
            return None

        def close(self) -> None:
            return None

    x = torch.randn(16, device=device)
    compiled = tilesmith.compile(lambda t: t * 2 + 1, example_inputs=(x,), agent_model=NoProposal())
    compiled(x)
    run = tilesmith.api._run_of(compiled)
    (handle,) = run.handles
    module = load_wrapper(handle.graph.canonical_source, handle.constants)
    fn = entry_point(module, handle.graph.inputs_to_check, handle.graph.mutated_input_idxs)
    swap(handle.compiled, fn)
    graph = handle.compiled

    def time_block(call, n: int) -> float:
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter_ns()
        for _ in range(n):
            call([x])
        sync()
        return (time.perf_counter_ns() - start) / n

    for _ in range(2000):  # warm-up both paths
        graph([x])
        fn([x])
    blocks = 20
    per = max(1, args.calls // blocks)
    installed, direct = [], []
    for i in range(blocks):
        order = (graph, fn) if i % 2 == 0 else (fn, graph)
        for call in order:
            (installed if call is graph else direct).append(time_block(call, per))
    med_i, med_d = statistics.median(installed), statistics.median(direct)
    result = {"device": device, "calls_per_arm": per * blocks, "installed_ns": med_i, "direct_ns": med_d,
              "overhead_ns": med_i - med_d, "torch": torch.__version__}
    print(json.dumps(result))
    print(f"installed path {med_i:.0f} ns/call, module call {med_d:.0f} ns/call, "
          f"overhead {med_i - med_d:.0f} ns (goal <= 1000 ns)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
