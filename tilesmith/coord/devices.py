"""Device-index-neutral wrapper text: the same graph on ``cuda:0`` and ``cuda:3`` gets one coordination key.

On a host with several GPUs, local rank *k* compiles its graphs for ``cuda:k``; Inductor writes the index into
the wrapper (``torch.cuda.set_device(k)``, ``with torch.cuda._DeviceGuard(k):``, ``get_raw_stream(k)``,
``device='cuda:k'`` in the benchmark harness and the FX comments, ``DeviceProperties(type='cuda', index=k, ...)``
in every Triton kernel's ``triton_meta``), so the cache key (which hashes that text) differs per local rank.
:func:`neutral` replaces exactly these forms of the graph's own index by a placeholder; :func:`retarget` fills
the placeholder with another rank's index. Forms seen in the H200 captures (tests/fixtures/inductor-h200/).

A candidate that names its device in a form not listed here is retargeted incompletely: it then targets the
leader's GPU on the follower, where the follower's own gate re-check fails (outputs on the wrong device, or a
crash), the follower vetoes, and every rank keeps Inductor for that graph. Never a silent wrong install.
"""

from __future__ import annotations

import hashlib
import re

PLACEHOLDER = "<TILESMITH_DEVICE_INDEX>"
"""Stands for the graph's CUDA device index in a neutral text; never appears in Inductor output."""


def _patterns(index: int) -> list[tuple[re.Pattern[str], str]]:
    i = str(int(index))
    p = PLACEHOLDER
    return [
        (re.compile(rf"\bcuda:{i}\b"), f"cuda:{p}"),
        (re.compile(rf"\b(set_device|_DeviceGuard|get_raw_stream|device_guard)\({i}\)"), rf"\1({p})"),
        (re.compile(rf"(type='cuda', index=){i}\b"), rf"\g<1>{p}"),
        (re.compile(rf'(type="cuda", index=){i}\b'), rf"\g<1>{p}"),
    ]


def neutral(source: str, index: int | None) -> str:
    """``source`` with the graph's own device index ``index`` replaced by :data:`PLACEHOLDER`.

    ``index``: the CUDA device index of the graph (``None`` for a CPU graph: the text is returned unchanged).
    """
    if index is None:
        return source
    for pattern, replacement in _patterns(index):
        source = pattern.sub(replacement, source)
    return source


def retarget(neutral_source: str, index: int | None) -> str:
    """A neutral text (:func:`neutral`) made concrete for device index ``index`` (``None``: CPU, unchanged).

    Raises:
        ValueError: the text holds the placeholder but ``index`` is ``None`` (a CUDA graph given to a CPU rank).
    """
    if PLACEHOLDER not in neutral_source:
        return neutral_source
    if index is None:
        raise ValueError("the wrapper names a CUDA device index but this rank's graph runs on the CPU")
    return neutral_source.replace(PLACEHOLDER, str(int(index)))


def device_index(device: str) -> int | None:
    """``"cuda:3"`` → 3, ``"cuda"`` → 0, ``"cpu"`` → ``None`` (the form of :attr:`CapturedGraph.device`)."""
    if not device.startswith("cuda"):
        return None
    _, _, tail = device.partition(":")
    return int(tail) if tail.isdigit() else 0


def source_sha256(neutral_source: str) -> str:
    """SHA-256 hex of a neutral wrapper text: equal on every rank that installs the same wrapper."""
    return hashlib.sha256(neutral_source.encode("utf-8")).hexdigest()
