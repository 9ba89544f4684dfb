"""Graphs that a warm AOTAutograd cache hands back (no ``inner_compile`` call) are still seen and optimized.

Tilesmith keeps the AOTAutograd cache on (a warm start is then as fast as plain ``torch.compile``'s) and sees
those graphs through its ``CompiledFxGraph.post_compile`` hook (tilesmith/capture/backend.py). The record of
such a graph must equal the one ``inner_compile`` would have given: same key, kind, name, source, input specs
(taken from the first real call) and static inputs. (Its FX text is Inductor's stored post-grad graph instead of
the graph before Inductor's passes.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tilesmith
from tests.models import MulSum, TwoLayer, has_mulsum_loop, mm_instead_of_loop
from tests.scripted import ScriptedFactory, comment
from tilesmith.capture.backend import AOT_CACHE_HIT, install_post_compile_hook


@pytest.fixture(autouse=True)
def test_mode(cpu_test_mode):
    return cpu_test_mode


def _aot_hits() -> int:
    from torch._dynamo.utils import counters

    return int(counters["aot_autograd"]["autograd_cache_hit"])


def _train_step(model, x, *, aot_cache: bool):
    """Compile ``model`` afresh (new Dynamo cache), run one training step; return the run's graph handles."""
    torch._dynamo.reset()
    compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=ScriptedFactory())
    with torch._functorch.config.patch(enable_autograd_cache=aot_cache):
        compiled(x).sum().backward()
    from tilesmith.api import _run_of

    handles = _run_of(compiled).handles
    assert len(handles) == 2 and handles[0].compiled is not handles[1].compiled, "each graph reported once"
    return {h.graph.kind: h for h in handles}


def test_aot_cache_hit_graphs_get_the_same_record_as_inner_compile_ones():
    assert install_post_compile_hook()
    torch.manual_seed(0)
    model, x = TwoLayer(), torch.randn(8, 64)
    _train_step(model, x, aot_cache=True)  # fills the AOTAutograd cache (or hits it: either is fine)
    cold = _train_step(model, x, aot_cache=False)  # inner_compile path: records from Inductor's example inputs
    before = _aot_hits()
    warm = _train_step(model, x, aot_cache=True)
    assert _aot_hits() > before, "the third compile must be an AOTAutograd cache hit"
    assert sorted(cold) == sorted(warm) == ["backward", "forward"]
    for kind in ("forward", "backward"):
        c, w = cold[kind].graph, warm[kind].graph
        assert warm[kind].key == cold[kind].key and len(warm[kind].key) == 64
        assert (w.name.split("_", 1)[1], w.kind, w.canonical_source) == (c.name.split("_", 1)[1], c.kind,
                                                                        c.canonical_source)
        assert w.inputs == c.inputs and len(w.inputs) > 0, kind
        assert w.static_input_idxs == c.static_input_idxs
        assert (w.inputs_to_check, w.mutated_input_idxs, w.output_strides) == (c.inputs_to_check,
                                                                              c.mutated_input_idxs, c.output_strides)
        assert w.fx_program.strip(), "the stored post-grad graph stands in for the FX program"
        assert warm[kind].state == "kept_inductor"  # the scripted optimizer proposed nothing
    assert cold["forward"].graph.static_input_idxs, "the Linear parameters are static inputs of the forward"
    assert cold["backward"].graph.static_input_idxs == ()


def test_aot_cache_hit_graph_is_optimized_and_installed(test_mode):
    torch.manual_seed(0)
    model, x = MulSum().eval(), torch.randn(64, 512)
    with torch.no_grad():
        tilesmith.compile(model, example_inputs=(x,), agent_model=ScriptedFactory())(x)  # warm the AOT cache
    torch._dynamo.reset()
    seen = []
    factory = ScriptedFactory(edits=[lambda t: (seen.append(t), mm_instead_of_loop(t) if has_mulsum_loop(t)
                                                else comment("noop")(t))[1]])
    before = _aot_hits()
    compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=factory, loops=1)
    with torch.no_grad():
        out = compiled(x)
        again = compiled(x)
    assert _aot_hits() > before
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(again, model(x), rtol=1e-4, atol=1e-4)
    (record,) = tilesmith.benchmarks(compiled)
    assert record.source == "optimizer" and record.speedup > 1.0
    assert seen and seen[0].startswith("# ---- FX program")
    track = json.loads((Path(record.track_dir) / "track.json").read_text())
    assert track["status"] == "installed" and track["kind"] == "inference"


def test_outside_a_tilesmith_compile_the_hook_reports_nothing(test_mode):
    """Plain torch.compile in the same process (AOT hits included) never reaches a Tilesmith run."""
    from tilesmith.capture import backend

    assert install_post_compile_hook()
    calls = []
    model, x = TwoLayer().eval(), torch.randn(8, 64)
    with torch.no_grad():
        tilesmith.compile(model, example_inputs=(x,), agent_model=ScriptedFactory())(x)
    torch._dynamo.reset()
    original_report = backend._Call.report
    before = _aot_hits()
    try:
        backend._Call.report = lambda self, *a: calls.append(a)  # type: ignore[method-assign]
        with torch.no_grad():
            torch.compile(model)(x)
    finally:
        backend._Call.report = original_report  # type: ignore[method-assign]
    assert _aot_hits() > before, "plain torch.compile must have loaded the graph from the AOTAutograd cache"
    assert calls == []


def test_bundled_aot_cache_entry_is_still_saved_with_tilesmith(test_mode):
    """AOTAutograd's bundled cache pickles the CompiledFxGraph itself: nothing Tilesmith attaches may break that."""
    from torch._dynamo.utils import counters

    import secrets

    # A hidden size no other test (or earlier run sharing this Inductor cache) compiled: a cold entry to save.
    model, x = TwoLayer(d=48, h=80 + secrets.randbelow(4000)).eval(), torch.randn(5, 48)
    before = int(counters["aot_autograd"]["autograd_cache_saved"])
    with torch._functorch.config.patch(bundled_autograd_cache=True), torch.no_grad():
        compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=ScriptedFactory())
        torch.testing.assert_close(compiled(x), model(x))
    assert int(counters["aot_autograd"]["autograd_cache_saved"]) > before
    assert [d.kind for d in tilesmith.diagnostics(compiled)] == ["no_improvement"]


def test_aot_cache_hit_graph_with_a_scalar_input_stays_on_inductor(test_mode):
    """The cache-hit path cannot tell a symbolic scalar input from a static one: such a graph is not optimized."""
    from tilesmith.pipeline import GraphHandle, LiveRun

    run = LiveRun.__new__(LiveRun)
    diagnosed = []
    run.diagnose = lambda kind, message, *a: diagnosed.append((kind, message))  # type: ignore[method-assign]
    graph = type("G", (), {"name": "0_backward"})()
    handle = GraphHandle.__new__(GraphHandle)
    handle.graph, handle.key, handle.inner_kwargs, handle.state = graph, "ab" * 32, {AOT_CACHE_HIT: True}, "pending"
    assert LiveRun._inputs_from_call(run, handle, [torch.zeros(2), 7]) is False
    assert handle.state == "kept_inductor" and handle.inner_kwargs is None
    ((kind, message),) = diagnosed
    assert kind == "dynamic_shapes" and "[1]" in message and "abababab" in message
