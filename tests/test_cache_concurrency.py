"""Eight processes storing the same key at once leave exactly one valid entry and no torn files."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tilesmith.cache import ArtifactStore

KEY = "7e" + "9" * 62
WRITERS = 8

CHILD = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from tilesmith.cache import Artifact, ArtifactStore

    root, index, barrier = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    key = sys.argv[4]
    # A large, writer-specific source widens the window in which writers overlap.
    source = f"# writer {index}\\n" + ("x = 1  # padding line for a large wrapper\\n" * 60000)
    art = Artifact(source=source, speedup=1.1 + index / 100, speedup_ci=(1.05, 1.2), torch_inductor_ms=1.0,
                   tilesmith_ms=0.9, graph_name="0_inference", note=f"writer {index}",
                   reports=((f"e{index:04d}.json", json.dumps({"writer": index})),),
                   files=(("blob.bin", bytes([index]) * 200000),))
    store = ArtifactStore(root, enabled=True)
    (barrier.parent / f"ready-{index}").write_text("")
    while not barrier.exists():
        time.sleep(0.001)
    stored = store.put(key, art)
    seen = []
    for _ in range(20):  # read while the others may still be writing
        got = store.get(key)
        seen.append(None if got is None else got.note)
    problems = [d.kind for d in store.take_problems()]
    print(json.dumps({"stored": None if stored is None else stored.note,
                      "hash": None if stored is None else stored.content_hash,
                      "seen": seen, "problems": problems}))
    """
)


def test_eight_processes_on_one_key_leave_one_valid_entry(tmp_path):
    root = tmp_path / "cache"
    barrier = tmp_path / "go"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    repo = Path(__file__).resolve().parents[1]
    procs = [subprocess.Popen([sys.executable, str(script), str(root), str(i), str(barrier), KEY],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=repo,
                              env={**__import__("os").environ, "PYTHONPATH": str(repo)})
             for i in range(WRITERS)]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("ready-*"))) < WRITERS:
        assert time.monotonic() < deadline, "writers did not start"
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs if p.poll() is not None]
        time.sleep(0.01)
    barrier.write_text("")
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))

    store = ArtifactStore(root, enabled=True)
    final = store.get(KEY)
    assert final is not None and store.take_problems() == ()
    # every writer reports the same single winner, and every read saw either nothing or that entry
    assert {r["stored"] for r in results} == {final.note}
    assert {r["hash"] for r in results} == {final.content_hash}
    for r in results:
        assert r["problems"] == []
        assert set(r["seen"]) <= {final.note}
    writer = int(final.note.split()[1])
    assert final.source.startswith(f"# writer {writer}\n") and final.files == (("blob.bin", bytes([writer]) * 200000),)
    # exactly one entry, no temporary or torn leftovers anywhere in the store
    shard = root / "artifacts" / KEY[:2]
    assert [p.name for p in shard.iterdir()] == [KEY]
    assert [e.key for e in store.entries(verify=True) if e.valid] == [KEY]
    stray = [p for p in root.rglob("*") if p.name.startswith(".") or p.name.endswith(".tmp")]
    assert stray == []
