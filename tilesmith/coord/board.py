"""The job's decision board: the ``torch.distributed`` key-value store, read and written without blocking.

Every key lives under ``tilesmith/v1/r<restart>/`` of the default process group's store (torchrun's agent
store, or the TCPStore/FileStore the user's ``init_process_group`` rendezvoused with), through a private
client of its own (``Store.clone()``) so that no call of ours waits behind the user's process group:

============================== ====================================================================
``fp/<rank>``                  the rank's environment fingerprint (torch/Triton/CUDA versions, GPU model,
                               host, local rank), written once when its first ``tilesmith.compile`` runs
``alive/<rank>``               a counter the rank's heartbeat thread adds 1 to every second
``g/<ckey>/<n>/decision``      the leader's decision for the *n*-th occurrence of coordination key
                               ``ckey`` in the job: accepted or not, and the accepted wrapper's neutral
                               text, its SHA-256 and the leader's numbers
``g/<ckey>/<n>/vote/<rank>``   a rank's answer after re-checking the accepted wrapper on its own device
``g/<ckey>/<n>/votes``         how many ranks answered "usable here" (an ``add`` counter)
``g/<ckey>/<n>/veto``          the first "not usable here" answer (``compare_set``, so only one is kept)
``g/<ckey>/<n>/final``         the job's decision, written once with ``compare_set``: every rank that
                               proposes one reads back the single winner and obeys it
``g/<ckey>/<n>/installed/<r>`` the SHA-256 of what rank *r* installed (for cross-rank comparison)
============================== ====================================================================

Only ``check``, ``get`` after a successful ``check``, ``set``, ``add`` and ``compare_set`` are used: none of
them waits for another rank, so no rank can ever wait on a rank that waits on a collective. Values are JSON
(a wrapper text travels zlib-compressed; Inductor wrappers with embedded kernels reach a few hundred kB).
Every store error is raised as :class:`BoardError`; callers turn it into a diagnostic and keep Inductor.
"""

from __future__ import annotations

import base64
import json
import threading
import zlib
from dataclasses import dataclass
from typing import Any

VERSION = "v1"


class BoardError(RuntimeError):
    """The store could not be read or written (its host died, the connection broke, a timeout)."""


@dataclass(frozen=True)
class Final:
    """The job's decision for one graph occurrence, as stored under ``.../final``.

    ``install``: every rank installs the wrapper whose neutral text has SHA-256 ``sha256``; otherwise every
    rank keeps Inductor. ``kind`` is the diagnostic kind ranks record (``dist_installed``,
    ``dist_kept_inductor``, ``dist_recheck_failed``, ``dist_leader_lost``, ``dist_timeout``); ``reason`` says
    why in words; ``by_rank`` is the rank whose proposal won the ``compare_set``.
    """

    install: bool
    kind: str
    reason: str
    by_rank: int
    sha256: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"install": self.install, "kind": self.kind, "reason": self.reason, "by_rank": self.by_rank,
                "sha256": self.sha256}

    @staticmethod
    def from_json(doc: dict[str, Any]) -> Final:
        return Final(bool(doc["install"]), str(doc["kind"]), str(doc["reason"]), int(doc["by_rank"]),
                     doc.get("sha256"))


