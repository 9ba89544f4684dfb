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
from tilesmith.agent.builtin.base import KernelTiming, Profile


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


def run_search(source: str, device: str, *, timeout_s: float | None = None, max_configs: int | None = None
               ) -> Profile:
    """Measure ``source`` on ``device`` in a worker process.

    Raises:
        SearchFailed: the worker timed out, exited non-zero, or reported an error before measuring.
    """
    limit = timeout_s if timeout_s is not None else float(settings.get("TILESMITH_WORKER_TIMEOUT_S"))
    with tempfile.TemporaryDirectory(prefix="tilesmith-search-") as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        payload: dict[str, Any] = {"source": source}
        if max_configs is not None:
            payload["max_configs"] = max_configs
        request.write_text(json.dumps(payload), encoding="utf-8")
        log_path = Path(tmp) / "worker.log"
        with log_path.open("w", encoding="utf-8") as log:
            try:
                proc = subprocess.run(
                    [sys.executable, "-m", "tilesmith.agent.builtin.search_worker", str(request), str(result)],
                    cwd=tmp, env=worker_environment(device), stdout=log, stderr=subprocess.STDOUT,
                    timeout=limit, check=False)
            except subprocess.TimeoutExpired:
                raise SearchFailed(f"the search worker exceeded {limit:.0f} s (TILESMITH_WORKER_TIMEOUT_S)"
                                   ) from None
        if proc.returncode != 0 or not result.exists():
            tail = log_path.read_text(encoding="utf-8", errors="replace")[-800:]
            raise SearchFailed(f"the search worker exited with status {proc.returncode}: {tail.strip()}")
        return parse_result(json.loads(result.read_text(encoding="utf-8")))


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
                   kernel_skips=dict(data.get("kernel_skips") or {}), errors=errors, wall_s=data.get("wall_s"))
