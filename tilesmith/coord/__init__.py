"""Tilesmith under ``torchrun``: one optimization per graph for the whole job, the same decision on every rank.

When ``torch.distributed`` is initialised with more than one rank (and ``TILESMITH_DISTRIBUTED`` is not
``off``), every graph's first call goes through :class:`~tilesmith.coord.rank.Coordinator` (docs/distributed.md):

1. **Leader rule.** The graph's leader is the lowest global rank whose torch/Triton/CUDA versions and GPU model
   equal this rank's (the ranks whose graphs get the same cache keys): rank 0 in a homogeneous job. Only the
   leader runs the optimizer and the gate (inline in its first call, as without torchrun). The graph is
   identified across ranks by its *coordination key*: the cache key of the wrapper text with the device index
   neutralised (:mod:`tilesmith.coord.devices`), so ``cuda:0`` on rank 0 and ``cuda:5`` on rank 5 agree.
2. **Followers never block.** Every other rank saves its first call's inputs to a private snapshot, returns
   that call on Inductor and waits in a background thread for the leader's decision.
3. **Agreement.** The leader publishes the accepted wrapper (or "nothing accepted") and keeps running
   Inductor. Each follower re-checks that exact wrapper on its own device with its own gate
   (``Gate.recheck``, the artifact cache's re-check) and answers "usable" or "not usable: why". All usable →
   every rank installs it; one "not usable", a rank whose heartbeat stops, or ``TILESMITH_DIST_TIMEOUT_S``
   without an answer → every rank keeps Inductor. The job's decision is written once with the store's
   ``compare_set``, so all ranks read the same one; the SHA-256 of the device-neutral wrapper text is
   compared on every rank before it installs.
4. **Transport.** The default process group's key-value store (``Store.clone()`` of
   ``torch.distributed.distributed_c10d._get_default_store()``), not a collective: store calls never have to be
   matched call-for-call across ranks, so they can neither deadlock with the user's own collectives nor hang
   when ranks reach graphs in different orders (or a graph only some ranks run); torchrun's store lives in the
   agent, so it outlives a dead rank.

Importing this package does not import torch.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from tilesmith import settings

log = logging.getLogger("tilesmith")

_LOCK = threading.Lock()
_CURRENT: tuple[Any, Any] | None = None
"""``(default store object, Coordinator)`` of this process."""


def coordinator(run: Any) -> Any:
    """This process's :class:`~tilesmith.coord.rank.Coordinator`, or ``None`` when graphs are not coordinated
    (``TILESMITH_DISTRIBUTED=off``, ``torch.distributed`` not initialised, or a single rank).

    Creates it on first use: publishes this rank's fingerprint and starts its heartbeat thread (one store
    ``set`` and one ``add``; no collective). A store that cannot be reached gives a coordinator whose
    ``broken`` reason keeps every graph on Inductor with a ``dist_unavailable`` diagnostic.
    """
    global _CURRENT
    if settings.get("TILESMITH_DISTRIBUTED") == "off":
        return None
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        rank, world = dist.get_rank(), dist.get_world_size()
    except Exception:  # noqa: BLE001 - no usable torch.distributed: nothing to coordinate
        return None
    from tilesmith.coord.board import VERSION, Board
    from tilesmith.coord.rank import Coordinator

    with _LOCK:
        base, broken = _default_store()
        if _CURRENT is not None:
            if _CURRENT[0] is base:
                return _CURRENT[1]
            _CURRENT[1].stop()  # the process group was destroyed and created again
        store = None
        if base is not None:
            try:
                restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
                store = dist.PrefixStore(f"tilesmith/{VERSION}/r{restart}", _private_client(base))
            except Exception as exc:  # noqa: BLE001
                broken = f"{type(exc).__name__}: {exc}"
        made = Coordinator(Board(store, rank, world), run.versions(), broken=broken)
        try:
            made.start()
        except Exception as exc:  # noqa: BLE001 - never raise into compile() or a model call
            made.broken = f"{type(exc).__name__}: {exc}"
        if made.broken:
            log.warning("tilesmith: rank %d: distributed coordination unavailable: %s", rank, made.broken)
        _CURRENT = (base, made)
        return made


def _default_store() -> tuple[Any, str | None]:
    """The default process group's store, or ``(None, why not)``. Private torch API, read defensively."""
    try:
        import torch.distributed.distributed_c10d as c10d

        getter = getattr(c10d, "_get_default_store", None)
        if getter is None:
            return None, "torch.distributed.distributed_c10d._get_default_store is missing in this torch"
        return getter(), None
    except Exception as exc:  # noqa: BLE001
        return None, f"the default process group has no store ({type(exc).__name__}: {exc})"


def _private_client(store: Any) -> Any:
    """A client of the same store for Tilesmith alone (``Store.clone()``: its own connection, so no call of
    ours queues behind the user's process group on a shared socket), with a 30 s operation timeout; the store
    itself where it cannot be cloned (HashStore in tests)."""
    from datetime import timedelta

    try:
        client = store.clone()
    except Exception:  # noqa: BLE001 - FileStore/HashStore versions without clone
        return store
    try:
        client.set_timeout(timedelta(seconds=30))
    except Exception:  # noqa: BLE001
        pass
    return client


__all__ = ["coordinator"]
