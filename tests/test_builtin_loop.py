"""The built-in agent's loop: order by expected gain, stop rules, building on the incumbent, CPU mode.

Stub generators isolate the loop logic; the real generators run against H200 wrapper text with a stubbed
search worker (``searcher=``) returning chosen measurements, since no GPU is available here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.builtin_fake_session import FakeSession, captured_graph
from tests.fixture_paths import fixture as fixture_path
from tilesmith.agent.builtin import BuiltinOptimizer, BuiltinOptimizerFactory
from tilesmith.agent.builtin.base import KernelTiming, Profile, Proposal, Skip
from tilesmith.agent.builtin.cudagraph import MARKER
from tilesmith.agent.builtin.profile import SearchFailed, parse_result, worker_environment
from tilesmith.agent.builtin.wrapper_text import triton_kernels
from tilesmith.capture.source import FX_HEADER, canonicalize

BASE = "# AOT ID: ['inference']\ndef call(args):\n    args.clear()\n    return ()\n"


class Stub:
    """A generator with a fixed expected gain that appends ``# <name>`` to the source it is given."""

    def __init__(self, name, gain=None, *, skip=None, inapplicable=None):
        self.name, self.gain, self.skip, self.reason = name, gain, skip, inapplicable
        self.seen: list[str] = []

    def inapplicable(self, source, ctx):
        return self.reason

    def expected_gain(self, source, ctx):
        return self.gain

    def propose(self, source, ctx):
        self.seen.append(source)
        if self.skip:
            raise Skip(self.skip)
        return Proposal(self.name, source + f"# {self.name}\n", f"stub {self.name}")


def session(tmp_path, *, source=BASE, device="cuda:0", decide=lambda proposer, text: "rejected_slower", **kw):
    return FakeSession(captured_graph(source, device=device), tmp_path, decide=decide, **kw)


def proposers(s):
    return [e[0] for e in s.evaluations]


def test_generators_are_proposed_in_order_of_expected_gain_then_exhausted(tmp_path):
    s = session(tmp_path)
    opt = BuiltinOptimizer(agency="medium", generators=[Stub("a", 0.05), Stub("b", 0.30), Stub("c", None)])
    opt.optimize(s)
    assert proposers(s) == ["builtin:b", "builtin:a", "builtin:c"]
    assert opt.outcome == "exhausted"
    assert [n.kind for n in s.notes] == ["builtin_exhausted"]
    assert "b: rejected_slower" in s.notes[0].message


def test_loop_stops_once_the_requested_loops_are_accepted(tmp_path):
    s = session(tmp_path, decide=lambda p, t: "accepted", loops=1)
    opt = BuiltinOptimizer(agency="medium", generators=[Stub("a", 0.2), Stub("b", 0.1)])
    opt.optimize(s)
    assert proposers(s) == ["builtin:a"]
    assert opt.outcome.startswith("loops_done") and s.notes == []


def test_a_later_loop_builds_on_the_accepted_incumbent(tmp_path):
    first, second = Stub("a", 0.2), Stub("b", 0.1)
    s = session(tmp_path, decide=lambda p, t: "accepted", loops=2)
    BuiltinOptimizer(agency="medium", generators=[first, second]).optimize(s)
    assert first.seen == [BASE]
    assert second.seen == [BASE + "# a\n"]
    assert s.evaluations[-1][2].endswith(BASE + "# a\n# b\n")


def test_a_rejected_candidate_does_not_become_the_base_of_the_next_one(tmp_path):
    first, second = Stub("a", 0.2), Stub("b", 0.1)
    s = session(tmp_path, decide=lambda p, t: "accepted" if p == "builtin:b" else "rejected_incorrect", loops=2)
    opt = BuiltinOptimizer(agency="medium", generators=[first, second])
    opt.optimize(s)
    assert second.seen == [BASE]
    assert opt.outcome == "exhausted" and opt.history == [("a", "rejected_incorrect"), ("b", "accepted")]


def test_attempt_files_keep_the_fx_header_the_ring_wrote(tmp_path):
    s = session(tmp_path)
    BuiltinOptimizer(agency="medium", generators=[Stub("a", 0.2)]).optimize(s)
    text = s.current_attempt().read_text()
    assert text.startswith(FX_HEADER) and text.count(FX_HEADER) == 1
    assert text.endswith(BASE + "# a\n")


