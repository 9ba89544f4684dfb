"""Content-addressed artifact store: ``<root>/artifacts/<key[:2]>/<key>/`` per 64-hex cache key.

Concurrency (several processes compiling the same graph at once): an entry is built complete in a private
``.tmp-<key>-*`` folder beside its final place and published with one ``os.rename`` of the folder.
Renaming a folder onto an existing non-empty folder fails (``ENOTEMPTY``/``EEXIST``), so the first
writer wins, later writers discard their copy, and a reader sees either no entry or a complete one —
never a torn file. Removal (prune, replacing a corrupted entry) renames the entry to ``.trash-*`` before
deleting it, for the same reason. No lock files are used, so a killed process cannot leave a stale lock.
This holds across nodes on a shared POSIX filesystem (NFS, Lustre, GPFS, BeeGFS, CephFS: the server
performs the rename); ``put`` refuses object-store mounts (:mod:`tilesmith.cache.fs`) with a
``cache_unsupported_fs`` diagnostic.

Problems never raise into the caller (a model call): :meth:`ArtifactStore.get` and
:meth:`ArtifactStore.put` return ``None`` and record a :class:`~tilesmith.records.Diagnostic` that
:meth:`ArtifactStore.take_problems` hands over (and that is logged on the ``tilesmith.cache`` logger):

* ``cache_corrupted``: an entry failed its content-hash check; it is ignored (a miss) and the next
  ``put`` for that key replaces it.
* ``cache_unavailable``: the store could not be read or written (read-only or full disk, permissions);
  the run continues without caching.
* ``cache_unsupported_fs``: ``put`` found the store on a filesystem without an atomic, exclusive folder
  rename (an object-store mount); nothing is written there.

* ``cache_quarantined``: the entry's wrapper was quarantined (production verification caught it computing
  wrong results after install, :mod:`tilesmith.install.verify`); it is never served or stored again.

``get(key, strict=True)`` raises :class:`CacheProblem` instead, for tools that want an exception.

Quarantine: :meth:`ArtifactStore.quarantine` moves an entry out of the serving tree to
``<root>/artifacts/.quarantine/<key>/<sha256(wrapper)[:16]>/`` (one ``os.rename``; ``entry/`` holds the moved
files, ``quarantine.json`` the reason) and records the wrapper's SHA-256, so neither ``get`` nor ``put`` accepts
that wrapper for that key again; another wrapper for the same key (a later optimization) is stored normally.
``prune`` never deletes quarantine records.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tilesmith import settings
from tilesmith._atomic import fsync_dir, write_bytes_atomic, write_file_durable, write_json_atomic
from tilesmith.cache.fs import check as check_fs
from tilesmith.cache.artifact import (
    MANIFEST,
    Artifact,
    EntryInvalid,
    artifact_from_entry,
    build_manifest,
    check_key,
    entry_files,
    verify_entry,
)
from tilesmith.errors import TilesmithError
from tilesmith.records import Diagnostic

log = logging.getLogger("tilesmith.cache")

QUARANTINE_DIR = ".quarantine"
"""Folder under ``artifacts/`` that holds quarantined entries (skipped by listing and pruning)."""
QUARANTINE_RECORD = "quarantine.json"

STALE_TEMP_S = 3600.0
"""Age (seconds) after which a leftover ``.tmp-*`` folder (a writer killed mid-put) is removed by prune."""


class CacheProblem(TilesmithError):
    """An artifact-store entry or folder could not be used; ``diagnostic`` says which and the remedy."""

    def __init__(self, diagnostic: Diagnostic):
        super().__init__(diagnostic.message)
        self.diagnostic = diagnostic


@dataclass(frozen=True)
class CacheEntry:
    """One stored artifact as listed by :meth:`ArtifactStore.entries` (``size_bytes``: all its files)."""

    key: str
    path: Path
    size_bytes: int
    created_utc: str
    last_used_s: float
    """POSIX time of the last hit (or of the write), from the manifest's mtime."""
    graph_name: str
    speedup: float | None
    valid: bool | None
    """``None`` unless listed with ``verify=True``."""
    problem: str | None = None

    def age_s(self, now: float | None = None) -> float:
        """Seconds since the last hit or write."""
        return max(0.0, (time.time() if now is None else now) - self.last_used_s)


