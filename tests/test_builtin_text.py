"""Source transformations of the built-in agent's generators on real H200 Inductor wrappers (text only).

The CUDA wrappers cannot run here; these tests check what can be checked on text: the candidate parses,
keeps a ``call`` entry point whose body (and return tuple) is Inductor's, leaves every kernel and extern
call as it was except where a generator says it changed something, and pins exactly the configurations
it claims (the pinned kernel source is executed to build Inductor's ``CachingAutotuner``).
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

from tests.fixture_paths import fixture
from tilesmith.agent.builtin import cleanup, launch_config
from tilesmith.agent.builtin.base import KernelTiming, Skip
from tilesmith.agent.builtin.cudagraph import MARKER, cudagraph_source
from tilesmith.agent.builtin.wrapper_text import parse_entry, triton_kernels, written_inputs
from tilesmith.capture.source import canonicalize

CUDA_CASES = ["mlp_fp32_infer__00", "mlp_fp32_train__01", "mlp_fp32_train__02", "gpt2_block_bf16_infer__03",
              "gpt2_block_bf16_maxautotune__04", "conv_bf16_cl_infer__05", "softmax_bias_bf16_infer__06"]


def wrapper(name: str) -> str:
    """The fixture in canonical form (what sessions hand to optimizers)."""
    return canonicalize(fixture(f"{name}.wrapper.py").read_text(), ("/tmp/torchinductor_root",))


def body_source(source: str) -> str:
    tree = ast.parse(source)
    runner = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Runner")
    call = next(n for n in runner.body if isinstance(n, ast.FunctionDef) and n.name == "call")
    return ast.get_source_segment(source, call)


def extern_lines(source: str) -> list[str]:
    return [line.strip() for line in source.splitlines() if "extern_kernels." in line or "torch.ops.aten." in line]


def top_level_call(source: str) -> ast.FunctionDef | None:
    tree = ast.parse(source)
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "call"]
    return defs[-1] if defs else None


# -- cudagraph ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CUDA_CASES)
def test_cudagraph_candidate_parses_and_keeps_body_kernels_and_return_arity(name):
    src = wrapper(name)
    out = cudagraph_source(src)
    ast.parse(out)
    assert body_source(out) == body_source(src)
    assert parse_entry(out).return_items == parse_entry(src).return_items
    assert [k.source for k in triton_kernels(out)] == [k.source for k in triton_kernels(src)]
    assert extern_lines(src) and extern_lines(out)[: len(extern_lines(src))] == extern_lines(src)
    entry = top_level_call(out)
    assert entry is not None and [a.arg for a in entry.args.args] == ["args"]
    # the module-level `call` used by benchmark_compiled_module is the new one (defined after runner.call)
    assert out.index("def call(args):") > out.index("call = runner.call")
    assert "_TilesmithCUDAGraphCall(runner.call, device='cuda:0'" in out


def test_cudagraph_marks_the_in_place_reused_saved_activation_of_the_backward_as_written():
    src = wrapper("mlp_fp32_train__02")
    entry = parse_entry(src)
    assert entry.input_names[6] == "addmm_1"
    assert written_inputs(src, entry) == (6,)
    assert "written_inputs=(6,)" in cudagraph_source(src)


def test_cudagraph_keeps_returned_inputs_of_the_training_forward_in_the_body_return():
    src = wrapper("mlp_fp32_train__01")
    items = parse_entry(cudagraph_source(src)).return_items
    assert items is not None and len(items) == 10
    assert {"primals_1", "primals_3", "primals_4", "primals_6"} <= set(items)
    assert written_inputs(src, parse_entry(src)) == ()


def test_cudagraph_written_inputs_include_graph_mutations_and_direct_kernel_writes():
    src = wrapper("mlp_fp32_infer__00")
    # make the Triton epilogue write straight into input 1 (its in_out_ptr0 parameter)
    mutated = src.replace("triton_poi_fused_addmm_gelu_0.run(buf1, arg1_1,", "triton_poi_fused_addmm_gelu_0.run(arg1_1, buf1,")
    assert mutated != src
    assert written_inputs(mutated, parse_entry(mutated)) == (1,)
    assert written_inputs(src, parse_entry(src), mutated_input_idxs=(3,)) == (3,)


@pytest.mark.parametrize(("edit", "reason"), [
    (lambda s: s, "already replays"),
    (lambda s: s.replace("buf0 = empty_strided_cuda((64, 4096)",
                         "seed = torch.ops.prims.inductor_seeds.default(1, device(type='cuda', index=0))\n"
                         "            buf0 = empty_strided_cuda((64, 4096)"), "random numbers"),
    (lambda s: s.replace("del arg0_1\n", "arg0_1.sum().item()\n            del arg0_1\n", 1), "synchronises"),
])
def test_cudagraph_skips_sources_it_cannot_handle_with_the_reason(edit, reason):
    src = wrapper("mlp_fp32_infer__00")
    src = cudagraph_source(src) if reason == "already replays" else edit(src)
    with pytest.raises(Skip, match=reason):
        cudagraph_source(src)


def test_cudagraph_skips_reduce_overhead_partitions_and_cpu_wrappers():
    with pytest.raises(Skip, match="partitions"):
        cudagraph_source(wrapper("reduce_overhead_mlp__10"))
    with pytest.raises(Skip, match="CPU graph"):
        cudagraph_source(fixture("cpu_mlp_infer.wrapper.py").read_text())


def test_cudagraph_rewrites_a_pre_runner_top_level_call():
    src = wrapper("softmax_bias_bf16_infer__06")
    body = body_source(src)
    old_style = src.replace("class Runner:", "class _Unused:").replace("call = runner.call\n", "")
    old_style = old_style.replace("runner = Runner(partitions=[])\n", "")
    lines = [line[4:] if line.startswith("    ") else line for line in body.splitlines()]
    old_style = old_style.replace("recursively_apply_fns = runner.recursively_apply_fns\n",
                                  "\n".join(lines).replace("def call(self, args):", "def call(args):") + "\n")
    out = cudagraph_source(old_style)
    ast.parse(out)
    assert "_tilesmith_eager_call = call" in out
    assert "_TilesmithCUDAGraphCall(_tilesmith_eager_call, device='cuda:0'" in out


# -- launch_config --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CUDA_CASES)
def test_launch_config_plans_power_of_two_configs_with_inductor_defaults_first(name):
    plans, skipped = launch_config.plan_search(wrapper(name))
    kernels = {k.var for k in triton_kernels(wrapper(name))}
    assert {p.var for p in plans} | set(skipped) == kernels
    for plan in plans:
        assert 1 <= plan.n_default <= len(plan.configs) <= launch_config.MAX_CONFIGS
        assert len({tuple(sorted(c.items())) for c in plan.configs}) == len(plan.configs)
        for cfg in plan.configs:
            assert cfg["num_warps"] >= 1 and cfg["num_stages"] >= 1
            for key, value in cfg.items():
                if key.endswith("BLOCK"):
                    assert value >= 1 and value & (value - 1) == 0, (plan.var, cfg)


def test_launch_config_leaves_max_autotune_templates_alone():
    plans, skipped = launch_config.plan_search(wrapper("gpt2_block_bf16_maxautotune__04"))
    templates = {k.var for k in triton_kernels(wrapper("gpt2_block_bf16_maxautotune__04")) if "triton_tem_" in k.var}
    assert len(templates) == 4 and set(skipped) == templates
    assert all("template" in reason for reason in skipped.values())
    assert not templates & {p.var for p in plans}


def test_launch_config_offers_a_whole_row_block_to_the_looped_softmax_reduction():
    (plan,), _ = launch_config.plan_search(wrapper("softmax_bias_bf16_infer__06"))
    assert plan.kind == "reduction"
    assert any(c.get("R0_BLOCK") == 4096 for c in plan.configs)  # one loop iteration: persistent behaviour
    assert any(c.get("R0_BLOCK", 0) < 4096 for c in plan.configs)


@pytest.mark.parametrize("name", ["mlp_fp32_infer__00", "gpt2_block_bf16_infer__03", "softmax_bias_bf16_infer__06"])
def test_search_source_lists_every_planned_config_and_disables_inductor_retuning(name):
    src = wrapper(name)
    plans, _ = launch_config.plan_search(src)
    out = launch_config.search_source(src, plans)
    ast.parse(out)
    assert body_source(out) == body_source(src)
    by_var = {k.var: k for k in triton_kernels(out)}
    for plan in plans:
        text = by_var[plan.var].source
        ast.parse(text)
        assert text.count("triton.Config(") == len(plan.configs)
        assert "'coordinate_descent_tuning': False" in text and "'autotune_local_cache': False" in text


def _load_kernel(text: str, path: Path, monkeypatch):
    from torch._inductor.runtime import triton_helpers

    monkeypatch.setattr(triton_helpers, "set_driver_to_gpu", lambda: None)  # no GPU here; nothing compiles
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"tilesmith_test_kernel_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pin_source_fixes_exactly_the_claimed_configs_and_leaves_the_rest_byte_identical(tmp_path, monkeypatch):
    src = wrapper("gpt2_block_bf16_infer__03")
    kernels = triton_kernels(src)
    pins = {kernels[0].var: {"XBLOCK": 4, "num_warps": 4, "num_stages": 1},
            kernels[2].var: {"XBLOCK": 2048, "num_warps": 8, "num_stages": 1}}
    out = launch_config.pin_source(src, pins)
    ast.parse(out)
    assert body_source(out) == body_source(src)
    assert extern_lines(out) == extern_lines(src)
    new = {k.var: k for k in triton_kernels(out)}
    for kernel in kernels:
        if kernel.var not in pins:
            assert new[kernel.var].source == kernel.source
            continue
        text = new[kernel.var].source
        assert "@triton_heuristics.fixed_config(" in text and "@triton_heuristics.persistent_reduction(" not in text
        jit_body = text[text.index("@triton.jit"):]
        assert jit_body == kernel.source[kernel.source.index("@triton.jit"):]
        autotuner = getattr(_load_kernel(text, tmp_path / f"{kernel.var}.py", monkeypatch), kernel.name)
        (config,) = autotuner.configs
        expected = dict(pins[kernel.var])
        assert config.num_warps == expected.pop("num_warps") and config.num_stages == expected.pop("num_stages")
        assert dict(config.kwargs) == expected
        assert autotuner.heuristic_type.name == "FIXED"


def test_pin_source_composes_with_the_cudagraph_candidate():
    src = cudagraph_source(wrapper("mlp_fp32_infer__00"))
    var = triton_kernels(src)[0].var
    out = launch_config.pin_source(src, {var: {"XBLOCK": 512, "num_warps": 4, "num_stages": 1}})
    ast.parse(out)
    assert MARKER in out and out.count("fixed_config(") == 1
    assert re.search(r"config=\{'XBLOCK': 512, 'num_warps': 4, 'num_stages': 1\}", out)


def test_pin_source_refuses_unknown_kernels():
    with pytest.raises(Skip, match="not in the source"):
        launch_config.pin_source(wrapper("mlp_fp32_infer__00"), {"triton_nope": {"XBLOCK": 1, "num_warps": 1,
                                                                                 "num_stages": 1}})


def test_choose_pins_requires_a_non_default_config_clearly_faster_than_the_best_default():
    a, b, c = ({"XBLOCK": 1024, "num_warps": 4, "num_stages": 1}, {"XBLOCK": 512, "num_warps": 8, "num_stages": 1},
               {"XBLOCK": 2048, "num_warps": 8, "num_stages": 1})
    timings = {
        "k_win": (KernelTiming(a, 0.010, True), KernelTiming(b, 0.012, True), KernelTiming(c, 0.008, False)),
        "k_marginal": (KernelTiming(a, 0.010, True), KernelTiming(c, 0.0099, False)),
        "k_default_best": (KernelTiming(a, 0.007, True), KernelTiming(c, 0.009, False)),
        "k_no_defaults": (KernelTiming(c, 0.001, False),),
        "k_failed": (KernelTiming(a, 0.010, True), KernelTiming(c, float("inf"), False)),
    }
    chosen = launch_config.choose_pins(timings)
    assert set(chosen) == {"k_win"}
    assert chosen["k_win"] == (c, 0.010, 0.008)


# -- wrapper_cleanup ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CUDA_CASES)
def test_cleanup_drops_only_repeated_stream_lookups(name):
    src = wrapper(name)
    out, removed = cleanup.cleanup_source(src)
    ast.parse(out)
    before = src.count("stream0 = get_raw_stream(0)")
    assert removed == before - 1 and out.count("stream0 = get_raw_stream(0)") == 1
    stripped = [line for line in src.splitlines() if line.strip() != "stream0 = get_raw_stream(0)"]
    assert [line for line in out.splitlines() if line.strip() != "stream0 = get_raw_stream(0)"] == stripped
    assert [k.source for k in triton_kernels(out)] == [k.source for k in triton_kernels(src)]


def test_cleanup_keeps_a_lookup_after_anything_that_may_switch_streams():
    src = wrapper("gpt2_block_bf16_infer__03")
    first = src.index("stream0 = get_raw_stream(0)")
    second = src.index("stream0 = get_raw_stream(0)", first + 1)
    edited = src[:second] + "torch.cuda.set_stream(torch.cuda.Stream())\n            " + src[second:]
    out, removed = cleanup.cleanup_source(edited)
    assert removed == src.count("stream0 = get_raw_stream(0)") - 2


def test_cleanup_finds_nothing_in_a_cpu_wrapper():
    assert cleanup.cleanup_source(fixture("cpu_mlp_infer.wrapper.py").read_text())[1] == 0
