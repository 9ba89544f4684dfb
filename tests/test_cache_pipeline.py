"""An artifact accepted in one process is reused by the next: the agent does not run, the gate re-checks
it on the new inputs, it is installed, and the track holds cache.json (docs/cache.md, CPU test mode)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _gate_available() -> bool:
    try:
        from tilesmith.gate import Gate  # noqa: F401
    except ImportError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _gate_available(), reason="the host gate (tilesmith.gate.Gate) has not landed")

CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    import tilesmith
    from tests.models import MulSum, has_mulsum_loop, mm_instead_of_loop
    from tests.scripted import ScriptedFactory, comment

    torch.manual_seed(0)
    model = MulSum().eval()
    x = torch.randn(64, 512)
    factory = ScriptedFactory(edits=[lambda t: mm_instead_of_loop(t) if has_mulsum_loop(t) else comment("noop")(t)])
    compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=factory, loops=1)
    with torch.no_grad():
        out = compiled(x)
        again = compiled(x)
        ref = model(x)
    print(json.dumps({
        "sessions": len(factory.sessions),
        "benchmarks": [{"key": r.graph_key, "source": r.source, "speedup": r.speedup, "track": r.track_dir}
                       for r in tilesmith.benchmarks(compiled)],
        "diagnostics": [d.kind for d in tilesmith.diagnostics(compiled)],
        "max_err": max(float((out - ref).abs().max()), float((again - ref).abs().max())),
    }))
    """
)


def _run(root: Path, script: Path) -> dict:
    env = {**os.environ, "TILESMITH_CACHE_DIR": str(root), "TILESMITH_ALLOW_CPU": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_hit_in_a_second_process_skips_the_agent_and_installs(tmp_path):
    from tilesmith.cache import ArtifactStore

    root = tmp_path / "ts"
    script = tmp_path / "child.py"
    script.write_text(CHILD)

    first = _run(root, script)
    assert first["sessions"] == 1
    (bench,) = first["benchmarks"]
    assert bench["source"] == "optimizer" and first["max_err"] < 1e-4
    store = ArtifactStore(root, enabled=True)
    stored = store.get(bench["key"])
    assert stored is not None and "extern_kernels.mm" in stored.source
    assert [e.key for e in store.entries()] == [bench["key"]]

    second = _run(root, script)
    assert second["sessions"] == 0, "the optimizer ran although an artifact existed"
    (hit,) = second["benchmarks"]
    assert hit["key"] == bench["key"] and hit["source"] == "cache" and second["max_err"] < 1e-4
    assert "cache_hit" in second["diagnostics"]
    track = Path(hit["track"])
    assert json.loads((track / "track.json").read_text())["status"] == "cache_hit"
    cache_doc = json.loads((track / "cache.json").read_text())
    assert cache_doc["graph_key"] == bench["key"] and cache_doc["content_hash"] == stored.content_hash


@pytest.mark.slow
def test_corrupted_artifact_is_reported_and_the_graph_optimized_again(tmp_path):
    from tilesmith.cache import ArtifactStore

    root = tmp_path / "ts"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    first = _run(root, script)
    key = first["benchmarks"][0]["key"]
    wrapper = ArtifactStore(root, enabled=True).path(key) / "wrapper.py"
    wrapper.write_text(wrapper.read_text().replace("extern_kernels.mm", "extern_kernels.bmm"))

    second = _run(root, script)
    assert second["sessions"] == 1  # optimized normally
    assert second["benchmarks"][0]["source"] == "optimizer"
    assert "cache_corrupted" in second["diagnostics"]
    assert ArtifactStore(root, enabled=True).get(key) is not None  # replaced by the fresh acceptance


CHILD_BACKGROUND = textwrap.dedent(
    """
    import json, threading
    import torch
    import tilesmith
    import tilesmith.install.installer as installer
    from tests.models import MulSum, has_mulsum_loop, mm_instead_of_loop
    from tests.scripted import ScriptedFactory, comment

    released = threading.Event()
    real_install_hit = installer.install_hit

    def held_install_hit(*args, **kwargs):  # the re-check may finish only after the first call has returned
        assert released.wait(300)
        return real_install_hit(*args, **kwargs)

    installer.install_hit = held_install_hit
    torch.manual_seed(0)
    model = MulSum().eval()
    x = torch.randn(64, 512)
    factory = ScriptedFactory(edits=[lambda t: mm_instead_of_loop(t) if has_mulsum_loop(t) else comment("noop")(t)])
    compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=factory, loops=1)
    run = tilesmith.api._run_of(compiled)
    with torch.no_grad():
        out = compiled(x)
        during = {"benchmarks": len(tilesmith.benchmarks(compiled)), "states": [h.state for h in run.handles],
                  "background": len(run.background)}
        released.set()
        finished = tilesmith.wait(compiled, timeout_s=300)
        again = compiled(x)
        ref = model(x)
    print(json.dumps({
        "sessions": len(factory.sessions), "during": during, "finished": finished,
        "states": [h.state for h in run.handles],
        "benchmarks": [{"key": r.graph_key, "source": r.source, "track": r.track_dir}
                       for r in tilesmith.benchmarks(compiled)],
        "diagnostics": [d.kind for d in tilesmith.diagnostics(compiled)],
        "messages": [d.message for d in tilesmith.diagnostics(compiled)],
        "max_err": max(float((out - ref).abs().max()), float((again - ref).abs().max())),
    }))
    """
)


@pytest.mark.slow
def test_background_recheck_returns_first_call_on_inductor_then_installs_with_a_trusted_reference(
        tmp_path, monkeypatch):
    root = tmp_path / "ts"
    seed_script, script = tmp_path / "seed.py", tmp_path / "child.py"
    seed_script.write_text(CHILD)
    script.write_text(CHILD_BACKGROUND)
    first = _run(root, seed_script)
    (bench,) = first["benchmarks"]
    assert bench["source"] == "optimizer"

    monkeypatch.setenv("TILESMITH_CACHE_RECHECK", "background")
    second = _run(root, script)
    assert second["during"] == {"benchmarks": 0, "states": ["rechecking"], "background": 1}
    assert second["finished"] and second["states"] == ["installed"]
    assert second["sessions"] == 0 and second["max_err"] < 1e-4, second["messages"]
    (hit,) = second["benchmarks"]
    assert hit["source"] == "cache" and "cache_hit" in second["diagnostics"]
    assert "cache_rechecking" not in second["diagnostics"]  # retired once the re-check decided
    assert "trusted worker" in second["messages"][second["diagnostics"].index("cache_hit")]
    reports = [json.loads(p.read_text()) for p in (Path(hit["track"]) / "profiles").glob("*.json")]
    assert [r["kind"] for r in reports] == ["recheck"]
    assert reports[0]["reference"]["source"] == "trusted worker"  # never the user's callable from a thread