def encode(value: Any) -> bytes:
    """JSON text, zlib-compressed and base64-armoured when long (marked by a leading ``z:``)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    if len(text) < 4096:
        return text.encode("utf-8")
    return b"z:" + base64.b64encode(zlib.compress(text.encode("utf-8"), 6))


def decode(raw: bytes) -> Any:
    if raw.startswith(b"z:"):
        raw = zlib.decompress(base64.b64decode(raw[2:]))
    return json.loads(raw.decode("utf-8"))


class Board:
    """Non-blocking JSON access to the store for one rank; safe to share between threads (one lock).

    Args:
        store: a ``torch.distributed.Store`` (TCPStore, FileStore, HashStore, PrefixStore) already scoped to
            Tilesmith's prefix.
        rank, world_size: this process's place in the default process group.
    """

    def __init__(self, store: Any, rank: int, world_size: int):
        self.store = store
        self.rank = int(rank)
        self.world_size = int(world_size)
        self._lock = threading.Lock()

    # -- raw ------------------------------------------------------------------------------------
    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            with self._lock:
                return fn(*args)
        except Exception as exc:  # noqa: BLE001 - DistStoreError, RuntimeError, OSError: all mean "unusable"
            raise BoardError(f"the torch.distributed store failed on {what} ({type(exc).__name__}: {exc})") from exc

    def has(self, key: str) -> bool:
        return bool(self._call(f"check {key}", self.store.check, [key]))

    def get(self, key: str) -> Any | None:
        """The decoded value of ``key``, or ``None`` when it is not set (never waits for it)."""
        if not self.has(key):
            return None
        return decode(self._call(f"get {key}", self.store.get, key))

    def set(self, key: str, value: Any) -> None:
        self._call(f"set {key}", self.store.set, key, encode(value))

    def add(self, key: str, amount: int) -> int:
        return int(self._call(f"add {key}", self.store.add, key, int(amount)))

    def set_once(self, key: str, value: Any) -> Any:
        """Store ``value`` under ``key`` unless a value is there already; return the value that is there now."""
        raw = self._call(f"compare_set {key}", self.store.compare_set, key, "", encode(value))
        return decode(raw)

    # -- fingerprints and liveness ---------------------------------------------------------------
    def publish_fingerprint(self, fingerprint: dict[str, Any]) -> None:
        self.set(f"fp/{self.rank}", fingerprint)

    def fingerprint(self, rank: int) -> dict[str, Any] | None:
        return self.get(f"fp/{rank}")

    def beat(self) -> int:
        return self.add(f"alive/{self.rank}", 1)

    def heartbeat_of(self, rank: int) -> int | None:
        """Rank ``rank``'s heartbeat counter; ``None`` before its first beat."""
        key = f"alive/{rank}"
        if not self.has(key):
            return None
        return self.add(key, 0)

    # -- one graph occurrence ------------------------------------------------------------------------
    def decision(self, scope: str) -> dict[str, Any] | None:
        return self.get(f"{scope}/decision")

    def publish_decision(self, scope: str, decision: dict[str, Any]) -> None:
        self.set(f"{scope}/decision", decision)

    def final(self, scope: str) -> Final | None:
        doc = self.get(f"{scope}/final")
        return None if doc is None else Final.from_json(doc)

    def propose_final(self, scope: str, final: Final) -> Final:
        """Write ``final`` unless another rank's final is already there; return the one that holds."""
        return Final.from_json(self.set_once(f"{scope}/final", final.to_json()))

    def vote(self, scope: str, ok: bool, doc: dict[str, Any]) -> None:
        """Record this rank's answer; a "not usable" answer also claims the veto (the first one is kept)."""
        doc = {**doc, "rank": self.rank, "ok": bool(ok)}
        self.set(f"{scope}/vote/{self.rank}", doc)
        if ok:
            self.add(f"{scope}/votes", 1)
        else:
            self.set_once(f"{scope}/veto", doc)

    def votes(self, scope: str) -> int:
        return self.add(f"{scope}/votes", 0)

    def veto(self, scope: str) -> dict[str, Any] | None:
        return self.get(f"{scope}/veto")

    def voted(self, scope: str, rank: int) -> bool:
        return self.has(f"{scope}/vote/{rank}")

    def record_installed(self, scope: str, sha256: str) -> None:
        self.set(f"{scope}/installed/{self.rank}", sha256)

    def installed(self, scope: str, rank: int) -> str | None:
        return self.get(f"{scope}/installed/{rank}")


def closing(scope_votes: int, veto: dict[str, Any] | None, group: tuple[int, ...], rank: int,
            sha256: str | None) -> Final | None:
    """The final an observer proposes from the votes seen so far, or ``None`` while the vote is open.

    ``group``: the ranks that must all answer (the leader counts its own acceptance as an answer).
    A veto closes the vote at once (every rank keeps Inductor); all ``len(group)`` "usable" answers close it
    with an install of ``sha256``.
    """
    if veto is not None:
        who = veto.get("rank", "?")
        return Final(False, "dist_recheck_failed", f"rank {who} cannot use the accepted wrapper: "
                     f"{veto.get('reason', 'no reason given')}", rank)
    if scope_votes >= len(group):
        return Final(True, "dist_installed", f"all {len(group)} ranks re-checked the accepted wrapper", rank,
                     sha256)
    return None
