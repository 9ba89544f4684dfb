"""The session guard of tests/conftest.py: a pytest session that writes under the (real) home's Tilesmith cache
fails, one that writes elsewhere passes, and the session's cache variables point outside the home."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import home_guard

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def test_session_caches_point_outside_the_real_home(_caches_outside_home):
    home = home_guard.real_home().resolve()
    for name in ("TILESMITH_CACHE_DIR", "XDG_CACHE_HOME"):
        assert Path(os.environ[name]).resolve().is_relative_to(_caches_outside_home.resolve()), name
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        path = Path(os.environ[name]).resolve()
        assert path.is_relative_to(REPO.resolve()) or not path.is_relative_to(home), name


def test_snapshot_sees_new_and_changed_files_but_not_removals(tmp_path):
    root = tmp_path / ".cache" / "tilesmith"
    (root / "runs").mkdir(parents=True)
    (root / "runs" / "old.json").write_text("{}")
    (root / "gone.txt").write_text("x")
    before = home_guard.snapshot([root])
    (root / "gone.txt").unlink()
    assert home_guard.changes(before, home_guard.snapshot([root])) == [str(root)]  # the folder changed
    before = home_guard.snapshot([root])
    (root / "runs" / "new").mkdir()
    (root / "runs" / "old.json").write_text('{"more": 1}')
    assert home_guard.changes(before, home_guard.snapshot([root])) == [
        str(root / "runs"), str(root / "runs" / "new"), str(root / "runs" / "old.json")]
    assert home_guard.changes(home_guard.snapshot([tmp_path / "absent"]), home_guard.snapshot([root]))


def test_guarded_roots_are_the_homes_caches_and_the_users_own_roots_outside_the_repo(tmp_path):
    home = tmp_path / "home"
    roots = home_guard.guarded_roots({"XDG_CACHE_HOME": str(tmp_path / "xdg"),
                                      "TILESMITH_CACHE_DIR": str(REPO / ".cache" / "ts")}, REPO, home)
    assert roots == [(home / ".cache" / "tilesmith").resolve(), (home / ".triton").resolve(),
                     (tmp_path / "xdg" / "tilesmith").resolve()]


def _session(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    """A pytest session with this suite's conftest and one test ``body``, the real home replaced by a folder."""
    suite = tmp_path / "repo" / "tests"  # conftest takes its parent for the repository, which is not guarded
    suite.mkdir(parents=True)
    shutil.copy(TESTS / "conftest.py", suite / "conftest.py")
    shutil.copy(TESTS / "home_guard.py", suite / "home_guard.py")
    (suite / "test_probe.py").write_text(body)
    home = tmp_path / "home"
    (home / ".cache" / "tilesmith" / "runs").mkdir(parents=True)
    env = {**os.environ, "TESTS_REAL_HOME": str(home)}
    env.pop("TILESMITH_CACHE_DIR", None)
    env.pop("XDG_CACHE_HOME", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite)],
                          cwd=suite, env=env, capture_output=True, text=True, timeout=120)


def test_a_session_that_writes_into_the_homes_tilesmith_cache_fails(tmp_path):
    body = ("import os\nfrom pathlib import Path\n\n"
            "def test_writes_a_run():\n"
            "    (Path(os.environ['TESTS_REAL_HOME']) / '.cache' / 'tilesmith' / 'runs' / 'r1').mkdir()\n")
    proc = _session(tmp_path, body)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout and "the test session wrote under the user's home" in proc.stdout
    assert str(tmp_path / "home" / ".cache" / "tilesmith" / "runs" / "r1") in proc.stdout


def test_a_session_that_uses_the_session_cache_root_passes(tmp_path):
    body = ("import os\nfrom pathlib import Path\n\n"
            "def test_writes_a_run():\n"
            "    (Path(os.environ['TILESMITH_CACHE_DIR']) / 'runs' / 'r1').mkdir(parents=True)\n")
    proc = _session(tmp_path, body)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "wrote under the user's home" not in proc.stdout
