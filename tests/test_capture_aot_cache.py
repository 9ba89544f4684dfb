"""Graphs that a warm AOTAutograd cache hands back (no ``inner_compile`` call) are still seen and optimized.

Tilesmith keeps the AOTAutograd cache on (a warm start is then as fast as plain ``torch.compile``'s) and sees
those graphs through its ``CompiledFxGraph.post_compile`` hook (tilesmith/capture/backend.py). The record of
such a graph must equal the one ``inner_compile`` would have given: same key, kind, name, source, input specs
(taken from the first real call) and static inputs.
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
    try:
        backend._Call.report = lambda self, *a: calls.append(a)  # type: ignore[method-assign]
        with torch.no_grad():
            torch.compile(model)(x)
    finally:
        backend._Call.report = original_report  # type: ignore[method-assign]
    assert calls == []
    assert AOT_CACHE_HIT == "tilesmith_aot_cache_hit"
