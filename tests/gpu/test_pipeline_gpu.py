"""The pipeline suite on CUDA (H200): tracks, eligibility, install of a real faster wrapper, equal outputs.

Run on a CUDA machine: ``python -m pytest -q -s -m gpu tests/gpu/test_pipeline_gpu.py`` (scripts/gpu-suite.sh).
The scripted optimizer proposes the built-in agent's whole-call CUDA-graph rewrite of the graph's own
wrapper; the real gate decides. Every test prints what it saw (benchmarks lines go into the issue note).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import tilesmith
from tests.scripted import ScriptedFactory
from tilesmith.capture.source import strip_fx_header

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch, request):
    monkeypatch.setenv("TILESMITH_CACHE_DIR", str(tmp_path / "ts"))
    monkeypatch.delenv("TILESMITH_ALLOW_CPU", raising=False)
    torch._dynamo.reset()
    yield tmp_path / "ts"
    torch._dynamo.reset()
    keep = os.environ.get("OUT")  # the device tool's output folder: keep the gate reports for the issue note
    if keep:
        dest = Path(keep) / "profiles" / request.node.name
        for report in (tmp_path / "ts").glob("runs/*/*/profiles/*.txt"):
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy(report, dest / f"{report.parent.parent.name[:8]}-{report.name}")


def cudagraph_edit(text: str) -> str:
    from tilesmith.agent.builtin.cudagraph import cudagraph_source

    wrapper = strip_fx_header(text)
    return text.replace(wrapper, cudagraph_source(wrapper, device="cuda:0"))


def _mlp():
    from examples.models import MLPBlock, randomize_

    return randomize_(MLPBlock()).cuda()


def _tracks(root):
    return [json.loads(p.read_text()) for p in sorted(root.glob("runs/*/*/track.json"))]


def _print(compiled, label):
    for r in tilesmith.benchmarks(compiled):
        print(f"[{label}] benchmark {r.graph_name} {r.graph_key[:8]}: torch_inductor_ms={r.torch_inductor_ms:.4f} "
              f"tilesmith_ms={r.tilesmith_ms:.4f} speedup={r.speedup:.3f} ci={r.speedup_ci} "
              f"floor_ms={r.roofline_floor_ms}")
    for d in tilesmith.diagnostics(compiled):
        print(f"[{label}] diagnostic {d.kind}: {d.message[:300]}")


def _launch_bound():
    """Six Linear(256, 256) + GELU layers on a 32×256 batch: 12 short kernels per call, so the whole-call CUDA
    graph pays off on any host (bench/cache_hit.py's CUDA model; installed at 3.2–3.7× on the H200 in
    session 3). The MLP block of :func:`_mlp` is not used here: its CUDA-graph gain is marginal on the H200
    (rejected at 0.976× [0.958, 1.020] in session 3), and this test is about the install path, not that gain."""
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(256, 256), torch.nn.GELU()]
    return torch.nn.Sequential(*layers).cuda()


def test_scripted_optimizer_installs_faster_wrapper_for_launch_bound_mlp(isolated):
    model = _launch_bound().eval()
    x = torch.randn(32, 256, device="cuda")
    compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=ScriptedFactory(edits=[cudagraph_edit]))
    with torch.no_grad():
        out = compiled(x)
        torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
        x2 = torch.randn(32, 256, device="cuda")
        torch.testing.assert_close(compiled(x2), model(x2), rtol=1e-4, atol=1e-4)
    _print(compiled, "launch_bound_infer")
    (record,) = tilesmith.benchmarks(compiled)
    assert record.speedup > 1.02 and record.tilesmith_ms < record.torch_inductor_ms
    assert record.method == "cuda_event"


def test_training_installed_graphs_match_plain_torch_compile(isolated):
    torch.manual_seed(0)
    model = _mlp()
    reference = _mlp()
    reference.load_state_dict(model.state_dict())
    compiled = tilesmith.compile(model, example_inputs=(torch.randn(64, 1024, device="cuda"),),
                                 agent_model=ScriptedFactory(edits=[cudagraph_edit]))
    plain = torch.compile(reference)
    for step in range(3):
        x = torch.randn(64, 1024, device="cuda", requires_grad=True)
        x_ref = x.detach().clone().requires_grad_(True)
        out, ref = compiled(x), plain(x_ref)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        out.square().sum().backward()
        ref.square().sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-3, atol=1e-4)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-4)
            p.grad = q.grad = None
    _print(compiled, "mlp_train")
    kinds = sorted(t["kind"] for t in _tracks(isolated))
    assert kinds == ["backward", "forward"]


def test_graph_break_two_tracks_on_cuda(isolated):
    from tests.models import graph_break_fn

    x = torch.randn(4096, device="cuda")
    compiled = tilesmith.compile(graph_break_fn, example_inputs=(x,), agent_model=ScriptedFactory())
    torch.testing.assert_close(compiled(x), graph_break_fn(x))
    assert len(_tracks(isolated)) == 2


@pytest.mark.parametrize("case", ["reduce_overhead", "mixed_devices", "dynamic", "mutation"])
def test_ineligible_cuda_graphs_stay_on_inductor(isolated, case):
    x = torch.randn(256, device="cuda")
    kwargs = {}
    if case == "reduce_overhead":
        fn, args, kwargs, kind = (lambda t: torch.relu(t) * 2), (x,), {"mode": "reduce-overhead"}, "already_wrapped"
    elif case == "mixed_devices":
        cpu = torch.randn(256)
        fn, args, kind = (lambda t, c: (t * 2, c + 1)), (x, cpu), "mixed_devices"
    elif case == "dynamic":
        fn, args, kwargs, kind = torch.sin, (x,), {"dynamic": True}, "dynamic_shapes"
    else:
        def fn(t):
            t.add_(1)
            return t * 2
        args, kind = (x.clone(),), "input_mutation"
    compiled = tilesmith.compile(fn, example_inputs=(x,), agent_model=ScriptedFactory(), **kwargs)
    for _ in range(2):
        compiled(*args)
    kinds = [d.kind for d in tilesmith.diagnostics(compiled)]
    print(f"[{case}] {kinds}")
    assert kind in kinds
    assert not _tracks(isolated)


def test_aot_cache_hit_graph_is_seen_and_installed_on_cuda(isolated):
    """The second compile of the MLP block is an AOTAutograd cache hit (no inner_compile call): Tilesmith still
    sees the graph through its post_compile hook, takes its input specs from the first real call and installs
    the gate-approved CUDA-graph rewrite."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model, x = _mlp().eval(), torch.randn(64, 1024, device="cuda")
    with torch.no_grad():
        tilesmith.compile(model, example_inputs=(x,), agent_model=ScriptedFactory())(x)  # fills the AOT cache
    torch._dynamo.reset()
    before = int(counters["aot_autograd"]["autograd_cache_hit"])
    compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=ScriptedFactory(edits=[cudagraph_edit]),
                                 loops=1)
    with torch.no_grad():
        out = compiled(x)
        again = compiled(x)
        ref = model(x)
    assert int(counters["aot_autograd"]["autograd_cache_hit"]) > before
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(again, ref, rtol=2e-3, atol=2e-3)
    _print(compiled, "aot-hit")
    tracks = _tracks(isolated)
    assert tracks and tracks[-1]["status"] in ("installed", "kept_inductor")
    kinds = [d.kind for d in tilesmith.diagnostics(compiled)]
    assert tilesmith.benchmarks(compiled) or kinds, "the graph was seen: installed or diagnosed"
    assert "internal_error" not in kinds
