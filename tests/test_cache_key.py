"""Cache keys are stable across processes and Inductor cache dirs; a warm Inductor cache still reaches Tilesmith."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tilesmith.capture.source import canonicalize
from tilesmith.track.key import cache_key, key_environment

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "inductor-h200"

_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch, tilesmith
    sys.path.insert(0, {repo!r})
    from tests.models import TwoLayer
    from tests.scripted import ScriptedFactory
    torch.manual_seed(0)
    model, x = TwoLayer(), torch.randn(8, 64)
    compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=ScriptedFactory())
    compiled(x).sum().backward()
    tracks = sorted(tilesmith.diagnostics(compiled), key=lambda d: d.graph_name or "")
    print(json.dumps([[d.graph_name, d.graph_key] for d in tracks]))
    """
)


def _run(tmp_path: Path, inductor_dir: Path, name: str) -> list[list[str]]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir), "TILESMITH_ALLOW_CPU": "1",
           "TILESMITH_CACHE_DIR": str(tmp_path / name)}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT.format(repo=str(REPO))], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    keys = json.loads(proc.stdout.strip().splitlines()[-1])
    tracks = list((tmp_path / name).glob("runs/*/*/track.json"))
    assert len(tracks) == 2, f"both graphs reached Tilesmith in run {name}"
    return keys


@pytest.mark.slow
def test_keys_identical_across_processes_and_inductor_cache_dirs_and_warm_cache(tmp_path):
    shared = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    other = tmp_path / "other-inductor-cache"
    first = _run(tmp_path, shared, "a")  # warm or cold, depending on earlier tests
    second = _run(tmp_path, shared, "b")  # certainly warm: FX and AOTAutograd caches hit
    third = _run(tmp_path, other, "c")  # cold, different cache dir (different kernel paths)
    assert [name for name, _ in first] == ["0_backward", "0_forward"]
    assert all(len(key) == 64 for _, key in first)
    assert first == second == third


def test_canonical_source_drops_kernel_paths_cache_dir_and_aot_counter():
    src = (
        "# AOT ID: ['7_forward']\n"
        "# kernel path: /tmp/ic_a/ou/coujm.py\n"
        "x = '/tmp/ic_a/ab/cab.so'   \n"
    )
    other = src.replace("/tmp/ic_a", "/home/u/.cache/ic_b").replace("7_forward", "0_forward")
    a = canonicalize(src, cache_dirs=("/tmp/ic_a",))
    b = canonicalize(other, cache_dirs=("/home/u/.cache/ic_b",))
    assert a == b == "# AOT ID: ['forward']\nx = '<inductor-cache>/ab/cab.so'\n"


def test_key_changes_with_environment_and_source():
    versions = {"torch": "2.11.0", "triton": "3.6.0", "cuda": "13.0", "gpu": "NVIDIA H200"}
    env = key_environment(versions=versions, device="cuda:0", agent_model="m", agency="medium", loops=1,
                          min_improvement=0.02)
    base = cache_key("src", env)
    assert base == cache_key("src", dict(env))
    assert len(base) == 64 and int(base, 16) >= 0
    for change in ({"agency": "high"}, {"torch": "2.11.1"}, {"agent_model": "other"}, {"loops": 2},
                   {"device": "NVIDIA H100"}, {"min_improvement": 0.05}):
        assert cache_key("src", {**env, **change}) != base
    assert cache_key("src2", env) != base


def test_real_h200_wrappers_canonicalize_without_paths():
    paths = sorted(FIXTURES.glob("*.wrapper.py"))
    assert len(paths) == 13
    for path in paths:
        text = canonicalize(path.read_text(), cache_dirs=("/tmp/torchinductor_root",))
        assert "/tmp/torchinductor_root" not in text and "# kernel path" not in text, path.name
        compile(text, path.name, "exec")


def test_key_ignores_inductor_provenance_comments_but_not_code():
    env = {"torch": "2.11.0"}
    warm = "x = 1\n        # Topologically Sorted Source Nodes: [input_1]\ny = '''\n#include <a.h>\n'''\n"
    cold = warm.replace("[input_1]", "[linear]")
    assert cache_key(warm, env) == cache_key(cold, env)
    assert cache_key(warm.replace("#include <a.h>", "#include <b.h>"), env) != cache_key(warm, env)
    assert cache_key(warm.replace("x = 1", "x = 2"), env) != cache_key(warm, env)