def test_skips_inapplicable_unpromising_and_refusing_generators_without_evaluating(tmp_path):
    s = session(tmp_path)
    opt = BuiltinOptimizer(agency="medium", generators=[
        Stub("n", 0.5, inapplicable="not here"), Stub("tiny", 0.001), Stub("refuses", 0.3, skip="nothing to do")])
    opt.optimize(s)
    assert s.evaluations == [] and opt.outcome == "exhausted"
    assert dict(opt.history) == {"n": "skipped: not here", "tiny": "skipped: expected gain 0.1% below 1.0%",
                                 "refuses": "skipped: nothing to do"}


def test_turn_limit_ends_the_loop_with_its_reason(tmp_path):
    s = session(tmp_path, max_turns=1)
    opt = BuiltinOptimizer(agency="medium", generators=[Stub("a", 0.2), Stub("b", 0.1)])
    opt.optimize(s)
    assert proposers(s) == ["builtin:a"] and opt.outcome.startswith("turn_limit")


# -- real generators ------------------------------------------------------------------------------------
def fixture(name):
    return canonicalize(fixture_path(f"{name}.wrapper.py").read_text(), ("/tmp/torchinductor_root",))


def never_search(*args, **kwargs):
    raise AssertionError("the search worker must not run for this graph")


def test_cpu_graph_ends_exhausted_without_evaluating_or_searching(tmp_path):
    s = session(tmp_path, source=fixture_path("cpu_mlp_infer.wrapper.py").read_text(), device="cpu")
    opt = BuiltinOptimizerFactory(agency="medium", searcher=never_search).for_graph(s)
    opt.optimize(s)
    assert s.evaluations == [] and opt.outcome == "exhausted"
    reasons = dict(opt.history)
    assert set(reasons) == {"cudagraph", "launch_config", "wrapper_cleanup", "native_kernels", "config"}
    assert all(r.startswith("skipped: CPU graph") for k, r in reasons.items() if k != "config")
    assert "not serialized" in reasons["config"]  # the configuration generator's CPU path: test_builtin_configs
    assert [n.kind for n in s.notes] == ["builtin_exhausted"]


def profile_for(source, *, eager_ms, graph_ms, win=0.25, capture_error=None):
    """Measurements where the first non-default config of every kernel is ``win`` faster than the default."""
    kernels = {}
    for kernel in triton_kernels(source):
        if "triton_tem_" in kernel.var:
            continue
        base = {"XBLOCK": 1024, "num_warps": 4, "num_stages": 1}
        better = {"XBLOCK": 2048, "num_warps": 8, "num_stages": 1}
        kernels[kernel.var] = (KernelTiming(base, 0.010, True), KernelTiming(better, 0.010 * (1 - win), False))
    return Profile(eager_ms=eager_ms, graph_ms=graph_ms, capture_error=capture_error, kernels=kernels)


def searcher_returning(profile, calls):
    def search(source, device, timeout_s=None):
        calls.append((device, timeout_s))
        return profile
    return search


def test_host_bound_graph_gets_cudagraph_first_then_pins_on_top_of_it(tmp_path):
    src = fixture("mlp_fp32_infer__00")
    calls = []
    s = session(tmp_path, source=src, decide=lambda p, t: "accepted", loops=2)
    opt = BuiltinOptimizer(agency="medium", searcher=searcher_returning(
        profile_for(src, eager_ms=0.100, graph_ms=0.030), calls))
    opt.optimize(s)
    assert len(calls) == 1 and calls[0][0] == "cuda:0"
    assert proposers(s) == ["builtin:cudagraph", "builtin:launch_config"]
    final = s.evaluations[-1][2]
    assert MARKER in final and final.count("@triton_heuristics.fixed_config(") == 2
    assert opt.outcome.startswith("loops_done")


def test_gpu_bound_graph_skips_cudagraph_and_cleanup_but_pins_launch_configs(tmp_path):
    src = fixture("gpt2_block_bf16_infer__03")
    s = session(tmp_path, source=src)
    opt = BuiltinOptimizer(agency="medium", searcher=searcher_returning(
        profile_for(src, eager_ms=1.00, graph_ms=0.99, win=0.5), []))
    opt.optimize(s)
    assert proposers(s) == ["builtin:launch_config"]
    assert "pinned 4 kernel launch configurations" in s.evaluations[0][3]
    history = dict(opt.history)
    assert history["cudagraph"].startswith("skipped: expected gain")
    assert history["wrapper_cleanup"].startswith("skipped: expected gain")


