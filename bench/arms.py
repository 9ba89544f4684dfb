"""The arms of a benchmark case: what each one compiles, and what the Tilesmith arm reports about itself.

Every arm gets its **own copy** of the case's module (``copy.deepcopy``: same weights, separate parameters,
gradients and buffers) and its own ``torch.compile``, so no two arms share compiled code or CUDA graphs. The
copies share the input tensors. All compiled arms run in one process on the same ``forward`` code object;
Dynamo keeps one cache entry per backend for it (a backend mismatch skips an entry without evaluating its
guards), which is why the harness raises ``torch._dynamo.config.recompile_limit`` above the number of arms and
checks that no arm compiles again while it is timed (``bench/harness.py``).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
from pathlib import Path
from typing import Any

import torch

ARMS = ("eager", "inductor", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune", "tilesmith")
"""Arms in the order they are compiled (and reported). ``inductor`` is ``torch.compile`` in the default mode."""

MODES = ("inductor", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune")
"""The four ``torch.compile`` modes a user could pick instead of Tilesmith ("the best mode" is the one of these
with the lowest median time in the case)."""

CUDAGRAPH_ARMS = ("reduce-overhead", "max-autotune")
"""Arms whose ``torch.compile`` mode records CUDA graphs (CUDA-graph trees): their outputs live in a memory
pool that the next replay overwrites, so the harness calls ``torch.compiler.cudagraph_mark_step_begin()``
before every call (PyTorch's guidance for outputs that are not kept) and clones what it keeps."""


def build_arm(arm: str, model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], options: dict[str, Any],
              ) -> tuple[Any, Any]:
    """``(callable, tilesmith handle or None)`` for ``arm`` on ``model`` (already a private copy).

    ``options``: ``agent`` (``"tilesmith/builtin"``, a model the proxy lists, or ``"py:module:attr"`` naming an
    ``OptimizerFactory`` or a zero-argument callable returning one), and ``agency``, ``loops``,
    ``max_model_calls`` for ``tilesmith.compile``. Raises ``ValueError`` for an unknown arm.
    """
    if arm == "eager":
        return model, None
    if arm == "inductor":
        return torch.compile(model), None
    if arm in ("max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune"):
        return torch.compile(model, mode=arm), None
    if arm == "tilesmith":
        import tilesmith

        kwargs = {k: options[k] for k in ("agency", "loops", "max_model_calls") if options.get(k) is not None}
        agent = load_agent(options.get("agent") or "tilesmith/builtin")
        m = tilesmith.compile(model, example_inputs=inputs, agent_model=agent, **kwargs)
        return m, m
    raise ValueError(f"unknown arm {arm!r}; known: {', '.join(ARMS)}")


def load_agent(spec: str) -> Any:
    """The ``agent_model`` for ``spec``: the string itself, or for ``"py:module:attr"`` the imported object
    (instantiated with no arguments when it is a class; called when it is another callable without ``for_graph``).

    Raises ``ValueError`` for a malformed ``py:`` spec, ``ImportError``/``AttributeError`` when it does not
    resolve.
    """
    if not spec.startswith("py:"):
        return spec
    parts = spec[3:].split(":")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"agent spec {spec!r}: expected 'py:<module>:<attribute>', e.g. "
                         "'py:bench.optimizers:NoOpFactory'")
    obj = getattr(importlib.import_module(parts[0]), parts[1])
    if isinstance(obj, type) or (callable(obj) and not callable(getattr(obj, "for_graph", None))):
        obj = obj()
    return obj


# ----------------------------------------------------------------------------------- Tilesmith records

def tilesmith_records(handle: Any) -> dict[str, Any]:
    """What the Tilesmith arm says about itself: ``benchmarks`` and ``diagnostics`` (the public API, as JSON)
    and ``tracks`` (per graph, from the run folder's ``track.json``: status, benchmark, every evaluation's
    proposer/status/speedups, and the ``profiles/`` records that are not gate evaluations, e.g. screens).

    Never raises: a failure to read one part is recorded as ``<part>_error``.
    """
    import tilesmith

    out: dict[str, Any] = {}
    for key, getter in (("benchmarks", tilesmith.benchmarks), ("diagnostics", tilesmith.diagnostics)):
        try:
            out[key] = [jsonable(dataclasses.asdict(r)) for r in getter(handle)]
        except Exception as exc:  # noqa: BLE001 - records are reported, never fatal
            out[f"{key}_error"] = f"{type(exc).__name__}: {exc}"
    try:
        folder = run_folder(handle)
        out["run_folder"] = None if folder is None else str(folder)
        out["tracks"] = [] if folder is None else read_tracks(folder)
    except Exception as exc:  # noqa: BLE001
        out["tracks_error"] = f"{type(exc).__name__}: {exc}"
    return out


def run_folder(handle: Any) -> Path | None:
    """The ``runs/<run-id>/`` folder of a ``tilesmith.compile`` result (read defensively from the private run
    object: ``tilesmith.api._run_of(m).folder.folder``), or ``None``."""
    try:
        from tilesmith import api

        run = api._run_of(handle)
    except Exception:  # noqa: BLE001 - another Tilesmith version
        return None
    folder = getattr(getattr(run, "folder", None), "folder", None)
    return Path(folder) if folder is not None else None


MAX_PROFILE_BYTES = 32_000
"""A non-evaluation profile record larger than this is listed by name only (keeps results.json small)."""


def read_tracks(run_dir: Path) -> list[dict[str, Any]]:
    """One summary per ``<run_dir>/<key>/track.json`` (layout: docs/layout.md), in name order."""
    tracks = []
    for path in sorted(Path(run_dir).glob("*/track.json")):
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            tracks.append({"folder": str(path.parent), "error": f"{type(exc).__name__}: {exc}"})
            continue
        evaluations = [{k: e.get(k) for k in ("id", "proposer", "status", "speedup", "confirmation_speedup")}
                       | {"reasons": list(e.get("reasons") or [])[:3]}
                       for e in state.get("evaluations") or []]
        accepted = [e for e in evaluations if e.get("status") == "accepted"]
        known = {str(e.get("id")) for e in evaluations}
        extra: dict[str, Any] = {}
        for prof in sorted((path.parent / "profiles").glob("*.json")):
            if prof.stem in known:
                continue
            try:
                extra[prof.name] = (json.loads(prof.read_text()) if prof.stat().st_size <= MAX_PROFILE_BYTES
                                    else f"({prof.stat().st_size} bytes, not copied)")
            except (OSError, ValueError) as exc:
                extra[prof.name] = f"unreadable: {type(exc).__name__}: {exc}"
        tracks.append(jsonable({
            "graph_key": state.get("graph_key"), "graph_name": state.get("graph_name"), "kind": state.get("kind"),
            "status": state.get("status"), "loops_accepted": state.get("loops_accepted"),
            "turns": state.get("turns"), "benchmark": state.get("benchmark"), "evaluations": evaluations,
            "winner": accepted[-1]["proposer"] if accepted else None, "other_profiles": extra,
            "diagnostics": [{k: d.get(k) for k in ("kind", "message")} for d in state.get("diagnostics") or []],
        }))
    return tracks


def jsonable(value: Any) -> Any:
    """``value`` with non-finite floats as ``"inf"``/``"-inf"``/``None`` and tuples as lists (strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value
