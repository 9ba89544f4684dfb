"""Running the search worker from the optimizer: one subprocess per graph, environment without secrets.

The worker (:mod:`tilesmith.agent.builtin.search_worker`) loads the original wrapper on the graph's GPU,
times it eagerly and as a CUDA-graph replay, and times every planned launch configuration of every tunable
Triton kernel. Its wall-clock limit is ``TILESMITH_WORKER_TIMEOUT_S`` (the gate's per-request limit; the
search is one such request), capped by the time the session has left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tilesmith import settings
from tilesmith._proc import kill_group
from tilesmith.agent.builtin.base import KernelTiming, Profile
from tilesmith.agent.builtin.configs import VariantScreen


class SearchFailed(RuntimeError):
    """The search worker could not produce measurements (message: why, with the worker's last output)."""


def worker_environment(device: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The worker's environment: the current one minus every provider key and Tilesmith secret.

    ``device`` is accepted for symmetry with the gate's workers; the wrapper names its device itself
    (``cuda:N``), so the visible devices are left as they are.
    """
    env = dict(os.environ if environ is None else environ)
    for name in settings.PROVIDER_KEY_VARIABLES:
        env.pop(name, None)
    for name, setting in settings.REGISTRY.items():
        if setting.secret:
            env.pop(name, None)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_search(source: str, device: str, *, timeout_s: float | None = None, max_configs: int | None = None,
               variants: list[dict[str, Any]] | None = None, fx_module: Any = None, deadline_s: float | None = None,
               original_canonical: str | None = None, launch_configs: bool = True,
               compile_workers: int | None = None) -> Profile:
    """Measure ``source`` on ``device`` in a worker process (and, with ``variants`` and ``fx_module``, compile and
    screen each configuration variant: :mod:`tilesmith.agent.builtin.config_screen`).

    ``timeout_s``: the worker's wall-clock limit (default ``TILESMITH_WORKER_TIMEOUT_S``); its whole process
    group (Inductor's compile workers too) is killed past it. ``deadline_s``: seconds after the worker's start
    past which it compiles no new variant; ``compile_workers``: processes compiling variants side by side
    (default :func:`tilesmith.agent.builtin.config_screen.compile_workers`). A worker killed at its limit after measuring the original still
    returns what it finished, with the timeout named in ``Profile.errors``.

    Raises:
        SearchFailed: the worker timed out or exited before measuring the original wrapper.
    """
    limit = timeout_s if timeout_s is not None else float(settings.get("TILESMITH_WORKER_TIMEOUT_S"))
    with tempfile.TemporaryDirectory(prefix="tilesmith-search-") as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        payload: dict[str, Any] = {"source": source, "device": device, "launch_configs": launch_configs}
        if max_configs is not None:
            payload["max_configs"] = max_configs
        if variants and fx_module is not None:
            module_path = Path(tmp) / "graph.fxpkl"
            module_path.write_bytes(fx_module.payload)
            payload.update(variants=variants, fx_module_path=str(module_path), fx_kwargs=fx_module.kwargs_dict(),
                           deadline_s=deadline_s if deadline_s is not None else 0.8 * limit,
                           original_canonical=original_canonical or source, compile_workers=compile_workers)
        request.write_text(json.dumps(payload), encoding="utf-8")
        log_path = Path(tmp) / "worker.log"
        timed_out = False
        with log_path.open("w", encoding="utf-8") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tilesmith.agent.builtin.search_worker", str(request), str(result)],
                cwd=tmp, env=worker_environment(device), stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
            try:
                proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                kill_group(proc)
        data: dict[str, Any] | None = None
        if result.exists():
            try:
                data = json.loads(result.read_text(encoding="utf-8"))
            except ValueError:
                data = None
        if data is None or data.get("eager_ms") is None:
            if timed_out:
                raise SearchFailed(f"the search worker reached its limit of {limit:.0f} s before measuring the "
                                   "original wrapper (the limit is what was left of the graph's time budget, "
                                   "TILESMITH_GRAPH_BUDGET_S, at most TILESMITH_WORKER_TIMEOUT_S); raise "
                                   "TILESMITH_GRAPH_BUDGET_S for graphs that compile slowly")
            tail = log_path.read_text(encoding="utf-8", errors="replace")[-800:]
            if data is None:
                raise SearchFailed(f"the search worker exited with status {proc.returncode}: {tail.strip()}")
        if timed_out:
            data.setdefault("errors", []).append(f"the search worker was stopped at its {limit:.0f} s limit; "
                                                 "later measurements are missing")
        return parse_result(data)


def parse_result(data: dict[str, Any]) -> Profile:
    """The worker's result JSON as a :class:`Profile`.

    Raises:
        SearchFailed: the worker reported errors and no call timing.
    """
    errors = tuple(str(e) for e in data.get("errors", ()))
    if data.get("eager_ms") is None:
        raise SearchFailed("the search worker measured nothing: " + ("; ".join(errors[:1]) or "no result"))
    kernels = {
        var: tuple(KernelTiming(config=dict(t["config"]), ms=float(t["ms"]), default=bool(t["default"]))
                   for t in timings)
        for var, timings in (data.get("kernels") or {}).items()
    }
    return Profile(eager_ms=float(data["eager_ms"]),
                   graph_ms=None if data.get("graph_ms") is None else float(data["graph_ms"]),
                   capture_error=data.get("capture_error"), kernels=kernels,
                   kernel_skips=dict(data.get("kernel_skips") or {}), errors=errors, wall_s=data.get("wall_s"),
                   variants=tuple(VariantScreen.from_json(v) for v in data.get("variants") or ()))
