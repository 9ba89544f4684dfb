"""Crash-safe file writes, the one helper every stage uses: a temporary file in the target's own folder, then
``os.replace``.

``os.replace`` is atomic on POSIX when source and target are on one file system, which is why the
temporary file is created next to the target and never in ``/tmp``. A reader therefore sees either the
old complete file or the new complete file, never a torn one. The data is ``fsync``-ed before the rename
so that a power loss cannot leave a renamed but empty file (ext4 ``auto_da_alloc`` is not relied on).

Errors: ``OSError`` (read-only file system, ``ENOSPC``, permission) propagates to the caller, after the
temporary file has been removed.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_bytes_atomic(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` atomically (temp file in the same folder, fsync, ``os.replace``).

    Raises:
        OSError: the folder is not writable or the disk is full; ``path`` is then unchanged.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def write_text_atomic(path: Path, text: str) -> None:
    """UTF-8 variant of :func:`write_bytes_atomic`."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: Path, value: Any, *, indent: int | None = 2, sort_keys: bool = True,
                      default: Any = None) -> None:
    """Write ``value`` as JSON (indented and key-sorted unless told otherwise, plus a final newline) atomically;
    ``default`` is :func:`json.dumps`'s (``str`` turns paths and enums into text)."""
    write_text_atomic(path, json.dumps(value, indent=indent, sort_keys=sort_keys, default=default) + "\n")


def write_file_durable(path: Path, data: bytes) -> None:
    """Write a NEW file (in a private folder no reader looks at yet) and fsync it."""
    with open(path, "xb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def fsync_dir(path: Path) -> None:
    """fsync a folder so a rename inside it is durable; silently skipped where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
