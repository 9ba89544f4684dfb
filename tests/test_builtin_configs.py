"""The built-in agent's configuration generator: portfolio, FX graph serialization, the search worker's compile and
screen, ranking and composition, the budget, and the whole path through the gate on CPU test mode."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from tests import gate_support as gs

from tests.builtin_fake_session import FakeSession, captured_graph
from tests.fixture_paths import fixture as fixture_path
from tilesmith.agent.builtin import BuiltinOptimizer, BuiltinOptimizerFactory
from tilesmith.agent.builtin.base import Profile
from tilesmith.agent.builtin.configs import VariantScreen, graph_features, portfolio
from tilesmith.agent.builtin.cudagraph import MARKER
from tilesmith.capture import fxgraph


def fixture(name: str) -> str:
    return fixture_path(f"{name}.wrapper.py").read_text()


def fx(name: str) -> str:
    return fixture_path(f"{name}.fx.txt").read_text()


# -- portfolio ---------------------------------------------------------------------------------------------------
def test_cuda_portfolio_follows_the_graph_features():
    gpt2 = portfolio(fx("gpt2_block_bf16_infer__03"), fixture("gpt2_block_bf16_infer__03"), "cuda:0", "medium")
    names = [v.name for v in gpt2[0]]
    assert names[0] == "max_autotune"
    assert {"coordinate_descent", "no_persistent_reductions", "no_split_reductions", "multi_kernel",
            "combo_kernels"} <= set(names)
    assert dict(gpt2[0][0].patches)["max_autotune"] is True
    assert "cpp_wrapper" in gpt2[1]  # not proposed on CUDA, with the reason
    feats = graph_features(fx("softmax_bias_bf16_infer__06"), fixture("softmax_bias_bf16_infer__06"))
    assert feats["reductions"] and not feats["gemm"]
    mlp_names = [v.name for v in portfolio(fx("mlp_fp32_infer__00"), fixture("mlp_fp32_infer__00"), "cuda:0",
                                           "medium")[0]]
    assert "max_autotune" in mlp_names


def test_low_agency_keeps_only_coordinate_descent_and_cpu_gets_the_cpp_wrapper():
    low, skipped = portfolio(fx("gpt2_block_bf16_infer__03"), fixture("gpt2_block_bf16_infer__03"), "cuda:0", "low")
    assert [v.name for v in low] == ["coordinate_descent"]
    assert "agency 'low'" in skipped["max_autotune"]
    cpu_src = fixture_path("cpu_mlp_infer.wrapper.py").read_text()
    cpu, cpu_skipped = portfolio("torch.ops.aten.addmm.default(a, b, c)", cpu_src, "cpu", "medium")
    assert [v.name for v in cpu] == ["cpp_wrapper", "max_autotune", "max_autotune_cpp_wrapper"]
    no_gemm, why = portfolio("torch.ops.aten.relu.default(a)", "def call(args):\n    pass\n", "cpu", "medium")
    assert [v.name for v in no_gemm] == ["cpp_wrapper"] and "matrix products" in why["max_autotune"]


# -- FX graph serialization --------------------------------------------------------------------------------------
class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x + self.b(torch.relu(self.a(x))), (32,))


def _capture(model: torch.nn.Module, x: torch.Tensor) -> list[fxgraph.FxModule]:
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    got: list[fxgraph.FxModule] = []

    def inner(gm, example_inputs, **kwargs):
        module = fxgraph.serialize(gm, example_inputs, kwargs)
        assert module is not None
        got.append(module)
        return compile_fx_inner(gm, example_inputs, **kwargs)

    torch._dynamo.reset()
    with torch.no_grad(), gs.no_compile_caches():
        torch.compile(model, backend=lambda gm, ex: compile_fx(gm, ex, inner_compile=inner))(x)
    torch._dynamo.reset()
    return got


def test_serialized_graph_loads_back_with_the_same_placeholders_and_kwargs(tmp_path):
    (module,) = _capture(Small().eval(), torch.randn(4, 32))
    assert dict(module.kwargs)["is_inference"] is True
    gm, inputs, _ = fxgraph.load(module.payload)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(inputs) == 5
    assert [tuple(t.shape) for t in inputs] == [(64, 32), (64,), (4, 32), (32, 64), (32,)]
    fxgraph.save(module, "fkey123", tmp_path)
    again = fxgraph.lookup("fkey123", tmp_path)
    assert again is not None and again.payload == module.payload and again.kwargs_dict() == module.kwargs_dict()
    assert fxgraph.lookup("other", tmp_path) is None and fxgraph.lookup(None, tmp_path) is None


def test_graphs_with_too_many_constant_bytes_are_not_serialized(monkeypatch):
    class Const(torch.nn.Module):
        def forward(self, x):
            return x + torch.tensor([0.5] * 4096)

    monkeypatch.setattr(fxgraph, "MAX_CONSTANT_BYTES", 0)
    got: list = []
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(gm, example_inputs, **kwargs):
        got.append(fxgraph.serialize(gm, example_inputs, kwargs))
        return compile_fx_inner(gm, example_inputs, **kwargs)

    torch._dynamo.reset()
    with torch.no_grad(), gs.no_compile_caches():
        torch.compile(Const(), backend=lambda gm, ex: compile_fx(gm, ex, inner_compile=inner))(torch.randn(4096))
    torch._dynamo.reset()
    assert got and got[0] is None


# -- the search worker compiles and screens (CPU) ----------------------------------------------------------------
@pytest.mark.parametrize("workers", [1, 2], ids=["in-process", "two-compile-processes"])
def test_search_worker_compiles_and_screens_the_cpp_wrapper_variant(tmp_path, workers):
    from tilesmith.agent.builtin.configs import Variant
    from tilesmith.agent.builtin.profile import run_search
    from tilesmith.capture.source import canonicalize

    model, x = Small().eval(), torch.randn(4, 32)
    (module,) = _capture(model, x)
    source = _wrapper_source(model, x)
    variants = [Variant("cpp_wrapper", (("cpp_wrapper", True),), "C++ host wrapper"),
                Variant("renamed", (("option_that_does_not_exist", 1),), "missing option")]
    profile = run_search(source, "cpu", timeout_s=400, variants=[v.request() for v in variants], fx_module=module,
                         deadline_s=300, original_canonical=canonicalize(source), compile_workers=workers)
    assert profile.eager_ms and profile.eager_ms > 0
    screens = {s.name: s for s in profile.variants}
    cpp = screens["cpp_wrapper"]
    assert cpp.status == "ok", cpp
    assert cpp.ratio and cpp.ratio > 0 and cpp.compile_s is not None and cpp.screen_rel_l2 is not None
    assert "CppWrapperCodeCache.load_pybinding" in cpp.source and "def call" not in cpp.source.split("\n")[0]
    from tilesmith.gate.host.static_scan import scan

    assert scan(cpp.source) == []
    missing = screens["renamed"]
    assert missing.status == "failed" and "none of the options" in missing.error


def _wrapper_source(model: torch.nn.Module, x: torch.Tensor) -> str:
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    sources: list[str] = []

    def inner(gm, example_inputs, **kwargs):
        compiled = compile_fx_inner(gm, example_inputs, **kwargs)
        sources.append(compiled.source_code)
        return compiled

    torch._dynamo.reset()
    with torch.no_grad(), gs.no_compile_caches():
        torch.compile(model, backend=lambda gm, ex: compile_fx(gm, ex, inner_compile=inner))(x)
    torch._dynamo.reset()
    return sources[0]


def test_compile_processes_scale_with_the_machine():
    from tilesmith.agent.builtin.config_screen import compile_workers

    assert compile_workers(6, cpus=2) == 1 and compile_workers(6, cpus=16) == 4 and compile_workers(2, cpus=64) == 2


# -- ranking, composition, budget (stubbed search) ---------------------------------------------------------------
def _screen(name: str, source: str, ratio: float, graph_ms: float | None = None, status: str = "ok"):
    return VariantScreen(name=name, status=status, patches={"max_autotune": True}, compile_s=1.0, ratio=ratio,
                         original_ms=0.1, eager_ms=0.1 / ratio, graph_ms=graph_ms, source=source,
                         error=None if status == "ok" else "boom")


class _Graph:
    """A captured graph with a (fake) serialized FX module, so the configuration generator applies."""

    def __init__(self, graph):
        self.__dict__.update(graph.__dict__)
        self.fx_module = fxgraph.FxModule(payload=b"x", kwargs=(("is_inference", True),))


def config_session(tmp_path, source, **kw):
    s = FakeSession(captured_graph(source), tmp_path, **kw)
    s.graph = _Graph(s.graph)
    return s


def searcher_with(profile, calls):
    def search(source, device, timeout_s=None, **kwargs):
        calls.append(kwargs)
        return profile
    return search


def test_the_best_screened_variant_goes_to_the_gate_composed_with_a_cuda_graph_when_that_is_faster(tmp_path):
    src = fixture("mlp_fp32_infer__00")
    variant = src.replace("    def call(self, args):", "    def call(self, args):\n        pass  # variant", 1)
    other = src.replace("    def call(self, args):", "    def call(self, args):\n        pass  # other", 1)
    profile = Profile(eager_ms=0.100, graph_ms=0.090, variants=(
        _screen("max_autotune", variant, ratio=1.5, graph_ms=0.030), _screen("coordinate_descent", other, ratio=1.1),
        _screen("combo_kernels", other, ratio=0.9, status="failed")))
    calls: list = []
    s = config_session(tmp_path, src, decide=lambda p, t: "rejected_slower")
    opt = BuiltinOptimizer(agency="medium", searcher=searcher_with(profile, calls))
    opt.optimize(s)
    assert calls and calls[0]["variants"][0]["name"] == "max_autotune"
    proposers = [e[0] for e in s.evaluations]
    assert proposers[:2] == ["builtin:config:max_autotune+cudagraph", "builtin:config:max_autotune"]
    assert "builtin:config:coordinate_descent" not in proposers  # only the two best screened options are gated
    first = s.evaluations[0][2]
    assert MARKER in first and "# variant" in first
    history = dict(opt.history)
    assert history["config:coordinate_descent"].startswith("skipped: screened")
    assert history["config:combo_kernels"].startswith("skipped: failed")
    report = json.loads((tmp_path / "profiles" / "screen.json").read_text())
    assert [v["name"] for v in report["variants"]] == ["max_autotune", "coordinate_descent", "combo_kernels"]
    assert report["sent_to_gate"] == ["config:max_autotune+cudagraph", "config:max_autotune"]
    assert (tmp_path / "profiles" / "screen.txt").read_text().count("\n- ") >= 3


def test_an_accepted_variant_ends_loops_1_and_a_screen_slower_than_the_original_is_not_gated(tmp_path):
    src = fixture("mlp_fp32_infer__00")
    slow = src.replace("    def call(self, args):", "    def call(self, args):\n        pass  # slow", 1)
    fast = src.replace("    def call(self, args):", "    def call(self, args):\n        pass  # fast", 1)
    profile = Profile(eager_ms=0.100, graph_ms=0.099, capture_error=None, variants=(
        _screen("no_split_reductions", slow, ratio=0.8), _screen("max_autotune", fast, ratio=1.3)))
    s = config_session(tmp_path, src, decide=lambda p, t: "accepted")
    opt = BuiltinOptimizer(agency="medium", searcher=searcher_with(profile, []))
    opt.optimize(s)
    assert [e[0] for e in s.evaluations] == ["builtin:config:max_autotune"]
    assert opt.outcome.startswith("loops_done")


def test_the_budget_stops_before_a_gate_evaluation_with_a_diagnostic(tmp_path):
    src = fixture("mlp_fp32_infer__00")
    fast = src.replace("    def call(self, args):", "    def call(self, args):\n        pass  # fast", 1)
    profile = Profile(eager_ms=0.100, graph_ms=0.099, variants=(_screen("max_autotune", fast, ratio=1.3),))

    def slow_search(source, device, timeout_s=None, **kwargs):
        time.sleep(1.2)
        return profile

    s = config_session(tmp_path, src, decide=lambda p, t: "accepted")
    opt = BuiltinOptimizer(agency="medium", searcher=slow_search, budget_s=1.0)
    opt.optimize(s)
    assert s.evaluations == [] and opt.outcome == "budget"
    (note,) = [n for n in s.notes if n.kind == "builtin_budget"]
    assert "TILESMITH_GRAPH_BUDGET_S=1 s" in note.message and "config:max_autotune" in note.message


def test_the_search_deadline_leaves_room_for_the_gate(tmp_path):
    src = fixture("mlp_fp32_infer__00")
    calls: list = []
    s = config_session(tmp_path, src, decide=lambda p, t: "rejected_slower")
    BuiltinOptimizer(agency="medium", searcher=searcher_with(Profile(eager_ms=0.1, graph_ms=0.05), calls),
                     budget_s=100.0).optimize(s)
    assert calls[0]["deadline_s"] <= 100.0 - 2 * 15.0 + 1e-6


def test_graphs_without_a_serialized_fx_module_say_why_the_configuration_generator_does_not_apply(tmp_path):
    src = fixture("mlp_fp32_infer__00")
    s = FakeSession(captured_graph(src), tmp_path, decide=lambda p, t: "rejected_slower")
    opt = BuiltinOptimizer(agency="medium", searcher=searcher_with(Profile(eager_ms=0.1, graph_ms=0.099), []))
    opt.optimize(s)
    assert "not serialized" in dict(opt.history)["config"]


# -- end to end on CPU (test mode): capture → serialize → compile in the worker → screen → gate → install --------
def test_cpu_compile_proposes_a_configuration_variant_through_the_gate(cpu_test_mode, monkeypatch, tmp_path):
    import tilesmith

    monkeypatch.setenv("TILESMITH_ARTIFACT_CACHE", "0")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # no AOTAutograd hit from elsewhere
    torch._dynamo.reset()
    model, x = Small().eval(), torch.randn(16, 32)
    factory = BuiltinOptimizerFactory(agency="medium", gate_screened=True, budget_s=900)
    compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=factory)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
        torch.testing.assert_close(compiled(x * 2), model(x * 2))
    torch._dynamo.reset()
    runs = sorted((Path(cpu_test_mode) / "runs").glob("*/*/track.json"))
    assert len(runs) == 1
    track = json.loads(runs[0].read_text())
    evaluations = [e for e in track["evaluations"] if e["proposer"].startswith("builtin:config:")]
    assert evaluations, track["evaluations"]
    for e in evaluations:
        assert e["status"] == "accepted" or (e["status"].startswith("rejected_") and e["reasons"]), e
        assert e["status"] != "rejected_global_state" and "import_not_allowed" not in " ".join(e["reasons"]), e
    screen = json.loads((runs[0].parent / "profiles" / "screen.json").read_text())
    assert any(v["name"] == "cpp_wrapper" and v["status"] == "ok" for v in screen["variants"]), screen
    records = tilesmith.benchmarks(compiled)
    if any(e["status"] == "accepted" for e in evaluations):
        assert len(records) == 1 and track["status"] == "installed"
    else:
        assert records == () and track["status"] == "kept_inductor"
    # A second process-level compile gets the graph from the AOTAutograd cache, without inner_compile: the serialized
    # graph kept beside that cache still reaches the optimizer.
    seen: list = []

    class Probe:
        name = "probe"

        def for_graph(self, session):
            seen.append(session.graph.fx_module)
            return self

        def optimize(self, session):
            return None

        def close(self):
            return None

    torch._dynamo.reset()
    again = tilesmith.compile(model, example_inputs=(x,), agent_model=Probe())
    with torch.no_grad():
        torch.testing.assert_close(again(x), model(x))
    torch._dynamo.reset()
    assert len(seen) == 1 and seen[0] is not None and seen[0].payload


# -- the 'aten' variant: the graph's ATen operations as a wrapper (CPU: search worker, then the real gate) ------
class Strided(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.permute(1, 0, 2).sum(1), torch.relu(x) * 2


def test_the_aten_variant_is_screened_in_the_search_worker_and_judged_by_the_gate(tmp_path):
    from tilesmith.agent.builtin import aten_wrapper
    from tilesmith.agent.builtin.configs import Variant
    from tilesmith.agent.builtin.profile import run_search
    from tilesmith.capture.source import canonicalize
    from tilesmith.gate import Gate
    from tilesmith.gate.host.static_scan import scan
    from tilesmith.records import Candidate

    model, x = Strided(), torch.randn(64, 8, 32)
    (module,) = _capture(model, x)
    source = _wrapper_source(model, x)
    variant = Variant(aten_wrapper.NAME, ((aten_wrapper.MARKER, True),), "ATen operations")
    profile = run_search(source, "cpu", timeout_s=400, variants=[variant.request()], fx_module=module,
                         deadline_s=300, original_canonical=canonicalize(source), compile_workers=1)
    (screen,) = profile.variants
    assert screen.status == "ok", screen
    assert screen.ratio and screen.ratio > 0 and screen.screen_rel_l2 is not None and screen.screen_rel_l2 < 1e-5
    assert "torch.ops.aten.sum.dim_IntList" in screen.source and "async_compile" not in screen.source
    assert scan(screen.source) == []
    cap = gs.capture(model, x)[0]
    with Gate(gs.make_problem(cap, tmp_path / "snap", label="a7e40000 (aten)"), min_improvement=0.02) as gate:
        verdict = gate.evaluate(Candidate(source=screen.source, proposer="builtin:config:aten"))
    # Timing on a CPU decides nothing here; the checks must pass, so any rejection is a timing verdict.
    assert verdict.status in ("accepted", "rejected_slower", "rejected_marginal", "rejected_unconfirmed"), \
        (verdict.status, verdict.reasons)


def test_the_cpp_wrapper_variant_passes_the_gates_checks_including_its_imports(tmp_path):
    """The C++ host wrapper imports what the Python original does not (``CppWrapperCodeCache``): the gate's import
    guard admits it through the allow-list (docs/gate.md, "Imports")."""
    from tilesmith.agent.builtin.configs import Variant
    from tilesmith.agent.builtin.profile import run_search
    from tilesmith.capture.source import canonicalize
    from tilesmith.gate import Gate
    from tilesmith.records import Candidate

    model, x = Small().eval(), torch.randn(4, 32)
    (module,) = _capture(model, x)
    source = _wrapper_source(model, x)
    variant = Variant("cpp_wrapper", (("cpp_wrapper", True),), "C++ host wrapper")
    profile = run_search(source, "cpu", timeout_s=400, variants=[variant.request()], fx_module=module,
                         deadline_s=300, original_canonical=canonicalize(source), compile_workers=1)
    (screen,) = profile.variants
    assert screen.status == "ok", screen
    cap = gs.capture(model, x)[0]
    with Gate(gs.make_problem(cap, tmp_path / "snap", label="c99e0000 (cpp)"), min_improvement=0.02) as gate:
        verdict = gate.evaluate(Candidate(source=screen.source, proposer="builtin:config:cpp_wrapper"))
    assert "import_not_allowed" not in [f.check for f in verdict.failures], verdict.reasons
    assert verdict.status in ("accepted", "rejected_slower", "rejected_marginal", "rejected_unconfirmed"), \
        (verdict.status, verdict.reasons)


def test_the_aten_variant_refuses_graphs_it_cannot_run_and_outputs_of_another_layout():
    from torch.fx.experimental.proxy_tensor import make_fx

    from tilesmith.agent.builtin import aten_wrapper

    assert aten_wrapper.applies("torch.ops.aten.native_dropout.default(x, 0.1, True)")
    assert aten_wrapper.applies("torch.ops.aten.sum.dim_IntList(x, [1])") is None
    gm = make_fx(lambda x: (torch.rand_like(x) + x,))(torch.randn(4))
    with pytest.raises(aten_wrapper.NotApplicable, match="random"):
        aten_wrapper.wrapper_source(gm)
    def shadowing(call, x):
        return (call + x,)

    with pytest.raises(aten_wrapper.NotApplicable, match="shadow"):
        aten_wrapper.wrapper_source(torch.fx.symbolic_trace(shadowing))
    ok = make_fx(lambda x: (x.t().contiguous(),))(torch.randn(4, 3))
    assert "def call(args):" in aten_wrapper.wrapper_source(ok)
    a = torch.randn(4, 3)
    assert aten_wrapper.strides_differ([a], [a.t().contiguous().t()]).startswith("output 0 has strides")
    assert aten_wrapper.strides_differ([a], [a.clone()]) is None
    assert "2 outputs" in aten_wrapper.strides_differ([a], [a, a])


def test_the_cuda_portfolio_offers_the_aten_variant_except_for_random_graphs():
    names = [v.name for v in portfolio(fx("gpt2_block_bf16_infer__03"), fixture("gpt2_block_bf16_infer__03"),
                                       "cuda:0", "medium")[0]]
    assert names[-1] == "aten"
    _, skipped = portfolio("torch.ops.aten.native_dropout.default(x, 0.1, True)", "def call(args):\n    pass\n",
                           "cuda:0", "medium")
    assert "random" in skipped["aten"]
    _, low = portfolio(fx("gpt2_block_bf16_infer__03"), fixture("gpt2_block_bf16_infer__03"), "cuda:0", "low")
    assert "agency 'low'" in low["aten"]
