"""Keep the test suite out of the user's home: the cache folders it must not write, and a before/after check.

tests/conftest.py points every Tilesmith cache (``TILESMITH_CACHE_DIR``, ``XDG_CACHE_HOME``) and Triton's
(``TRITON_CACHE_DIR``) at a temporary folder for the whole session, keeps ``TORCHINDUCTOR_CACHE_DIR`` on the
repository's shared ``.cache/inductor`` (the Makefile's, when it set one), and compares :func:`snapshot` of
:func:`guarded_roots` before and after the session: anything new or changed there fails the session.

The roots are the real home's: ``~/.cache/tilesmith`` and, when the user's own environment names them,
``$XDG_CACHE_HOME/tilesmith`` and ``$TILESMITH_CACHE_DIR`` (both read before conftest replaces them), plus
``~/.triton`` (Triton's default cache when ``TRITON_CACHE_DIR`` is unset). The home comes from the password
database, so a test that sets ``HOME`` does not move it; ``TESTS_REAL_HOME`` replaces it (only for the test of
this guard, tests/test_home_guard.py, which must not write in the real home to see the guard fail).
"""

from __future__ import annotations

import os
import pwd
from pathlib import Path

Snapshot = dict[str, tuple[int, int]]


def real_home() -> Path:
    """The user's home from the password database (``HOME`` may be changed by tests), else ``HOME``."""
    if os.environ.get("TESTS_REAL_HOME"):
        return Path(os.environ["TESTS_REAL_HOME"])
    try:
        return Path(pwd.getpwuid(os.getuid()).pw_dir)
    except (KeyError, OSError):
        return Path(os.environ.get("HOME", "~")).expanduser()


def guarded_roots(environ: dict[str, str], repo: Path, home: Path | None = None) -> list[Path]:
    """Folders outside the repository that the suite must leave as they were (``environ``: the user's)."""
    home = real_home() if home is None else home
    roots = [home / ".cache" / "tilesmith", home / ".triton"]
    if environ.get("XDG_CACHE_HOME"):
        roots.append(Path(environ["XDG_CACHE_HOME"]).expanduser() / "tilesmith")
    if environ.get("TILESMITH_CACHE_DIR"):
        roots.append(Path(environ["TILESMITH_CACHE_DIR"]).expanduser())
    out: list[Path] = []
    for root in roots:
        resolved = root.resolve()
        if resolved not in out and not resolved.is_relative_to(repo.resolve()):
            out.append(resolved)
    return out


def snapshot(roots: list[Path]) -> Snapshot:
    """``{path: (mtime_ns, size)}`` of every file and folder under ``roots`` (missing roots are empty)."""
    found: Snapshot = {}
    for root in roots:
        if not root.exists():
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                path = os.path.join(dirpath, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                found[path] = (st.st_mtime_ns, st.st_size)
        try:
            st = os.lstat(root)
            found[str(root)] = (st.st_mtime_ns, -1)  # the root itself appearing counts too
        except OSError:
            pass
    return found


def changes(before: Snapshot, after: Snapshot) -> list[str]:
    """Paths that are new or whose mtime or size changed (sorted); removals are not writes and are ignored."""
    return sorted(p for p, stat in after.items() if before.get(p) != stat)
