"""``TILESMITH_OPTIMIZE=background``: the first call returns on Inductor at once, the optimizer and the gate run in
a thread with a trusted worker's reference, the winner is installed afterwards and ``tilesmith.wait`` waits for it
(CPU test mode, a scripted optimizer that replaces MulSum's loop by a matmul)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tilesmith.cli.main import main

REPO = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent(
    """
    import json, threading
    import torch
    import tilesmith
    import tilesmith.optimize as stages
    from tests.models import MulSum, has_mulsum_loop, mm_instead_of_loop
    from tests.scripted import ScriptedFactory, comment

    released = threading.Event()
    real_run_optimizer = stages._run_optimizer
    thread_names = []

    def held_run_optimizer(*args, **kwargs):  # the optimizer may start only after the first call has returned
        thread_names.append(threading.current_thread().name)
        assert released.wait(300)
        return real_run_optimizer(*args, **kwargs)

    stages._run_optimizer = held_run_optimizer
    torch.manual_seed(0)
    model = MulSum().eval()
    x = torch.randn(64, 512)
    factory = ScriptedFactory(edits=[lambda t: mm_instead_of_loop(t) if has_mulsum_loop(t) else comment("noop")(t)])
    compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=factory, loops=1)
    run = tilesmith.api._run_of(compiled)
    with torch.no_grad():
        out = compiled(x)
        during = {"benchmarks": len(tilesmith.benchmarks(compiled)), "states": [str(h.state) for h in run.handles],
                  "background": len(run.background), "not_done": tilesmith.wait(compiled, timeout_s=0.01),
                  "diagnostics": [d.kind for d in tilesmith.diagnostics(compiled)]}
        meanwhile = compiled(x)  # runs on Inductor while the optimizer waits
        released.set()
        finished = tilesmith.wait(compiled, timeout_s=300)
        again = compiled(x)
        ref = model(x)
    print(json.dumps({
        "sessions": len(factory.sessions), "during": during, "finished": finished, "threads": thread_names,
        "states": [str(h.state) for h in run.handles],
        "benchmarks": [{"source": r.source, "track": r.track_dir} for r in tilesmith.benchmarks(compiled)],
        "diagnostics": [d.kind for d in tilesmith.diagnostics(compiled)],
        "max_err": max(float((t - ref).abs().max()) for t in (out, meanwhile, again)),
    }))
    """
)


@pytest.mark.slow
def test_first_call_returns_on_inductor_and_the_winner_is_installed_from_a_thread(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "TILESMITH_CACHE_DIR": str(tmp_path / "ts"), "TILESMITH_ALLOW_CPU": "1",
           "PYTHONPATH": str(REPO), "TILESMITH_OPTIMIZE": "background"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["during"] == {"benchmarks": 0, "states": ["optimizing"], "background": 1, "not_done": False,
                                "diagnostics": ["optimizing_in_background"]}
    assert result["threads"] and result["threads"][0].startswith("tilesmith-optimize-")
    assert result["finished"] and result["states"] == ["installed"], result["diagnostics"]
    assert result["sessions"] == 1 and result["max_err"] < 1e-4
    (bench,) = result["benchmarks"]
    assert bench["source"] == "optimizer"
    kinds = result["diagnostics"]
    assert "optimizing_in_background" not in kinds, kinds  # retired once decided (new-user trial 19)
    track = Path(bench["track"])
    assert json.loads((track / "track.json").read_text())["status"] == "installed"
    reports = [json.loads(p.read_text()) for p in (track / "profiles").glob("*.json")]
    evaluated = [r for r in reports if "reference" in r]
    assert evaluated and {r["reference"]["source"] for r in evaluated} == {"trusted worker"}


def test_the_setting_takes_inline_or_background_only(monkeypatch):
    from tilesmith import settings

    monkeypatch.setenv("TILESMITH_OPTIMIZE", "Background")
    assert settings.get("TILESMITH_OPTIMIZE") == "background"
    monkeypatch.delenv("TILESMITH_OPTIMIZE")
    assert settings.get("TILESMITH_OPTIMIZE") == "inline"
    monkeypatch.setenv("TILESMITH_OPTIMIZE", "later")
    with pytest.raises(ValueError, match="TILESMITH_OPTIMIZE"):
        settings.get("TILESMITH_OPTIMIZE")


ABANDONED = textwrap.dedent(
    """
    import threading
    import torch
    import tilesmith
    import tilesmith.optimize as stages
    from tests.models import TwoLayer
    from tests.scripted import ScriptedFactory

    never = threading.Event()
    stages._run_optimizer = lambda *args, **kwargs: never.wait()  # still optimizing when the program ends
    model = TwoLayer().eval()
    x = torch.randn(8, 64)
    compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=ScriptedFactory())
    with torch.no_grad():
        compiled(x)
    print([d.kind for d in tilesmith.diagnostics(compiled)])
    """
)


def test_a_program_that_exits_before_the_decision_is_told_and_the_track_is_not_left_optimizing(tmp_path):
    """Before: the program ended silently and track.json said ``optimizing`` for good (`tilesmith show` too)."""
    script = tmp_path / "child.py"
    script.write_text(ABANDONED)
    env = {**os.environ, "TILESMITH_CACHE_DIR": str(tmp_path / "ts"), "TILESMITH_ALLOW_CPU": "1",
           "PYTHONPATH": str(REPO), "TILESMITH_OPTIMIZE": "background", "TILESMITH_PROGRESS": "off"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1] == "['optimizing_in_background']"
    (track_json,) = (tmp_path / "ts").glob("runs/*/*/track.json")
    track = json.loads(track_json.read_text())
    key = track["graph_key"]
    assert track["status"] == "kept_inductor"
    assert [d["kind"] for d in track["diagnostics"]] == ["background_abandoned"]
    stderr = " ".join(proc.stderr.split())
    assert (f"TilesmithWarning: graph {key[:8]} (0_inference): the process exited while its background optimization "
            "was still running") in stderr and "Remedy: call tilesmith.wait(model)" in stderr
    # `tilesmith show` no longer lists the decided graph as "optimizing in the background" (run.json keeps that note)
    out = io.StringIO()
    assert main(["--root", str(tmp_path / "ts"), "show", "latest"], out=out) == 0
    shown = out.getvalue()
    assert f"graph {key[:8]} (0_inference)  inference  kept_inductor" in shown
    assert "[background_abandoned]" in shown and "[optimizing_in_background]" not in shown, shown
