"""The 'native_kernels' generator's rewrite (tilesmith/agent/builtin/native.py), its gate allowances and its loop.

- Text: the H200 softmax wrapper rewritten with the plan of its FX program minus the final sigmoid (a
  matching graph with the same inputs and one output): parses, keeps ``call(args)`` with Inductor's unpacking,
  ``args.clear()`` and asserts, calls the native module, drops the now-unused Triton kernel, passes the
  static scan; the scan still flags every other way of reaching ``tilesmith``.
- Behaviour: real CPU Inductor wrappers of matching graphs, rewritten (``allow_cpu``) and run with the torch
  reference of the native module (tests/native_reference.py) standing in for the CUDA build: the outputs
  equal the original wrapper's (this checks the argument order, literals and the list-result mapping).
- The generator through the built-in loop with a fake session and a fake build.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests import native_reference
from tests.builtin_fake_session import FakeSession, captured_graph
from tests.fixture_paths import H200
from tilesmith.agent.builtin.base import GraphContext, Profile, Skip
from tilesmith.agent.builtin.cudagraph import cudagraph_source
from tilesmith.agent.builtin.native import BEGIN, NAME, NativeKernelGenerator, native_source
from tilesmith.agent.builtin.native_match import match_program
from tilesmith.agent.builtin.optimizer import BuiltinOptimizer, default_generators
from tilesmith.gate.host.static_scan import scan

KEY = SimpleNamespace(family="softmax", key="ab" * 32, arch="sm_90a", torch_version="2.11.0+cu130",
                      nvcc_version="Cuda compilation tools, release 13.0, V13.0.88")
SOFTMAX_WRAPPER = (H200 / "softmax_bias_bf16_infer__06.wrapper.py").read_text()


def softmax_fx() -> str:
    fx = (H200 / "softmax_bias_bf16_infer__06.fx.txt").read_text()
    return fx[:fx.index("        sigmoid:")] + "        return (convert_element_type_1,)\n"


def call_body(source: str) -> ast.FunctionDef:
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Runner")
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "call")


def statements(source: str, fn: ast.FunctionDef, names: tuple[str, ...]) -> list[str]:
    return [ast.get_source_segment(source, s) for s in fn.body
            if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) and ast.unparse(s.value.func) in names]


@pytest.fixture(scope="module")
def rewritten() -> str:
    return native_source(SOFTMAX_WRAPPER, match_program(softmax_fx()), KEY, input_count=2)


def test_rewrite_keeps_the_abi_unpacking_clear_and_asserts(rewritten):
    before, after = call_body(SOFTMAX_WRAPPER), call_body(rewritten)
    assert ast.unparse(after.args) == ast.unparse(before.args) == "self, args"
    assert ast.unparse(after.body[0]) == ast.unparse(before.body[0]) == "arg0_1, arg1_1 = args"
    assert ast.unparse(after.body[1]) == "args.clear()"
    keep = ("assert_size_stride", "assert_alignment")
    assert statements(rewritten, after, keep) == statements(SOFTMAX_WRAPPER, before, keep) != []
    assert "call = runner.call" in rewritten and ast.parse(rewritten)
    assert ast.unparse(after.body[-1]) == "return (buf_native,)"


def test_rewrite_calls_the_native_module_inside_the_device_guard(rewritten):
    body = ast.unparse(call_body(rewritten))
    assert "with torch.cuda._DeviceGuard(0):" in body and "torch.cuda.set_device(0)" in body
    assert "buf_native = _tilesmith_native_softmax.softmax(arg0_1, None, 0.125, arg1_1, 1.0, None, 0)" in body
    assert "from tilesmith.kernels.runtime import native_module" in rewritten
    assert f"_tilesmith_native_softmax = native_module('softmax', '{KEY.key}')" in rewritten
    assert rewritten.index(BEGIN) < rewritten.index("class Runner:")


def test_rewrite_drops_the_unused_triton_kernel_and_its_comments(rewritten):
    name = "triton_red_fused__softmax_add_exp_mul_prepare_softmax_online_sigmoid_sub_0"
    assert name in SOFTMAX_WRAPPER and name not in rewritten
    assert "async_compile.triton(" not in rewritten and "# kernel path:" not in rewritten
    assert "async_compile.wait(globals())" in rewritten  # Inductor's module structure is otherwise kept


def test_rewrite_passes_the_static_scan(rewritten):
    assert scan(rewritten) == []


@pytest.mark.parametrize("line", [
    "import tilesmith.kernels.runtime",
    "from tilesmith.kernels.runtime import native_module as nm",
    "from tilesmith.kernels import runtime",
    "from tilesmith.kernels.runtime import native_module, kernel_dir",
    "from tilesmith.kernels.build import ensure_built",
    "from tilesmith import settings",
])
def test_every_other_tilesmith_import_is_still_flagged(rewritten, line):
    edited = rewritten.replace("from tilesmith.kernels.runtime import native_module\n",
                               f"from tilesmith.kernels.runtime import native_module\n{line}\n")
    assert "static_introspection" in {f.rule for f in scan(edited)}, line


def test_native_and_cudagraph_rewrites_compose_both_ways(rewritten):
    graph_then_native = native_source(cudagraph_source(SOFTMAX_WRAPPER, device="cuda:0"), match_program(softmax_fx()),
                                      KEY, input_count=2)
    native_then_graph = cudagraph_source(rewritten, device="cuda:0")
    for text in (graph_then_native, native_then_graph):
        ast.parse(text)
        assert "class _TilesmithCUDAGraphCall" in text and "_tilesmith_native_softmax.softmax(" in text
        assert scan(text) == []


def test_rewrite_skips_what_it_cannot_handle(rewritten):
    plan = match_program(softmax_fx())
    with pytest.raises(Skip, match="already calls a native kernel"):
        native_source(rewritten, plan, KEY)
    with pytest.raises(Skip, match="reduce-overhead"):
        native_source((H200 / "reduce_overhead_mlp__10.wrapper.py").read_text(), plan, KEY)
    with pytest.raises(Skip, match="unpacks 2 arguments, the FX program has 3"):
        native_source(SOFTMAX_WRAPPER, plan, KEY, input_count=3)
    with pytest.raises(Skip, match="returns"):
        native_source((H200 / "mlp_fp32_train__01.wrapper.py").read_text(), plan, KEY)
    with pytest.raises(Skip, match="C\\+\\+ wrapper"):
        native_source(SOFTMAX_WRAPPER + "\n# cpp_wrapper_src\n", plan, KEY)


# -------------------------------------------------------------------------------- CPU wrappers, executed

def _rms_llama(x, r, w):
    h = x + r
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w, h


class _Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


CPU_CASES = {
    "rms_llama_returns_sum": (_rms_llama, lambda: (torch.randn(8, 256, dtype=torch.bfloat16),
                                                   torch.randn(8, 256, dtype=torch.bfloat16),
                                                   torch.randn(256, dtype=torch.bfloat16))),
    "softmax_scaled_two": (lambda a, b, c: torch.softmax(a * 0.5, -1) + torch.softmax(b * 2.0 + c, -1),
                           lambda: (torch.randn(4, 64), torch.randn(4, 64), torch.randn(64))),
    "int8_linear": (lambda x, w, s, r: r + (x @ w.to(torch.bfloat16).T) * s,
                    lambda: (torch.randn(2, 64, dtype=torch.bfloat16), torch.randint(-127, 127, (32, 64), dtype=torch.int8),
                             torch.rand(32, dtype=torch.bfloat16), torch.randn(2, 32, dtype=torch.bfloat16))),
    "group_norm_silu": (lambda x, w, b: torch.nn.functional.silu(torch.nn.functional.group_norm(x, 4, w, b, 1e-5)),
                        lambda: (torch.randn(2, 16, 6, 6, dtype=torch.bfloat16) * 3 + 1,
                                 torch.rand(16, dtype=torch.bfloat16) + 0.5, torch.randn(16, dtype=torch.bfloat16))),
    "group_norm_fp32_no_affine": (lambda x: torch.nn.functional.group_norm(x, 2, None, None, 1e-6),
                                  lambda: (torch.randn(3, 4, 5, 7),)),
}


@pytest.mark.parametrize("name", sorted(CPU_CASES))
def test_rewritten_cpu_wrapper_computes_what_the_original_computes(name, monkeypatch, cpu_test_mode):
    from bench.harness import Workload, capture_graphs
    from tests import gate_support as gs
    from tilesmith.install.loader import load_wrapper
    from tilesmith.kernels import runtime

    fn, make = CPU_CASES[name]
    torch.manual_seed(0)
    inputs = make()
    fx = capture_graphs(Workload(_Fn(fn), inputs))[0].fx_program
    plan = match_program(fx)
    cap = gs.capture(_Fn(fn), *inputs)[0]
    source = native_source(cap.source, plan, KEY, device="cpu", allow_cpu=True, input_count=len(cap.inputs))
    assert scan(source) == []
    seen = []
    monkeypatch.setattr(runtime, "native_module", lambda family, key: seen.append((family, key)) or native_reference)
    module = load_wrapper(source, cap.constants)
    assert seen == [(plan.family, KEY.key)]
    got = module.call([t.clone() for t in cap.inputs])
    want = cap.ref_fn([t.clone() for t in cap.inputs])
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype and g.stride() == w.stride()
        tol = {"rtol": 1.6e-2, "atol": 1e-2} if w.dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-5}
        torch.testing.assert_close(g, w, **tol)


def test_group_norm_rewrite_is_one_native_call_with_the_plan_arguments(cpu_test_mode):
    import re

    from bench.harness import Workload, capture_graphs
    from tests import gate_support as gs

    fn, make = CPU_CASES["group_norm_silu"]
    inputs = make()
    plan = match_program(capture_graphs(Workload(_Fn(fn), inputs))[0].fx_program)
    cap = gs.capture(_Fn(fn), *inputs)[0]
    key = SimpleNamespace(**{**vars(KEY), "family": "group_norm"})
    source = native_source(cap.source, plan, key, device="cpu", allow_cpu=True, input_count=len(cap.inputs))
    call = re.search(r"buf_native = _tilesmith_native_group_norm\.group_norm\((\w+), (\w+), (\w+), 4, 1e-05, True, "
                     r"False, 0\)", source)
    assert call, source
    names = [cap.source[m.start():m.end()] for m in re.finditer(r"arg\d+_1", cap.source)]
    assert set(call.groups()) <= set(names) and len(set(call.groups())) == 3
    assert f"_tilesmith_native_group_norm = native_module('group_norm', {KEY.key!r})" in source
    assert "# Tilesmith native kernel (group_norm.group_norm): silu(GroupNorm(4, 16))" in source
    assert scan(source) == []


# ------------------------------------------------------------------------------------ generator and loop

def _fake_build(calls, fail=None):
    def build(family, device):
        calls.append((family, device))
        if fail is not None:
            raise fail
        return SimpleNamespace(key=KEY, module=None, built=True, seconds=12.5, directory=Path("/nonexistent"))
    return build


def _ctx(device="cuda:0", **kw):
    return GraphContext(device=device, agency=kw.pop("agency", "medium"), fx_program=kw.pop("fx", softmax_fx()), **kw)


def test_generator_applies_only_to_cuda_matching_graphs_it_may_build(monkeypatch):
    gen = NativeKernelGenerator(build=_fake_build([]))
    assert "CPU graph" in gen.inapplicable(SOFTMAX_WRAPPER, _ctx("cpu"))
    assert "agency 'low'" in gen.inapplicable(SOFTMAX_WRAPPER, _ctx(agency="low"))
    other = (H200 / "gpt2_block_bf16_infer__03.fx.txt").read_text()
    assert gen.inapplicable(SOFTMAX_WRAPPER, _ctx(fx=other)).startswith("no native kernel pattern (int8_linear:")
    assert gen.inapplicable(SOFTMAX_WRAPPER, _ctx()) is None
    monkeypatch.setenv("TILESMITH_NATIVE_KERNELS", "0")
    assert "TILESMITH_NATIVE_KERNELS=0" in gen.inapplicable(SOFTMAX_WRAPPER, _ctx())


def test_generator_without_a_toolchain_is_inapplicable(monkeypatch):
    from tilesmith.kernels import build

    error = build.KernelBuildError("*", "no CUDA toolkit found: torch.utils.cpp_extension has no CUDA_HOME")
    monkeypatch.setattr(build, "find_toolchain", lambda refresh=False: (_ for _ in ()).throw(error))
    reason = NativeKernelGenerator().inapplicable(SOFTMAX_WRAPPER, _ctx())
    assert reason.startswith("no toolchain to build the native kernels: no CUDA toolkit found")


def test_expected_gain_is_the_roofline_estimate_against_the_profile():
    limits = SimpleNamespace(copy_gbps=4000.0)
    gen = NativeKernelGenerator(build=_fake_build([]), limits=limits)
    assert gen.expected_gain(SOFTMAX_WRAPPER, _ctx()) is None  # no profile
    plan = match_program(softmax_fx())
    predicted = plan.bytes_moved / 4e12 * 1e3 / 0.8 + 0.006
    for eager in (0.2, 0.1, predicted / 2):
        ctx = _ctx(profile=Profile(eager_ms=eager, graph_ms=eager))
        assert gen.expected_gain(SOFTMAX_WRAPPER, ctx) == pytest.approx(max(0.0, 1 - predicted / eager))


def test_build_failure_is_a_skip_with_the_diagnostic():
    from tilesmith.kernels.build import KernelBuildError

    calls = []
    error = KernelBuildError("softmax", "native kernel 'softmax' (abab) failed to build: nvcc fatal. Full output: x.log")
    gen = NativeKernelGenerator(build=_fake_build(calls, fail=error))
    with pytest.raises(Skip, match="native kernel build failed: native kernel 'softmax' .* failed to build"):
        gen.propose(SOFTMAX_WRAPPER, _ctx())
    assert calls == [("softmax", "cuda:0")]


def test_loop_proposes_the_native_candidate_with_its_build_note(tmp_path):
    graph = captured_graph(SOFTMAX_WRAPPER)
    graph = graph.__class__(**{**graph.__dict__, "fx_program": softmax_fx()})
    session = FakeSession(graph, tmp_path, decide=lambda proposer, text: "accepted")
    calls = []
    optimizer = BuiltinOptimizer(agency="medium", generators=[NativeKernelGenerator(build=_fake_build(calls))],
                                 searcher=lambda *a, **k: Profile(eager_ms=1.0, graph_ms=1.0))
    optimizer.optimize(session)
    assert calls == [("softmax", "cuda:0")]
    proposer, status, text, note = session.evaluations[0]
    assert (proposer, status) == (f"builtin:{NAME}", "accepted")
    assert "_tilesmith_native_softmax.softmax(arg0_1, None, 0.125, arg1_1, 1.0, None, 0)" in text
    assert "built in 12.5 s (first build on this machine)" in note and "softmax(a * 0.125 + bias)" in note


def test_native_generator_is_last_in_the_default_order():
    names = [g.name for g in default_generators()]
    assert names[-1] == NAME and names[:3] == ["cudagraph", "launch_config", "wrapper_cleanup"]
