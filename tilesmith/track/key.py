"""The 64-hex cache key of one generated graph and its optimization environment (docs/cache.md).

The key is the SHA-256 of a canonical JSON document holding everything that changes the answer:

- the canonical wrapper text (machine paths and process counters removed, see
  :func:`tilesmith.capture.source.canonicalize`) without its full-line comments
  (:func:`~tilesmith.capture.source.key_text`: Inductor's provenance comments depend on the FX-cache state)
  — it embeds every kernel's source and every extern call;
- torch, Triton and CUDA versions and the device name (GPU model, or ``"cpu"`` in test mode);
- the optimizer (``agent_model``), ``agency``, ``loops`` and the gate threshold
  (``TILESMITH_MIN_IMPROVEMENT``);
- ``KEY_FORMAT``, bumped whenever this list or the artifact layout changes, so old entries just miss.

Nothing in it depends on the process, the Inductor cache dir or the time, so the same graph gets the same
key in any process on any machine with the same environment. ``max_model_calls`` is left out: a validated
artifact stays valid whatever budget found it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

KEY_FORMAT = 2


def cache_key(canonical_source: str, environment: dict[str, Any]) -> str:
    """SHA-256 hex digest (64 characters) of the canonical source plus ``environment``.

    Args:
        canonical_source: the canonical wrapper text.
        environment: JSON-serializable mapping (see :func:`key_environment`).
    """
    from tilesmith.capture.source import key_text

    document = {"format": KEY_FORMAT, "wrapper": key_text(canonical_source), "environment": environment}
    blob = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def key_environment(*, versions: dict[str, str], device: str, agent_model: str | None, agency: str, loops: int,
                    min_improvement: float) -> dict[str, Any]:
    """The environment part of the key. ``versions`` is :func:`tilesmith._compat.versions`'s result."""
    device_name = versions.get("gpu", "none") if device.startswith("cuda") else "cpu"
    return {
        "torch": versions.get("torch"),
        "triton": versions.get("triton"),
        "cuda": versions.get("cuda"),
        "device": device_name,
        "agent_model": agent_model,
        "agency": agency,
        "loops": loops,
        "min_improvement": min_improvement,
    }
