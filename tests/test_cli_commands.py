"""``tilesmith runs``, ``show`` and ``cache`` on a realistic run folder (see test_cli_runfolder.py)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cli_runfolder import RUN_NEW, RUN_OLD, build_root

from tilesmith.cli.main import main


@pytest.fixture
def root(tmp_path):
    ids = build_root(tmp_path)
    return tmp_path, ids


def run_cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(list(argv), out=out)
    return code, out.getvalue()


def test_runs_lists_newest_first_with_counts_and_best_speedup(root):
    path, _ = root
    code, text = run_cli("--root", str(path), "runs")
    assert code == 0
    lines = text.splitlines()
    assert lines[0].split() == ["RUN", "ID", "CREATED", "(UTC)", "MODEL", "GRAPHS", "INSTALLED", "BEST"]
    new, old = lines[1].split(), lines[2].split()
    assert new[0] == RUN_NEW and old[0] == RUN_OLD
    assert new[2:] == ["tilesmith/builtin", "3", "(+1", "ineligible)", "2", "1.78x"]
    assert old[2:] == ["gpt-5.5", "1", "1", "1.78x"]


def test_runs_json_and_limit(root):
    path, _ = root
    code, text = run_cli("--root", str(path), "runs", "--json", "--limit", "1")
    (only,) = json.loads(text)
    assert code == 0 and only["run_id"] == RUN_NEW and only["graphs"] == 3 and only["installed"] == 2
    assert only["best_speedup"] == pytest.approx(1.78, abs=0.05)


def test_root_after_the_command_is_accepted_and_a_root_before_it_is_kept(root, tmp_path_factory):
    """``tilesmith runs --root DIR`` (a new user's order) was an argparse error: "unrecognized arguments"."""
    path, _ = root
    _, expected = run_cli("--root", str(path), "runs")
    assert run_cli("runs", "--root", str(path)) == (0, expected)
    code, text = run_cli("--root", str(path), "show", "latest")
    assert run_cli("show", "latest", "--root", str(path)) == (code, text) and code == 0
    assert run_cli("cache", "prune", "--root", str(path), "--dry-run")[0] == 0
    listed = run_cli("--root", str(path), "cache")
    assert run_cli("cache", "list", "--root", str(path)) == listed == run_cli("cache", "--root", str(path))
    other = tmp_path_factory.mktemp("empty")
    assert run_cli("--root", str(path), "runs", "--root", str(other))[1] == run_cli("--root", str(other), "runs")[1]


def test_show_says_a_track_left_optimizing_by_a_process_that_ended_was_never_decided(root):
    """A process killed (or Ctrl-C'd at exit) mid-optimization left ``status: optimizing``, and `show` printed
    just "optimizing" as if it were still running. run.json now records the pid and host."""
    import socket

    path, ids = root
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run_json = path / "runs" / RUN_NEW / "run.json"
    doc = json.loads(run_json.read_text())
    track_json = path / "runs" / RUN_NEW / ids["installed"] / "track.json"
    track = json.loads(track_json.read_text())
    track["status"], track["benchmark"] = "optimizing", None
    track_json.write_text(json.dumps(track))
    for pid, ended in ((dead.pid, True), (os.getpid(), False)):
        run_json.write_text(json.dumps({**doc, "pid": pid, "host": socket.gethostname()}))
        code, text = run_cli("--root", str(path), "show", RUN_NEW)
        line = next(line for line in text.splitlines() if line.startswith(f"graph {ids['installed'][:8]}"))
        assert code == 0
        if ended:
            assert line.endswith(f"inference  optimizing, never decided: its process {dead.pid} on "
                                 f"{socket.gethostname()} has ended (killed or interrupted)"), line
        else:
            assert line.endswith("inference  optimizing"), line


def test_runs_on_an_empty_root_says_where_it_looked(tmp_path):
    code, text = run_cli("--root", str(tmp_path), "runs")
    assert code == 0 and str(tmp_path / "runs") in text and "TILESMITH_CACHE_DIR" in text


def test_show_run_lists_every_track_with_verdicts_reasons_and_diagnostics(root):
    path, ids = root
    code, text = run_cli("--root", str(path), "show", RUN_NEW)
    assert code == 0
    assert f"graph {ids['installed'][:8]} (0_inference)  inference  installed" in text
    assert f"graph {ids['kept'][:8]} (1_forward)  forward  kept_inductor" in text
    assert f"graph {ids['cached'][:8]} (2_inference)  inference  cache_hit" in text
    assert "loops accepted 2/2  turns 4  evaluations 4" in text
    assert "rejected_incorrect" in text and "value mismatch at [12, 4081]" in text
    assert "worker died with SIGSEGV" in text
    header, _, tracks = text.partition("\ngraph ")
    assert "[dynamic_shape] (3_inference)" in header  # ineligible: no track, so listed with the run
    assert "[no_improvement] (1_forward)" in tracks and "no_improvement" not in header  # listed with its track
    assert "(2.4x the floor)" in text
    assert "artifact-cache hit:" in text and RUN_OLD in text
    assert "no wrapper installed" in text  # the kept graph


def test_show_track_by_key_prefix_gives_full_detail(root):
    path, ids = root
    code, text = run_cli("--root", str(path), "show", ids["kept"][:10])
    assert code == 0
    assert f"key {ids['kept']}" in text and "0_inference" not in text
    assert f"e0001: report {path / 'runs' / RUN_NEW / ids['kept'] / 'profiles' / 'e0001.json'}" in text
    # the same graph key exists in two runs: <run>/<prefix> picks the older one explicitly
    code, text = run_cli("--root", str(path), "show", f"{RUN_OLD}/{ids['cached'][:8]}")
    assert code == 0 and f"run {RUN_OLD}" in text and "llm:main" in text


def test_show_accepts_latest_prefixes_and_folders(root):
    path, ids = root
    for target in ("latest", RUN_NEW[:12], str(path / "runs" / RUN_NEW)):
        code, text = run_cli("--root", str(path), "show", target)
        assert code == 0 and text.startswith(f"run {RUN_NEW}"), target
    code, text = run_cli("--root", str(path), "show", str(path / "runs" / RUN_NEW / ids["installed"]))
    assert code == 0 and f"key {ids['installed']}" in text


def test_show_unknown_or_ambiguous_target_exits_2_with_help(root):
    path, _ = root
    code, text = run_cli("--root", str(path), "show", "nonexistent")
    assert code == 2 and "no run or graph matches 'nonexistent'" in text and "tilesmith runs" in text
    code, text = run_cli("--root", str(path), "show", "2026")
    assert code == 2 and "matches 2 runs" in text
    code, text = run_cli("--root", str(path), "show", f"{RUN_NEW}/ffffff")
    assert code == 2 and "0_inference" in text  # lists the run's tracks


def test_show_json_carries_track_documents(root):
    path, ids = root
    code, text = run_cli("--root", str(path), "show", RUN_NEW, "--json")
    doc = json.loads(text)
    assert code == 0 and doc["run"]["run_id"] == RUN_NEW
    statuses = {t["graph_key"]: t["status"] for t in doc["tracks"]}
    assert statuses == {ids["installed"]: "installed", ids["kept"]: "kept_inductor", ids["cached"]: "cache_hit"}
    cached = next(t for t in doc["tracks"] if t["graph_key"] == ids["cached"])
    assert cached["cache"]["origin_run_id"] == RUN_OLD


def test_show_survives_a_damaged_track(root):
    path, ids = root
    (path / "runs" / RUN_NEW / ids["kept"] / "track.json").write_text('{"format": 1, "status": "opti')
    code, text = run_cli("--root", str(path), "show", RUN_NEW)
    assert code == 0 and "problem: track.json unreadable" in text
    assert f"graph {ids['installed'][:8]} (0_inference)  inference  installed" in text  # others still show


def test_cache_list_and_verify_flags_corruption(root):
    path, ids = root
    code, text = run_cli("--root", str(path), "cache")
    assert code == 0 and ids["cached"][:16] in text and "2_inference" in text and "1 entries" in text
    wrapper = path / "artifacts" / ids["cached"][:2] / ids["cached"] / "wrapper.py"
    wrapper.write_text(wrapper.read_text()[:100])
    code, text = run_cli("--root", str(path), "cache", "list", "--verify")
    assert code == 0 and "CORRUPTED" in text and "tilesmith cache prune" in text
    code, text = run_cli("--root", str(path), "cache", "--json", "--verify")
    (entry,) = json.loads(text)
    assert entry["valid"] is False and "does not match its hash" in entry["problem"]


def test_cache_prune_by_age_and_size_with_dry_run(root):
    from tilesmith.cache import Artifact, ArtifactStore

    path, ids = root
    store = ArtifactStore(path, enabled=True)
    fresh_key = "ee" + "1" * 62
    store.put(fresh_key, Artifact(source="def call(args):\n    pass\n", speedup=1.1, speedup_ci=(1.05, 1.15),
                                  torch_inductor_ms=1.0, tilesmith_ms=0.9))
    old = time.time() - 40 * 86400
    os.utime(store.path(ids["cached"]) / "artifact.json", (old, old))
    code, text = run_cli("--root", str(path), "cache", "prune", "--max-age", "30d", "--dry-run")
    assert code == 0 and f"would remove {ids['cached'][:16]}" in text and store.path(ids["cached"]).exists()
    # each entry says which limit removes it (was "unused or over the size limit" for both)
    assert "(unused for 40.0d, over --max-age 30d)" in text, text
    code, text = run_cli("--root", str(path), "cache", "prune", "--max-size", "0", "--dry-run")
    assert text.count("(least recently used, over --max-size 0)") == 2, text
    code, text = run_cli("--root", str(path), "cache", "prune", "--max-age", "30d")
    assert code == 0 and "removed 1 entries" in text
    assert not store.path(ids["cached"]).exists() and store.path(fresh_key).exists()
    code, text = run_cli("--root", str(path), "cache", "prune", "--max-size", "0")
    assert code == 0 and "removed 1 entries" in text and store.entries() == []


@pytest.mark.parametrize("flag, value", [("--max-age", "7 days"), ("--max-size", "2 potatoes")])
def test_cache_prune_rejects_bad_limits(root, flag, value):
    path, _ = root
    code, text = run_cli("--root", str(path), "cache", "prune", flag, value)
    assert code == 2 and "invalid" in text and "e.g." in text


def test_console_entry_point_runs_as_a_module(root):
    path, _ = root
    env = {**os.environ, "TILESMITH_CACHE_DIR": str(path)}
    proc = subprocess.run([sys.executable, "-m", "tilesmith.cli", "runs"], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert RUN_NEW in proc.stdout  # TILESMITH_CACHE_DIR is honoured without --root
    proc = subprocess.run([sys.executable, "-m", "tilesmith.cli", "frobnicate"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
    # `python -m tilesmith` too (was "No module named tilesmith.__main__")
    proc = subprocess.run([sys.executable, "-m", "tilesmith", "runs"], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert proc.returncode == 0 and RUN_NEW in proc.stdout, proc.stderr
