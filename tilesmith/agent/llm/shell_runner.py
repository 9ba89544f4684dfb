"""runner.py in the agent's shell workspace: run or time a wrapper on the graph's real inputs.

This file is copied, read-only, to ``/workspace/runner.py`` of every ``gpu_shell`` sandbox; it imports nothing
from Tilesmith (only torch), so it runs with the sandbox's Python alone. Usage inside the sandbox::

    python runner.py                       # load candidate.py, call it once, compare with baseline.py
    python runner.py --time                # also time both: paired, alternating, median ms per call
    python runner.py other.py --time --iters 50 --warmup 5

Inputs: ``inputs/inputs.pt`` (the graph's first real call, saved by the host) and ``inputs/constants.pt`` (module
constants set as attributes, as Inductor's loader does); without them, the wrapper's own ``get_args()``. Every call
gets fresh copies of the inputs (``call`` may clear its argument list). Timing uses CUDA events around each call on
a GPU, ``time.perf_counter`` on the CPU. Prints one JSON object: ``device``, ``outputs``, ``matches_baseline``
(same count, shapes and dtypes, every largest absolute difference at most 1e-3), ``max_abs_diff`` (per output), and
with ``--time`` ``baseline_ms``, ``candidate_ms`` (medians) and ``speedup`` (baseline / candidate).
A guide for the agent only: the host gate decides what is accepted.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path


def _load(path: Path, name: str, constants: dict):
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"runner: cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    for key, value in constants.items():
        setattr(module, key, value)
    return module


def _inputs(torch, folder: Path, module) -> list:
    saved = folder / "inputs.pt"
    if saved.is_file():
        return list(torch.load(saved, weights_only=True))
    if hasattr(module, "get_args"):
        return list(module.get_args())
    raise SystemExit("runner: no inputs/inputs.pt and the wrapper has no get_args()")


def _fresh(torch, inputs: list) -> list:
    out = []
    for value in inputs:
        if isinstance(value, torch.Tensor):
            copy = torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device=value.device)
            copy.copy_(value)
            out.append(copy)
        else:
            out.append(value)
    return out


def _outputs(torch, result) -> list:
    items = result if isinstance(result, (tuple, list)) else (result,)
    return [x for x in items if isinstance(x, torch.Tensor)]


def _diff(torch, a, b) -> float | None:
    if a.shape != b.shape or a.dtype != b.dtype:
        return None
    if a.numel() == 0:
        return 0.0
    if a.dtype == torch.bool or not (a.is_floating_point() or a.is_complex()):
        return float((a != b).sum().item())
    return float((a.double() - b.double()).abs().nan_to_num(nan=float("inf")).max().item())


def _time_pair(torch, fns: dict, inputs: list, iters: int, warmup: int, cuda: bool) -> dict[str, float]:
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(warmup):
        for fn in fns.values():
            fn(_fresh(torch, inputs))
    if cuda:
        torch.cuda.synchronize()
    for i in range(iters):
        order = list(fns) if i % 2 == 0 else list(reversed(fns))
        for key in order:
            args = _fresh(torch, inputs)
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fns[key](args)
                end.record()
                end.synchronize()
                samples[key].append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fns[key](args)
                samples[key].append((time.perf_counter() - t0) * 1000.0)
    return {k: statistics.median(v) for k, v in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run or time a wrapper on the graph's inputs (a guide only).")
    parser.add_argument("file", nargs="?", default="candidate.py")
    parser.add_argument("--baseline", default="baseline.py")
    parser.add_argument("--time", action="store_true", help="time the file against the baseline")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    import torch

    torch.manual_seed(0)
    folder = Path("inputs")
    constants = torch.load(folder / "constants.pt", weights_only=True) if (folder / "constants.pt").is_file() else {}
    candidate = _load(Path(args.file), "tilesmith_shell_candidate", constants)
    baseline = _load(Path(args.baseline), "tilesmith_shell_baseline", constants)
    inputs = _inputs(torch, folder, baseline)
    cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in inputs)
    got = _outputs(torch, candidate.call(_fresh(torch, inputs)))
    want = _outputs(torch, baseline.call(_fresh(torch, inputs)))
    diffs = [_diff(torch, g, w) for g, w in zip(got, want)]
    report: dict = {"file": args.file, "device": "cuda" if cuda else "cpu", "outputs": len(got),
                    "matches_baseline": len(got) == len(want) and all(d is not None and d <= 1e-3 for d in diffs),
                    "max_abs_diff": diffs}
    if args.time:
        medians = _time_pair(torch, {"baseline": baseline.call, "candidate": candidate.call}, inputs,
                             max(1, args.iters), max(0, args.warmup), cuda)
        report.update({"baseline_ms": medians["baseline"], "candidate_ms": medians["candidate"],
                       "speedup": medians["baseline"] / medians["candidate"] if medians["candidate"] else None,
                       "iters": max(1, args.iters), "clock": "cuda_event" if cuda else "perf_counter"})
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