@dataclass(frozen=True)
class QuarantineEntry:
    """One quarantined wrapper as listed by :meth:`ArtifactStore.quarantined`."""

    key: str
    path: Path
    source_sha256: str
    reason: str
    created_utc: str
    graph_name: str
    run_id: str | None
    moved_entry: bool
    """True when a stored entry with this wrapper was moved here (else only the record and the wrapper)."""


def source_sha256(source: str) -> str:
    """SHA-256 (hex) of a wrapper source as stored (UTF-8): what quarantine records identify a wrapper by."""
    import hashlib

    return hashlib.sha256(source.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class PruneResult:
    removed: tuple[CacheEntry, ...]
    freed_bytes: int
    kept: tuple[CacheEntry, ...]
    leftovers_removed: int
    """Stale ``.tmp-*``, ``.trash-*`` and ``.corrupt-*`` folders removed."""


def _utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _is_key_dirname(name: str) -> bool:
    try:
        check_key(name)
    except ValueError:
        return False
    return True


class ArtifactStore:
    """The artifact store under ``<root>/artifacts``.

    Args:
        root: the cache root (``tilesmith.settings.cache_root()``); ``artifacts/`` is created lazily by
            the first ``put``, so constructing a store never touches the disk.
        enabled: ``False`` turns ``get``/``put`` into no-ops (always a miss, nothing written); ``None``
            reads ``TILESMITH_ARTIFACT_CACHE`` (default on).

    Raises:
        SettingsError: ``enabled is None`` and ``TILESMITH_ARTIFACT_CACHE`` holds an invalid value.
    """

    def __init__(self, root: Path | str, *, enabled: bool | None = None):
        self.root = Path(root).expanduser()
        self.dir = self.root / "artifacts"
        self.enabled = settings.get("TILESMITH_ARTIFACT_CACHE") if enabled is None else bool(enabled)
        self._problems: list[Diagnostic] = []

    # -- problems ---------------------------------------------------------------------------------------
    def take_problems(self) -> tuple[Diagnostic, ...]:
        """Diagnostics recorded since the last call (and clear them)."""
        out, self._problems = tuple(self._problems), []
        return out

    @property
    def problems(self) -> tuple[Diagnostic, ...]:
        """Diagnostics recorded and not yet taken."""
        return tuple(self._problems)

    def _problem(self, kind: str, key: str | None, message: str) -> Diagnostic:
        diag = Diagnostic(kind=kind, message=message, graph_key=key)
        self._problems.append(diag)
        log.warning("%s", message)
        return diag

    # -- paths ------------------------------------------------------------------------------------------
    def path(self, key: str) -> Path:
        """Folder of the entry for ``key`` (which may not exist). Raises ``ValueError`` for a bad key."""
        check_key(key)
        return self.dir / key[:2] / key

    # -- read -------------------------------------------------------------------------------------------
    def get(self, key: str, *, strict: bool = False) -> Artifact | None:
        """The verified artifact for ``key``, or ``None`` on a miss, a corrupted or an unreadable entry.

        A corrupted entry (content-hash mismatch, truncated file or manifest) records a ``cache_corrupted``
        diagnostic; an I/O error records ``cache_unavailable``. A hit refreshes the entry's last-use time
        (best effort) so ``prune(max_age_s=...)`` keeps entries in use.

        Raises:
            ValueError: ``key`` is not 64 lower-case hex characters.
            CacheProblem: only with ``strict=True``, instead of recording a diagnostic.
        """
        entry = self.path(key)
        if not self.enabled:
            return None
        try:
            manifest, contents = verify_entry(entry, key)
            artifact = artifact_from_entry(manifest, contents)
        except FileNotFoundError:
            return None
        except (EntryInvalid, KeyError, TypeError, ValueError, UnicodeDecodeError) as exc:
            msg = (f"artifact cache entry {key[:12]} at {entry} is corrupted ({exc}); it is ignored and the "
                   f"graph is optimized normally. Remedy: none needed, the next accepted candidate replaces "
                   f"it (or run `tilesmith cache prune` to delete corrupted entries).")
            return self._fail(strict, "cache_corrupted", key, msg)
        except OSError as exc:
            msg = (f"artifact cache entry {key[:12]} at {entry} could not be read ({exc}); continuing without "
                   f"the cache. Remedy: make {self.dir} readable or point TILESMITH_CACHE_DIR elsewhere.")
            return self._fail(strict, "cache_unavailable", key, msg)
        if self.is_quarantined(key, artifact.source):
            msg = (f"artifact cache entry {key[:12]} holds a wrapper that was quarantined after it failed "
                   f"production verification; it is not served. Remedy: none needed, the graph is optimized "
                   f"normally (`tilesmith cache` lists quarantined wrappers).")
            return self._fail(strict, "cache_quarantined", key, msg)
        try:
            os.utime(entry / MANIFEST)
        except OSError:
            pass
        return artifact

    def _fail(self, strict: bool, kind: str, key: str, msg: str) -> None:
        diag = Diagnostic(kind=kind, message=msg, graph_key=key)
        if strict:
            raise CacheProblem(diag)
        self._problems.append(diag)
        log.warning("%s", msg)
        return None

    # -- write ------------------------------------------------------------------------------------------
    def put(self, key: str, artifact: Artifact) -> Artifact | None:
        """Store ``artifact`` under ``key`` unless a valid entry is already there (first writer wins).

        Returns the artifact now stored (with ``content_hash``; the existing one when another writer got
        there first), or ``None`` when the store is disabled or could not be written (then a
        ``cache_unavailable`` diagnostic is recorded). Never raises for I/O problems.

        Raises:
            ValueError: ``key`` is not 64 lower-case hex characters.
        """
        entry = self.path(key)
        if not self.enabled:
            return None
        if self.is_quarantined(key, artifact.source):
            self._problem("cache_quarantined", key,
                          f"not storing the wrapper of graph {key[:12]}: this exact wrapper was quarantined after "
                          f"it failed production verification (see `tilesmith cache`).")
            return None
        fs = check_fs(self.root)
        if not fs.supported:
            self._problem(
                "cache_unsupported_fs", key,
                f"the artifact cache at {self.dir} is on a filesystem the store cannot publish entries on safely "
                f"({fs.reason}; mounted at {fs.mount_point or '?'}); the accepted wrapper of graph {key[:12]} is "
                f"installed but not stored. Remedy: set TILESMITH_CACHE_DIR to a local disk or a POSIX shared "
                f"filesystem (NFS, Lustre, GPFS, BeeGFS, CephFS), see docs/cache.md.")
            return None
        if not artifact.created_utc:
            artifact = _replace(artifact, created_utc=_utc_now())
        tmp: Path | None = None
        try:
            existing = self._existing_valid(entry, key)
            if existing is not None:
                return existing
            entry.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=entry.parent))
            files = entry_files(artifact)
            for name, data in files.items():
                target = tmp / name
                target.parent.mkdir(parents=True, exist_ok=True)
                write_file_durable(target, data)
            manifest = build_manifest(key, artifact, files)
            write_json_atomic(tmp / MANIFEST, manifest)
            os.chmod(tmp, 0o755)
            for _ in range(3):
                try:
                    os.rename(tmp, entry)
                    break
                except FileNotFoundError:
                    # NFS: a retransmitted rename the server already performed answers ENOENT; the entry
                    # is then ours (or another writer's) and complete.
                    if not tmp.exists():
                        winner = self._existing_valid(entry, key)
                        if winner is not None:
                            tmp = None
                            return winner
                    raise
                except OSError as exc:
                    if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                        raise
                # Another process published first: keep its valid entry. A corrupted occupant is moved
                # aside by _existing_valid and the rename is tried again.
                winner = self._existing_valid(entry, key)
                if winner is not None:
                    shutil.rmtree(tmp, ignore_errors=True)
                    tmp = None
                    return winner
            else:
                raise OSError(errno.EEXIST, f"{entry} kept being replaced by other writers")
            tmp = None
            fsync_dir(entry.parent)
            return _replace(artifact, content_hash=manifest["content_hash"])
        except OSError as exc:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            self._problem(
                "cache_unavailable", key,
                f"could not store the accepted wrapper of graph {key[:12]} in the artifact cache at {self.dir} "
                f"({exc.strerror or exc}); the installed wrapper is unaffected but will not be reused by "
                f"later runs. Remedy: free disk space, make the folder writable, or set TILESMITH_CACHE_DIR "
                f"to a writable folder.")
            return None

    def _existing_valid(self, entry: Path, key: str) -> Artifact | None:
        """The valid artifact at ``entry``; a corrupted occupant is moved aside (``.corrupt-*``)."""
        try:
            manifest, contents = verify_entry(entry, key)
            return artifact_from_entry(manifest, contents)
        except FileNotFoundError:
            return None
        except (EntryInvalid, KeyError, TypeError, ValueError, UnicodeDecodeError) as exc:
            aside = entry.parent / f".corrupt-{key}-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(entry, aside)
            except FileNotFoundError:
                pass  # another writer moved it first
            log.warning("replacing corrupted artifact cache entry %s (%s); old copy moved to %s",
                        key[:12], exc, aside)
            return None

    def write_cache_json(self, track_dir: Path | str, key: str, artifact: Artifact) -> Path | None:
        """Write ``<track_dir>/cache.json`` naming the reused artifact (docs/layout.md); return its path.

        Fields: ``format``, ``graph_key``, ``artifact_dir``, ``content_hash``, ``origin_run_id``,
        ``created_utc`` (of the artifact), ``reused_utc``, ``proposer``, the stored ``speedup``,
        ``speedup_ci``, ``torch_inductor_ms``, ``tilesmith_ms`` and ``environment``. An I/O error records
        ``cache_unavailable`` and returns ``None``.
        """
        path = Path(track_dir) / "cache.json"
        doc = {
            "format": 1,
            "graph_key": check_key(key),
            "graph_name": artifact.graph_name,
            "artifact_dir": str(self.path(key)),
            "content_hash": artifact.content_hash,
            "origin_run_id": artifact.origin_run_id,
            "created_utc": artifact.created_utc,
            "reused_utc": _utc_now(),
            "proposer": artifact.proposer,
            "speedup": artifact.speedup,
            "speedup_ci": list(artifact.speedup_ci),
            "torch_inductor_ms": artifact.torch_inductor_ms,
            "tilesmith_ms": artifact.tilesmith_ms,
            "environment": artifact.environment,
        }
        try:
            write_json_atomic(path, doc)
        except OSError as exc:
            self._problem("cache_unavailable", key,
                          f"could not write {path} ({exc.strerror or exc}). Remedy: make the run folder "
                          f"writable or set TILESMITH_CACHE_DIR to a writable folder.")
            return None
        return path

    # -- quarantine -------------------------------------------------------------------------------------
    def _quarantine_dir(self, key: str, sha: str) -> Path:
        return self.dir / QUARANTINE_DIR / check_key(key) / sha[:16]

    def is_quarantined(self, key: str, source: str) -> bool:
        """True when wrapper ``source`` was quarantined for ``key`` (``False`` when the store is disabled)."""
        if not self.enabled:
            return False
        try:
            return (self._quarantine_dir(key, source_sha256(source)) / QUARANTINE_RECORD).is_file()
        except OSError:
            return False

    def quarantine(self, key: str, *, source: str, reason: str, graph_name: str = "",
                   run_id: str | None = None) -> Path | None:
        """Take wrapper ``source`` of ``key`` out of service for good; return the quarantine folder.

        A stored entry holding exactly this wrapper is moved (one ``os.rename``, so a concurrent reader sees
        the entry or a miss) to ``<quarantine folder>/entry``; an entry holding another wrapper is left alone.
        ``quarantine.json`` records ``reason``, the time, the graph, the run and the wrapper's SHA-256 (the
        wrapper itself is kept as ``wrapper.py`` for inspection). Idempotent. Returns ``None`` (and records
        ``cache_unavailable``) when the record could not be written, or when the store is disabled.

        Raises:
            ValueError: ``key`` is not 64 lower-case hex characters.
        """
        entry = self.path(key)
        if not self.enabled:
            return None
        sha = source_sha256(source)
        target = self._quarantine_dir(key, sha)
        try:
            target.mkdir(parents=True, exist_ok=True)
            moved = (target / "entry").is_dir()
            if _holds(entry, sha):
                try:
                    if moved:
                        raise FileExistsError(errno.EEXIST, "already quarantined")
                    os.rename(entry, target / "entry")
                    moved = True
                except FileNotFoundError:
                    pass  # removed or moved concurrently
                except OSError as exc:
                    if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                        raise
                    self.remove(key)  # quarantined before (another process): just take it out of service
            if (target / QUARANTINE_RECORD).is_file():
                return target  # quarantined before: the first record (and its reason) stays
            write_bytes_atomic(target / "wrapper.py", source.encode("utf-8"))
            write_json_atomic(target / QUARANTINE_RECORD, {
                "format": 1, "key": key, "source_sha256": sha, "reason": reason, "graph_name": graph_name,
                "run_id": run_id, "created_utc": _utc_now(), "moved_entry": moved})
        except OSError as exc:
            self._problem("cache_unavailable", key,
                          f"could not quarantine the wrapper of graph {key[:12]} in {self.dir} "
                          f"({exc.strerror or exc}); it may be served again from the cache. Remedy: make the "
                          f"folder writable, or delete the entry with `tilesmith cache prune --max-size 0`.")
            return None
        return target

    def quarantined(self) -> list[QuarantineEntry]:
        """Every quarantine record, newest first (unreadable records are listed with reason ``unreadable``)."""
        out: list[QuarantineEntry] = []
        base = self.dir / QUARANTINE_DIR
        if not base.is_dir():
            return out
        for key_dir in sorted(base.iterdir()):
            if not _is_key_dirname(key_dir.name) or not key_dir.is_dir():
                continue
            for item in sorted(key_dir.iterdir()):
                record = item / QUARANTINE_RECORD
                try:
                    doc = json.loads(record.read_text(encoding="utf-8"))
                    if not isinstance(doc, dict):
                        raise ValueError("not a JSON object")
                except FileNotFoundError:
                    continue
                except (OSError, ValueError) as exc:
                    doc = {"reason": f"unreadable: {exc}"}
                out.append(QuarantineEntry(
                    key=key_dir.name, path=item, source_sha256=str(doc.get("source_sha256", "")),
                    reason=str(doc.get("reason", "")), created_utc=str(doc.get("created_utc", "")),
                    graph_name=str(doc.get("graph_name", "")), run_id=doc.get("run_id"),
                    moved_entry=bool(doc.get("moved_entry"))))
        out.sort(key=lambda q: q.created_utc, reverse=True)
        return out

    # -- listing and pruning ----------------------------------------------------------------------------
    def entries(self, *, verify: bool = False) -> list[CacheEntry]:
        """All entries, most recently used first. ``verify=True`` also checks every content hash."""
        out = []
        if not self.dir.is_dir():
            return out
        for shard in sorted(self.dir.iterdir()):
            if not shard.is_dir() or shard.name.startswith("."):
                continue
            for entry in sorted(shard.iterdir()):
                if entry.is_dir() and _is_key_dirname(entry.name):
                    item = self._describe(entry, verify)
                    if item is not None:
                        out.append(item)
        out.sort(key=lambda e: e.last_used_s, reverse=True)
        return out

    def _describe(self, entry: Path, verify: bool) -> CacheEntry | None:
        key = entry.name
        try:
            size = sum(p.stat().st_size for p in entry.rglob("*") if p.is_file())
            manifest_path = entry / MANIFEST
            last_used = manifest_path.stat().st_mtime if manifest_path.exists() else entry.stat().st_mtime
        except FileNotFoundError:
            return None  # removed while listing
        except OSError as exc:
            return CacheEntry(key, entry, 0, "", 0.0, "", None, False, f"unreadable: {exc}")
        manifest: dict[str, Any] = {}
        valid: bool | None = None
        problem = None
        if verify:
            try:
                manifest, _ = verify_entry(entry, key)
                valid = True
            except FileNotFoundError:
                return None
            except (EntryInvalid, OSError, ValueError) as exc:
                valid, problem = False, str(exc)
        else:
            try:
                loaded = json.loads(manifest_path.read_text(encoding="utf-8"))
                manifest = loaded if isinstance(loaded, dict) else {}
            except (OSError, ValueError) as exc:
                problem = f"manifest unreadable: {exc}"
                valid = False
        speedup = manifest.get("speedup")
        return CacheEntry(key=key, path=entry, size_bytes=size, created_utc=str(manifest.get("created_utc", "")),
                          last_used_s=last_used, graph_name=str(manifest.get("graph_name", "")),
                          speedup=speedup if isinstance(speedup, (int, float)) else None, valid=valid,
                          problem=problem)

    def total_bytes(self) -> int:
        """Bytes used by all entries (leftover temporary folders not counted)."""
        return sum(e.size_bytes for e in self.entries())

    def remove(self, key: str) -> bool:
        """Delete the entry for ``key``; ``True`` when one was removed. I/O errors propagate (``OSError``)."""
        entry = self.path(key)
        trash = entry.parent / f".trash-{key}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(entry, trash)
        except FileNotFoundError:
            return False
        shutil.rmtree(trash, ignore_errors=True)
        return True

    def prune(self, max_age_s: float | None = None, max_bytes: int | None = None, *, dry_run: bool = False,
              now: float | None = None) -> PruneResult:
        """Remove corrupted entries, entries unused for more than ``max_age_s`` seconds, then the least
        recently used entries until the total is at most ``max_bytes``; also stale leftovers of killed
        writers. ``dry_run`` reports without deleting.

        Raises:
            ValueError: a negative ``max_age_s`` or ``max_bytes``.
            OSError: an entry could not be deleted (read-only store).
        """
        if max_age_s is not None and max_age_s < 0:
            raise ValueError(f"max_age_s must be >= 0 seconds, got {max_age_s}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        now = time.time() if now is None else now
        entries = self.entries(verify=True)
        doomed: list[CacheEntry] = [e for e in entries if e.valid is False]
        alive = [e for e in entries if e.valid is not False]
        if max_age_s is not None:
            doomed += [e for e in alive if e.age_s(now) > max_age_s]
            alive = [e for e in alive if e.age_s(now) <= max_age_s]
        if max_bytes is not None:
            total = sum(e.size_bytes for e in alive)
            for e in sorted(alive, key=lambda e: e.last_used_s):  # least recently used first
                if total <= max_bytes:
                    break
                doomed.append(e)
                total -= e.size_bytes
            alive = [e for e in alive if e not in doomed]
        leftovers = self._leftovers(now)
        if not dry_run:
            for e in doomed:
                self.remove(e.key)
            for path in leftovers:
                shutil.rmtree(path, ignore_errors=True)
        return PruneResult(removed=tuple(doomed), freed_bytes=sum(e.size_bytes for e in doomed),
                           kept=tuple(alive), leftovers_removed=len(leftovers))

    def _leftovers(self, now: float) -> list[Path]:
        out = []
        if not self.dir.is_dir():
            return out
        for shard in self.dir.iterdir():
            if not shard.is_dir():
                continue
            for item in shard.iterdir():
                name = item.name
                if name.startswith((".trash-", ".corrupt-")):
                    out.append(item)
                elif name.startswith(".tmp-"):
                    try:
                        if now - item.stat().st_mtime > STALE_TEMP_S:
                            out.append(item)
                    except FileNotFoundError:
                        pass
        return out


def _holds(entry: Path, sha: str) -> bool:
    """True when the entry folder's ``wrapper.py`` has SHA-256 ``sha``."""
    import hashlib

    try:
        return hashlib.sha256((entry / "wrapper.py").read_bytes()).hexdigest() == sha
    except FileNotFoundError:
        return False


def _replace(artifact: Artifact, **changes: Any) -> Artifact:
    import dataclasses

    return dataclasses.replace(artifact, **changes)
