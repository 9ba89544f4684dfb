"""Artifact-store quarantine: a wrapper that failed production verification is never served or stored again."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from test_cache_store import KEY, make_artifact  # noqa: E402

from tilesmith.cache import ArtifactStore, source_sha256  # noqa: E402
from tilesmith.cli.main import main  # noqa: E402


def _store(tmp_path):
    return ArtifactStore(tmp_path / "ts", enabled=True)


def test_quarantine_moves_the_entry_and_blocks_that_wrapper_only(tmp_path):
    store = _store(tmp_path)
    bad = make_artifact()
    store.put(KEY, bad)
    where = store.quarantine(KEY, source=bad.source, reason="production call 6: value_mismatch", graph_name="g")
    assert where is not None and (where / "entry" / "wrapper.py").read_text() == bad.source
    assert not store.path(KEY).exists() and store.entries() == []
    assert store.get(KEY) is None and store.take_problems() == ()  # a plain miss: the entry is gone
    assert store.put(KEY, bad) is None
    assert [d.kind for d in store.take_problems()] == ["cache_quarantined"]
    assert store.is_quarantined(KEY, bad.source) and not store.path(KEY).exists()
    good = make_artifact(source=bad.source + "\n# another accepted candidate\n")
    assert store.put(KEY, good) is not None and store.get(KEY).source == good.source
    (record,) = store.quarantined()
    assert (record.key, record.source_sha256, record.graph_name, record.moved_entry) == \
        (KEY, source_sha256(bad.source), "g", True)
    assert "value_mismatch" in record.reason


def test_an_entry_stored_again_elsewhere_is_refused_on_read(tmp_path):
    store = _store(tmp_path)
    bad = make_artifact()
    store.quarantine(KEY, source=bad.source, reason="r")  # nothing stored yet: record only
    other = ArtifactStore(tmp_path / "ts", enabled=False)
    assert other.quarantine(KEY, source=bad.source, reason="r") is None  # a disabled store writes nothing
    # a copy of the entry arriving from another store (or an older Tilesmith that ignores quarantine)
    import shutil

    donor = _store(tmp_path / "donor")
    donor.put(KEY, bad)
    store.path(KEY).parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(donor.path(KEY), store.path(KEY))
    assert store.get(KEY) is None
    assert [d.kind for d in store.take_problems()] == ["cache_quarantined"]
    (record,) = store.quarantined()
    assert not record.moved_entry


def test_quarantine_is_idempotent_and_survives_prune(tmp_path):
    store = _store(tmp_path)
    bad = make_artifact()
    store.put(KEY, bad)
    first = store.quarantine(KEY, source=bad.source, reason="r1")
    assert store.quarantine(KEY, source=bad.source, reason="r2") == first
    result = store.prune(max_age_s=0, max_bytes=0)
    assert result.removed == () and len(store.quarantined()) == 1 and (first / "entry").is_dir()


def test_cli_cache_lists_quarantined_wrappers(tmp_path):
    store = _store(tmp_path)
    bad = make_artifact()
    store.put(KEY, bad)
    store.quarantine(KEY, source=bad.source, reason="production call 6: value_mismatch: output 0", graph_name="0_x")
    out = io.StringIO()
    assert main(["--root", str(tmp_path / "ts"), "cache"], out=out) == 0
    text = out.getvalue()
    assert "1 quarantined wrapper" in text and KEY[:16] in text and "value_mismatch" in text and "is empty" in text
    out = io.StringIO()
    assert main(["--root", str(tmp_path / "ts"), "cache", "--json"], out=out) == 0
    (item,) = json.loads(out.getvalue())
    assert item["quarantined"] is True and item["key"] == KEY and item["source_sha256"] == source_sha256(bad.source)


def test_cli_show_says_a_track_was_uninstalled(tmp_path):
    from test_cli_runfolder import RUN_NEW, build_root

    ids = build_root(tmp_path)
    track = tmp_path / "runs" / RUN_NEW / ids["installed"] / "track.json"
    doc = json.loads(track.read_text())
    doc.update(status="uninstalled", verification={"failed_call": 6, "check": "value_mismatch", "detail": "output 0"})
    track.write_text(json.dumps(doc))
    out = io.StringIO()
    main(["--root", str(tmp_path), "show", ids["installed"][:12]], out=out)
    assert "uninstalled by production verification on call 6 since install (value_mismatch): output 0" in \
        out.getvalue()
