"""Per-call overhead of an installed graph against calling the loaded module directly (issue 2).

    python bench/call_overhead.py [--device cpu|cuda] [--calls 20000]

A tiny graph (``x * 2 + 1`` on 16 elements) is compiled with ``tilesmith.compile`` and an optimizer that
proposes nothing; the script then installs the canonical wrapper with Tilesmith's own install path
(``tilesmith.install.loader``: load, alignment wrapper, swap), exactly as an accepted candidate would be
installed. It times, in the same process, interleaved in blocks:

- ``installed``: ``CompiledFxGraph.__call__(args)``, the path AOTAutograd takes on every call (it
  dispatches to ``current_callable``, the installed module's ``call``, alignment-wrapped on GPU);
- ``inductor``: the same ``CompiledFxGraph.__call__`` with Inductor's own ``current_callable`` put back
  (what plain ``torch.compile`` runs on every call);
- ``direct``: the loaded module's ``call(args)`` (with the same alignment wrapper on GPU).

All build a fresh argument list per call (``call`` clears it). Reported: median ns per call of each arm,
``overhead_ns`` = installed − direct (what the installed path adds over the module itself; issue 2's goal:
≤ 1 µs) and ``tilesmith_added_ns`` = installed − inductor (what Tilesmith adds over plain ``torch.compile``'s
own call path; ``CompiledFxGraph.__call__`` is Inductor's and is paid by both).
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

    blocks = 20
    per = max(1, args.calls // blocks)
    original = handle.original

    def installed_arm(a):
        return graph(a)

    def inductor_arm(a):
        return graph(a)

    arms = {"installed": (installed_arm, fn), "inductor": (inductor_arm, original), "direct": (fn, None)}
    for name, (call, current) in arms.items():  # warm-up every arm
        if current is not None:
            swap(graph, current)
        for _ in range(2000):
            call([x])
    samples: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for i in range(blocks):
        order = names[i % 3:] + names[:i % 3]  # rotate the order block by block
        for name in order:
            call, current = arms[name]
            if current is not None:
                swap(graph, current)
            samples[name].append(time_block(call, per))
    swap(graph, fn)
    med = {name: statistics.median(v) for name, v in samples.items()}
    result = {"device": device, "calls_per_arm": per * blocks, "installed_ns": med["installed"],
              "inductor_ns": med["inductor"], "direct_ns": med["direct"],
              "overhead_ns": med["installed"] - med["direct"],
              "tilesmith_added_ns": med["installed"] - med["inductor"], "torch": torch.__version__}
    print(json.dumps(result))
    print(f"installed path {med['installed']:.0f} ns/call, plain Inductor path {med['inductor']:.0f} ns/call, "
          f"module call {med['direct']:.0f} ns/call; overhead over the module {result['overhead_ns']:.0f} ns "
          f"(goal <= 1000 ns), added over plain torch.compile {result['tilesmith_added_ns']:.0f} ns")
    return 0


if __name__ == "__main__":
    sys.exit(main())
