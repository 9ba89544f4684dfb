"""Reference runs of the original wrapper, in the trusted worker only (the ``ref`` request).

The host names input lists by recipe (:func:`tilesmith.gate.inputs.recipe`), or a timed call of a timing run
by its pool recipe, factors, shift, call index and static inputs (:func:`tilesmith.gate.inputs.call_values`);
the trusted worker makes them on its device from the first call's inputs, runs the original on a fresh copy
from the given RNG seed and reports, per run: the outputs' facts, inputs the original changed although they are
not mutated inputs (``clobbered``: Inductor reuses a dead input's memory), the RNG digest after the call, the
number of non-finite floating outputs, the wall time, and — when asked — the outputs (and mutated inputs) in a
file written with ``torch.save``, for the host to compare candidates against. An exception is reported per run
(``error``), so a variant the original rejects costs one run, not the worker.
"""

from __future__ import annotations

from typing import Any

import torch

from tilesmith.gate import inputs, layout, retained
from tilesmith.gate.worker import runtime
from tilesmith.gate.worker.bindings import T, compact_cpu, save_new


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Element-wise identical, NaN equal to NaN."""
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return bool(torch.equal(a, b))


def _nonfinite(outs: Any) -> int:
    return sum(int((~torch.isfinite(o)).sum()) for o in (layout.plain_sequence(outs) or [])
               if type(o) is torch.Tensor and (o.is_floating_point() or o.is_complex()))


def _values(worker: Any, run: dict[str, Any]) -> list[Any]:
    timed = run.get("timing")
    if timed:
        return inputs.call_values(worker.inputs(timed["pool"]), list(timed["factors"]), int(timed["shift"]),
                                  int(timed["call"]), timed.get("static", ()))
    return [layout.clone_layout(v) if isinstance(v, torch.Tensor) else v for v in worker.inputs(run["inputs"])]


def run_one(worker: Any, run: dict[str, Any]) -> dict[str, Any]:
    """One reference run (see the module text); never raises for an error of the original."""
    fn = worker.modules["orig"].fn
    facts: dict[str, Any] = {}
    try:
        args = _values(worker, run)
        mutated = set(worker.mutated)
        before = {i: a.clone() for i, a in enumerate(args) if isinstance(a, torch.Tensor) and i not in mutated}
        T.manual_seed(int(run.get("seed", 0)))
        with T.no_grad():
            for _ in range(max(0, int(run.get("repeat", 1)) - 1)):
                fn(list(args))
            t0 = T.perf_ns()
            outs, held = retained.call_measured(fn, list(args))
            runtime.sync(worker.device)
            facts["wall_ms"] = (T.perf_ns() - t0) / 1e6
    except BaseException as exc:  # noqa: BLE001 - the original rejects these inputs (e.g. an index check)
        from tilesmith.gate.worker.core import describe

        facts["error"] = describe(exc)
        return facts
    facts["rng"] = runtime.rng_digest(worker.device)
    facts["retained"] = held
    items = layout.plain_sequence(outs)
    outs = items if items is not None else [outs]
    facts["outputs"] = layout.output_facts(outs, args)
    facts["nonfinite"] = _nonfinite(outs)
    facts["clobbered"] = [i for i, b in before.items() if not _same_values(args[i], b)]
    del before
    if run.get("save"):
        tensors = [compact_cpu(o) if type(o) is torch.Tensor else o for o in outs]
        extra = [[i, compact_cpu(args[i])] for i in worker.mutated if i < len(args) and isinstance(args[i], torch.Tensor)]
        save_new({"outputs": tensors, "mutated_inputs": extra}, run["save"])
        facts["saved"] = run["save"]
    return facts


def run_references(worker: Any, msg: dict[str, Any]) -> dict[str, Any]:
    """Handle a ``ref`` request: ``runs`` (list of run dicts), answered with one facts dict per run."""
    return {"ok": True, "runs": [run_one(worker, run) for run in msg.get("runs", [])]}