def test_failed_search_is_noted_and_the_unmeasured_generators_still_run(tmp_path):
    def failing(source, device, timeout_s=None):
        raise SearchFailed("the search worker exited with status 1: boom")

    s = session(tmp_path, source=fixture("mlp_fp32_infer__00"))
    opt = BuiltinOptimizer(agency="medium", searcher=failing)
    opt.optimize(s)
    assert proposers(s) == ["builtin:cudagraph", "builtin:wrapper_cleanup"]
    assert [n.kind for n in s.notes] == ["builtin_search_failed", "builtin_exhausted"]
    assert "boom" in dict(opt.history)["launch_config"]


def test_low_agency_and_uncapturable_graphs_skip_cudagraph(tmp_path):
    src = fixture("mlp_fp32_infer__00")
    for agency, capture_error, why in (("low", None, "agency 'low'"), ("medium", "RuntimeError: nonzero", "nonzero")):
        s = session(tmp_path / agency, source=src, agency=agency)
        opt = BuiltinOptimizerFactory(agency="high", searcher=searcher_returning(
            profile_for(src, eager_ms=0.1, graph_ms=0.09, capture_error=capture_error), [])).for_graph(s)
        opt.optimize(s)
        assert "builtin:cudagraph" not in proposers(s)
        assert why in dict(opt.history)["cudagraph"]


def test_factory_needs_no_model_and_reports_no_calls():
    factory = BuiltinOptimizerFactory(agency="medium", max_model_calls=3)
    assert factory.name == "tilesmith/builtin" and factory.calls_used() == (0, None)
    factory.close()


def test_search_worker_environment_has_no_provider_keys_or_secrets(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-secret")
    monkeypatch.setenv("TILESMITH_API_KEY", "ts-secret")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/some/cache")
    env = worker_environment("cuda:0")
    assert "OPENAI_API_KEY" not in env and "TILESMITH_API_KEY" not in env
    assert "sk-test-secret" not in env.values() and env["TORCHINDUCTOR_CACHE_DIR"] == "/some/cache"


def test_search_result_parsing_keeps_defaults_apart_and_rejects_empty_results():
    profile = parse_result({"eager_ms": 0.1, "graph_ms": None, "capture_error": "x", "kernels": {
        "k": [{"config": {"XBLOCK": 8, "num_warps": 2, "num_stages": 1}, "ms": 0.01, "default": True}]}})
    assert profile.graph_ms is None and profile.capture_error == "x"
    assert profile.kernels["k"][0].default and profile.kernels["k"][0].config["XBLOCK"] == 8
    with pytest.raises(SearchFailed, match="measured nothing: boom"):
        parse_result({"errors": ["boom"]})


def test_search_worker_process_failure_becomes_search_failed_with_its_reason():
    from tilesmith.agent.builtin.profile import run_search

    with pytest.raises(SearchFailed, match="has no attribute 'call'"):
        run_search("x = 1\n", "cuda:0", timeout_s=300)


def test_compile_on_cpu_without_the_configuration_generator_keeps_inductor_and_says_exhausted(tmp_path, monkeypatch):
    """The CUDA-only generators on a CPU graph (the configuration generator's CPU path: test_builtin_configs)."""
    import tilesmith
    import tilesmith.gate as gate

    if not hasattr(gate, "Gate"):
        pytest.skip("the host gate (tilesmith.gate.Gate) is not in this checkout yet")
    from tests.models import TwoLayer

    monkeypatch.setenv("TILESMITH_CACHE_DIR", str(tmp_path / "ts"))
    monkeypatch.setenv("TILESMITH_ALLOW_CPU", "1")
    torch._dynamo.reset()
    model, x = TwoLayer().eval(), torch.randn(8, 64)
    compiled = tilesmith.compile(model, example_inputs=(x,),
                                 agent_model=BuiltinOptimizerFactory(agency="medium", configs=False))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    kinds = [d.kind for d in tilesmith.diagnostics(compiled)]
    assert "builtin_exhausted" in kinds and tilesmith.benchmarks(compiled) == ()
    torch._dynamo.reset()
