"""The configuration generator on a real GPU: the search worker compiles a GEMM graph and a reduction graph again
under the CUDA portfolio, screens each variant, pins the autotuned launch configurations, and every ``ok`` variant
(alone and with the CUDA-graph runtime on top) passes the static scan, loads like Inductor's own wrappers and
matches the original. Screen numbers are printed (``-s``), never asserted.

    python -m pytest -q -s -m gpu tests/gpu/test_configs_gpu.py
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


class GemmBlock(torch.nn.Module):
    def __init__(self, d: int = 1024, h: int = 4096):
        super().__init__()
        self.fc1, self.fc2, self.ln = torch.nn.Linear(d, h), torch.nn.Linear(h, d), torch.nn.LayerNorm(d)

    def forward(self, x):
        return self.ln(x + self.fc2(torch.nn.functional.gelu(self.fc1(x))))


class Softmax(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(x * 0.125, dim=-1)


def _capture(model: torch.nn.Module, x: torch.Tensor) -> Any:
    from tilesmith.capture.backend import TilesmithBackend
    from tilesmith.capture.graph import captured_graph

    seen: list[Any] = []

    def sink(compiled, fx, example_inputs, kwargs):
        seen.append(captured_graph(compiled, fx, example_inputs, kwargs))

    torch._dynamo.reset()
    with torch.no_grad(), torch._functorch.config.patch(enable_autograd_cache=False):
        torch.compile(model, backend=TilesmithBackend(sink))(x)
    torch._dynamo.reset()
    (graph,) = seen
    assert graph.fx_module is not None, "the FX graph was not serialized"
    return graph


def _load(source: str) -> Any:
    from torch._inductor.codecache import PyCodeCache

    key, path = PyCodeCache.write(source)
    return PyCodeCache.load_by_key_path(key, path, [], {})


@pytest.mark.parametrize("case", ["gemm_bf16", "softmax_fp32"])
def test_portfolio_variants_compile_screen_pin_and_match_the_original(case):
    from tilesmith.agent.builtin.configs import portfolio
    from tilesmith.agent.builtin.cudagraph import cudagraph_source
    from tilesmith.agent.builtin.profile import run_search
    from tilesmith.gate.host.static_scan import scan

    torch.manual_seed(0)
    if case == "gemm_bf16":
        model, x = GemmBlock().cuda().to(torch.bfloat16).eval(), torch.randn(256, 1024, device="cuda",
                                                                            dtype=torch.bfloat16)
    else:
        model, x = Softmax(), torch.randn(4096, 8192, device="cuda")
    graph = _capture(model, x)
    variants, skipped = portfolio(graph.fx_program, graph.canonical_source, graph.device, "medium")
    profile = run_search(graph.canonical_source, graph.device, timeout_s=400, variants=[v.request() for v in variants],
                         fx_module=graph.fx_module, deadline_s=300, original_canonical=graph.canonical_source)
    print(f"\n{case}: original eager {profile.eager_ms:.4f} ms, graph {profile.graph_ms} ms; not applicable: {skipped}")
    assert profile.eager_ms and len(profile.variants) == len(variants)
    ok = [s for s in profile.variants if s.status == "ok"]
    for s in profile.variants:
        print(f"  {s.name}: {s.status} ratio={s.ratio} eager={s.eager_ms} graph={s.graph_ms} compile={s.compile_s} s "
              f"pinned={s.pinned_kernels} unpinned={s.unpinned_kernels} {s.error or ''}")
        assert s.status in {"ok", "identical", "failed", "incorrect"}
    assert ok, "no variant compiled and screened"
    original = _load(graph.canonical_source)
    args = original.get_args()
    expected = original.call(list(args))
    for s in ok:
        for text in (s.source, cudagraph_source(s.source, device=graph.device)):
            assert scan(text) == [], (s.name, scan(text))
            module = _load(text)
            for _ in range(3):  # the CUDA-graph runtime runs eagerly, captures, then replays
                got = module.call(list(args))
            torch.cuda.synchronize()
            for e, g in zip(expected, got):
                torch.testing.assert_close(g.float(), e.float(), rtol=2e-2, atol=2e-2)
        if s.pinned_kernels:
            assert "@triton_heuristics.fixed_config(" in s.source
