"""Artifact store: round trip, corruption detection, degraded disks, cache.json, listing and pruning."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import time
from pathlib import Path

import pytest

from tilesmith.cache import Artifact, ArtifactStore, CacheProblem
from tilesmith.cache import store as store_mod

KEY = "ab" + "3" * 62
KEY2 = "cd" + "4" * 62
FIXTURE_WRAPPER = Path(__file__).parent / "fixtures" / "inductor-h200" / "softmax_bias_bf16_infer__06.wrapper.py"


def make_artifact(**changes) -> Artifact:
    base = dict(
        source=FIXTURE_WRAPPER.read_text(),
        speedup=1.42,
        speedup_ci=(1.38, 1.47),
        torch_inductor_ms=0.210,
        tilesmith_ms=0.148,
        environment={"torch": "2.11.0+cu130", "triton": "3.6.0", "cuda": "13.0", "device_name": "NVIDIA H200"},
        graph_name="0_inference",
        reports=(("e0002.json", json.dumps({"status": "accepted"})), ("e0002.txt", "accepted\n")),
        proposer="builtin:launch_config",
        origin_run_id="20261130T061500Z-1a2b3c4d",
        files=(("kernels/fused.so", b"\x7fELF" + bytes(range(256))),),
    )
    base.update(changes)
    return Artifact(**base)


def test_round_trip_returns_equal_artifact_with_content_hash(tmp_path):
    store = ArtifactStore(tmp_path, enabled=True)
    art = make_artifact()
    stored = store.put(KEY, art)
    assert stored.created_utc  # filled at put
    assert stored == dataclasses.replace(art, created_utc=stored.created_utc)
    assert len(stored.content_hash) == 64
    loaded = ArtifactStore(tmp_path, enabled=True).get(KEY)
    assert loaded == stored
    assert loaded.content_hash == stored.content_hash
    assert loaded.files == art.files and loaded.reports == art.reports
    entry = tmp_path / "artifacts" / KEY[:2] / KEY
    assert (entry / "wrapper.py").read_text() == art.source
    assert store.take_problems() == ()


def test_miss_returns_none_without_problem(tmp_path):
    store = ArtifactStore(tmp_path, enabled=True)
    assert store.get(KEY) is None
    assert store.problems == ()


def test_second_put_keeps_first_entry(tmp_path):
    store = ArtifactStore(tmp_path, enabled=True)
    first = store.put(KEY, make_artifact(note="first"))
    second = store.put(KEY, make_artifact(note="second"))
    assert second.note == "first" and second.content_hash == first.content_hash
    assert store.get(KEY).note == "first"


@pytest.mark.parametrize("damage", ["truncate_wrapper", "edit_wrapper", "truncate_manifest", "edit_manifest_speedup",
                                    "delete_report", "delete_manifest"])
def test_corrupted_entry_is_ignored_with_diagnostic(tmp_path, damage, caplog):
    store = ArtifactStore(tmp_path, enabled=True)
    store.put(KEY, make_artifact())
    entry = store.path(KEY)
    if damage == "truncate_wrapper":
        data = (entry / "wrapper.py").read_bytes()
        (entry / "wrapper.py").write_bytes(data[: len(data) // 2])
    elif damage == "edit_wrapper":
        text = (entry / "wrapper.py").read_text()
        (entry / "wrapper.py").write_text(text.replace("def call(", "def cal1("))
    elif damage == "truncate_manifest":
        data = (entry / "artifact.json").read_bytes()
        (entry / "artifact.json").write_bytes(data[:100])
    elif damage == "edit_manifest_speedup":
        doc = json.loads((entry / "artifact.json").read_text())
        doc["speedup"] = 9.0
        (entry / "artifact.json").write_text(json.dumps(doc))
    elif damage == "delete_report":
        (entry / "reports" / "e0002.json").unlink()
    elif damage == "delete_manifest":
        (entry / "artifact.json").unlink()
    with caplog.at_level(logging.WARNING, logger="tilesmith.cache"):
        assert store.get(KEY) is None
    (problem,) = store.take_problems()
    assert problem.kind == "cache_corrupted"
    assert problem.graph_key == KEY and KEY[:12] in problem.message and "Remedy" in problem.message
    assert any("corrupted" in r.getMessage() for r in caplog.records)
    with pytest.raises(CacheProblem) as info:
        store.get(KEY, strict=True)
    assert info.value.diagnostic.kind == "cache_corrupted"


def test_put_replaces_corrupted_entry(tmp_path):
    store = ArtifactStore(tmp_path, enabled=True)
    store.put(KEY, make_artifact(note="old"))
    (store.path(KEY) / "wrapper.py").write_text("garbage")
    fresh = store.put(KEY, make_artifact(note="new"))
    assert fresh is not None and fresh.note == "new"
    assert store.get(KEY).note == "new"
    assert store.take_problems() == ()
    # the corrupted copy was moved aside, and prune deletes it
    assert any(p.name.startswith(".corrupt-") for p in store.path(KEY).parent.iterdir())
    result = store.prune()
    assert result.leftovers_removed == 1 and result.removed == ()
    assert [p.name for p in store.path(KEY).parent.iterdir()] == [KEY]


def test_disk_full_degrades_to_no_caching(tmp_path, monkeypatch):
    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_mod, "write_file_durable", full)
    store = ArtifactStore(tmp_path, enabled=True)
    assert store.put(KEY, make_artifact()) is None
    (problem,) = store.take_problems()
    assert problem.kind == "cache_unavailable" and "No space left" in problem.message
    assert "TILESMITH_CACHE_DIR" in problem.message
    assert store.get(KEY) is None
    # no temporary folder is left behind
    assert [p for p in (tmp_path / "artifacts").rglob("*")] == [tmp_path / "artifacts" / KEY[:2]]


def test_unwritable_root_degrades_to_no_caching(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache root should be")
    store = ArtifactStore(blocker / "cache", enabled=True)
    assert store.get(KEY) is None
    assert store.put(KEY, make_artifact()) is None
    assert [p.kind for p in store.take_problems()] == ["cache_unavailable"]
    assert store.write_cache_json(blocker / "track", KEY, make_artifact()) is None
    assert [p.kind for p in store.take_problems()] == ["cache_unavailable"]
    assert store.entries() == []


def test_disabled_store_neither_reads_nor_writes(tmp_path, monkeypatch):
    ArtifactStore(tmp_path, enabled=True).put(KEY, make_artifact())
    monkeypatch.setenv("TILESMITH_ARTIFACT_CACHE", "0")
    off = ArtifactStore(tmp_path)
    assert off.enabled is False
    assert off.get(KEY) is None and off.put(KEY2, make_artifact()) is None
    assert not off.path(KEY2).exists()
    monkeypatch.setenv("TILESMITH_ARTIFACT_CACHE", "maybe")
    with pytest.raises(ValueError, match="TILESMITH_ARTIFACT_CACHE"):
        ArtifactStore(tmp_path)


@pytest.mark.parametrize("bad", ["AB" + "3" * 62, "ab" * 16, "../" + "a" * 61, "g" * 64])
def test_bad_key_is_rejected(tmp_path, bad):
    with pytest.raises(ValueError, match="64 lower-case hex"):
        ArtifactStore(tmp_path, enabled=True).get(bad)


@pytest.mark.parametrize("changes, match", [
    (dict(speedup=0.0), "speedup"),
    (dict(tilesmith_ms=float("nan")), "tilesmith_ms"),
    (dict(speedup_ci=(1.5, 1.2)), "speedup_ci"),
    (dict(reports=(("../evil.json", "{}"),)), "report name"),
    (dict(files=(("/abs.so", b""),)), "file name"),
])
def test_invalid_artifact_fields_are_rejected(changes, match):
    with pytest.raises(ValueError, match=match):
        make_artifact(**changes)


def test_write_cache_json_names_the_artifact(tmp_path):
    store = ArtifactStore(tmp_path, enabled=True)
    stored = store.put(KEY, make_artifact())
    track = tmp_path / "runs" / "r1" / KEY
    track.mkdir(parents=True)
    path = store.write_cache_json(track, KEY, store.get(KEY))
    doc = json.loads(path.read_text())
    assert path == track / "cache.json"
    assert doc["graph_key"] == KEY and doc["content_hash"] == stored.content_hash
    assert Path(doc["artifact_dir"]) == store.path(KEY)
    assert doc["origin_run_id"] == "20261130T061500Z-1a2b3c4d" and doc["speedup"] == 1.42
    assert not [p for p in track.iterdir() if p.name != "cache.json"]  # no temp file left


def _age(store: ArtifactStore, key: str, seconds: float) -> None:
    manifest = store.path(key) / "artifact.json"
    t = time.time() - seconds
    os.utime(manifest, (t, t))


def test_entries_lists_sizes_and_most_recent_first(tmp_path):
    store = ArtifactStore(tmp_path, enabled=True)
    store.put(KEY, make_artifact())
    store.put(KEY2, make_artifact(source="def call(args):\n    return ()\n", files=()))
    _age(store, KEY, 3600)
    entries = store.entries(verify=True)
    assert [e.key for e in entries] == [KEY2, KEY]
    on_disk = sum(p.stat().st_size for p in store.path(KEY).rglob("*") if p.is_file())
    assert entries[1].size_bytes == on_disk
    assert entries[0].size_bytes < entries[1].size_bytes
    assert all(e.valid for e in entries) and entries[1].age_s() >= 3600
    assert store.total_bytes() == sum(e.size_bytes for e in entries)


def test_get_refreshes_last_use_so_prune_by_age_keeps_used_entries(tmp_path):
    store = ArtifactStore(tmp_path, enabled=True)
    store.put(KEY, make_artifact())
    store.put(KEY2, make_artifact())
    _age(store, KEY, 10 * 86400)
    _age(store, KEY2, 10 * 86400)
    assert store.get(KEY2) is not None  # a hit: KEY2 is in use again
    result = store.prune(max_age_s=7 * 86400)
    assert [e.key for e in result.removed] == [KEY]
    assert [e.key for e in result.kept] == [KEY2]
    assert not store.path(KEY).exists() and store.get(KEY2) is not None


def test_prune_by_size_removes_least_recently_used_first(tmp_path):
    store = ArtifactStore(tmp_path, enabled=True)
    keys = [f"{i:02x}" + "5" * 62 for i in range(4)]
    for i, key in enumerate(keys):
        store.put(key, make_artifact())
        _age(store, key, 1000 * (4 - i))  # keys[0] oldest
    size = store.entries()[0].size_bytes
    dry = store.prune(max_bytes=2 * size, dry_run=True)
    assert [e.key for e in dry.removed] == keys[:2]
    assert all(store.path(k).exists() for k in keys)
    result = store.prune(max_bytes=2 * size)
    assert [e.key for e in result.removed] == keys[:2] and result.freed_bytes == 2 * size
    assert sorted(e.key for e in store.entries()) == keys[2:]
    assert store.total_bytes() <= 2 * size


def test_prune_removes_corrupted_entries_and_stale_temp_folders(tmp_path):
    store = ArtifactStore(tmp_path, enabled=True)
    store.put(KEY, make_artifact())
    store.put(KEY2, make_artifact())
    (store.path(KEY2) / "wrapper.py").write_text("")
    stale = store.path(KEY).parent / f".tmp-{KEY}-dead"
    fresh = store.path(KEY).parent / f".tmp-{KEY}-live"
    stale.mkdir()
    fresh.mkdir()
    old = time.time() - 2 * store_mod.STALE_TEMP_S
    os.utime(stale, (old, old))
    result = store.prune()
    assert [e.key for e in result.removed] == [KEY2] and result.leftovers_removed == 1
    assert not stale.exists() and fresh.exists()  # a writer may still be filling the fresh one
    assert store.get(KEY) is not None


def test_prune_rejects_negative_limits(tmp_path):
    with pytest.raises(ValueError, match="max_age_s"):
        ArtifactStore(tmp_path, enabled=True).prune(max_age_s=-1)
    with pytest.raises(ValueError, match="max_bytes"):
        ArtifactStore(tmp_path, enabled=True).prune(max_bytes=-1)


def test_reports_given_as_bare_json_texts_are_named_by_evaluation_id(tmp_path):
    texts = (json.dumps({"evaluation_id": "e0001"}), json.dumps({"status": "x"}), "not json")
    art = make_artifact(reports=texts)
    assert [n for n, _ in art.reports] == ["e0001.json", "report_01.json", "report_02.txt"]
    store = ArtifactStore(tmp_path, enabled=True)
    store.put(KEY, art)
    assert store.get(KEY).reports == art.reports
    assert (store.path(KEY) / "reports" / "e0001.json").read_text() == texts[0]


def test_reports_from_track_reads_json_and_text_profiles(tmp_path):
    from tilesmith.cache import reports_from_track

    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "e0003.json").write_text('{"a": 1}')
    (tmp_path / "profiles" / "e0003.txt").write_text("accepted")
    (tmp_path / "profiles" / "e0004.json").write_text('{"b": 2}')
    assert reports_from_track(tmp_path, ["e0003", "e9999"]) == (("e0003.json", '{"a": 1}'), ("e0003.txt", "accepted"))


def test_environment_values_are_made_json_safe_and_bad_floor_dropped(tmp_path):
    class Version:
        def __str__(self):
            return "2.11.0"

    art = make_artifact(environment={"torch": Version(), "count": 1}, roofline_floor_ms=float("nan"))
    assert art.environment == {"torch": "2.11.0", "count": 1} and art.roofline_floor_ms is None
    store = ArtifactStore(tmp_path, enabled=True)
    assert store.put(KEY, art) is not None and store.get(KEY).environment["torch"] == "2.11.0"
