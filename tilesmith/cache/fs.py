"""Can the artifact store live on this filesystem? One check per store root and process.

The store takes no locks (docs/cache.md): it relies on one property only, that ``rename(2)`` of a folder onto an
existing non-empty folder fails atomically (``ENOTEMPTY``/``EEXIST``), so that the first writer of a key wins.
Local POSIX filesystems have it, and so do the shared ones clusters use for a common cache across nodes: NFSv3/v4
(the server performs the rename), Lustre, GPFS/Spectrum Scale, BeeGFS, CephFS, WekaFS. Object-store mounts do
not: s3fs, gcsfuse, goofys, rclone, Mountpoint for S3, blobfuse emulate a folder rename by copying objects one by
one (or not at all), so two nodes could interleave their entries. :func:`check` refuses those by name (read
from ``/proc/self/mountinfo``) and, everywhere else, tries the property itself once in the store's folder.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

UNSUPPORTED_TYPES = ("fuse.s3fs", "fuse.gcsfuse", "fuse.goofys", "fuse.rclone", "fuse.mountpoint-s3",
                     "fuse.blobfuse", "fuse.blobfuse2", "fuse.s3backer", "fuse.geesefs", "fuse.yas3fs")
"""Filesystem types (``mountinfo``'s type field) without an atomic, exclusive folder rename."""

_LOCK = threading.Lock()
_SEEN: dict[str, FsCheck] = {}


@dataclass(frozen=True)
class FsCheck:
    """Outcome of :func:`check`: ``supported`` False means the store must not be written there."""

    supported: bool
    fs_type: str
    mount_point: str
    reason: str = ""


def mount_of(path: Path, mountinfo: str | None = None) -> tuple[str, str]:
    """``(filesystem type, mount point)`` of the mount holding ``path`` (longest mount-point prefix);
    ``("unknown", "")`` where ``/proc/self/mountinfo`` cannot be read (not Linux)."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "unknown", ""
    target = os.path.realpath(path)
    best = ("unknown", "")
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or not tail:
            continue
        point = fields[4].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[1]):
            best = (tail[0], point)
    return best


def check(root: Path) -> FsCheck:
    """Whether ``root`` (created if missing) supports the store's rename-based publication; memoized.

    Never raises: a folder that cannot be created or written is reported as supported here (the store's own
    writes then fail with its ``cache_unavailable`` diagnostic, which names permissions and disk space).
    """
    key = os.path.realpath(root)
    with _LOCK:
        if key in _SEEN:
            return _SEEN[key]
    fs_type, point = mount_of(Path(root))
    if fs_type in UNSUPPORTED_TYPES:
        result = FsCheck(False, fs_type, point, f"{fs_type} (an object-store mount) has no atomic folder rename")
    else:
        result = FsCheck(True, fs_type, point)
        problem = _probe(Path(root))
        if problem:
            result = FsCheck(False, fs_type, point, problem)
    with _LOCK:
        _SEEN[key] = result
    return result


def _probe(root: Path) -> str:
    """Rename a folder onto a non-empty folder in ``root``: it must fail. Returns a problem, or ``""``."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        base = Path(tempfile.mkdtemp(prefix=".fscheck-", dir=root))
    except OSError:
        return ""
    try:
        src, dst = base / "a", base / "b"
        src.mkdir()
        (src / "x").write_bytes(b"a")
        dst.mkdir()
        (dst / "x").write_bytes(b"b")
        try:
            os.rename(src, dst)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return ""
            return (f"renaming a folder failed with {errno.errorcode.get(exc.errno or 0, exc.errno)} ({exc.strerror}); "
                    "the store publishes every entry by renaming its folder")
        return ("renaming a folder onto a non-empty folder replaced it instead of failing, so two writers of one "
                "key could mix their files")
    except OSError:
        return ""
    finally:
        shutil.rmtree(base, ignore_errors=True)
