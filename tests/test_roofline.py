"""Roofline floors from FX program text: hand-computed bytes and FLOPs on real H200 graphs.

Fixtures: the H200 ``*__NN.fx.txt`` graphs from tests/fixtures/inductor-h200/ (one copy, see tests/fixture_paths.py)
and tests/fixtures/roofline/: ``*_cpu*.fx.txt`` were captured on CPU with
``bench.harness.capture_graphs``; ``*_synthetic.fx.txt`` are hand-written in the same format.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.fixture_paths import fixture
from tilesmith.records import CapturedGraph, ScalarSpec, TensorSpec
from tilesmith.roofline import (
    DeviceLimits,
    RooflineParseError,
    clear_limits_cache,
    floor_from_cost,
    floor_from_fx,
    graph_cost,
    measure_device_limits,
    roofline_floor,
)

LIMITS = DeviceLimits(device="cuda:0", device_name="test", copy_gbps=4000.0, matmul_bf16_tflops=800.0,
                      matmul_fp32_tflops=50.0)


def fx(name: str) -> str:
    return fixture(name).read_text()


def mm_flops(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


def test_gpt2_block_counts_each_addmm_and_half_of_causal_attention():
    cost = graph_cost(fx("gpt2_block_bf16_infer__03.fx.txt"))
    tokens, c, b, h, t, d = 8 * 1024, 768, 8, 12, 1024, 64
    sdpa_full = 2 * mm_flops(b * h * t, t, d)  # QK^T and PV, each 2·(B·H)·T·T·D
    assert dict(cost.flop_ops) == {
        "addmm": mm_flops(tokens, 3 * c, c),
        "_scaled_dot_product_cudnn_attention": sdpa_full // 2,  # is_causal=True
        "addmm_1": mm_flops(tokens, c, c),
        "addmm_2": mm_flops(tokens, 4 * c, c),
        "addmm_3": mm_flops(tokens, c, 4 * c),
    }
    assert cost.flops_by_dtype == (("bf16", cost.flops),)


def test_gpt2_block_bytes_are_every_input_once_and_the_output_once():
    cost = graph_cost(fx("gpt2_block_bf16_infer__03.fx.txt"))
    c = 768
    elems = (8 * 1024 * c  # x
             + 4 * c  # ln1, ln2 weights and biases
             + 3 * c * c + 3 * c  # qkv
             + c * c + c  # proj
             + 4 * c * c + 4 * c  # fc
             + 4 * c * c + c)  # fc2
    assert cost.bytes_read == 2 * elems
    assert cost.bytes_written == 2 * 8 * 1024 * c


def test_fp32_mlp_flops_are_charged_at_the_fp32_rate():
    cost = graph_cost(fx("mlp_fp32_infer__00.fx.txt"))
    assert cost.flops_by_dtype == (("f32", 2 * mm_flops(64, 4096, 1024)),)
    assert cost.bytes_read == 4 * (4096 * 1024 + 4096 + 64 * 1024 + 1024 * 4096 + 3 * 1024)
    assert cost.bytes_written == 4 * 64 * 1024
    floor = floor_from_cost(cost, LIMITS)
    assert floor.floor_ms == pytest.approx(1e3 * cost.flops / 50e12)  # compute-bound at 50 TFLOP/s
    assert floor.flops_tflops == pytest.approx(50.0)


def test_channels_last_conv_block_counts_both_convolutions():
    cost = graph_cost(fx("conv_bf16_cl_infer__05.fx.txt"))
    n, c, hw, k = 32, 64, 56, 3
    per_conv = 2 * n * hw * hw * c * c * k * k
    assert dict(cost.flop_ops) == {"convolution": per_conv, "convolution_1": per_conv}
    assert cost.bytes_read == 2 * (n * c * hw * hw + 2 * c * c * k * k + 10 * c)
    assert cost.bytes_written == 2 * n * c * hw * hw


def test_training_forward_does_not_write_returned_inputs():
    cost = graph_cost(fx("mlp_fp32_train__01.fx.txt"))
    # outputs: add_3 [64,1024], primals_1/3/4/6 (inputs: aliases), addmm & mul_2 [64,4096],
    # addmm_1 [64,1024], getitem_1 & rsqrt [64,1]
    assert cost.bytes_written == 4 * (64 * 1024 + 2 * 64 * 4096 + 64 * 1024 + 2 * 64)


def test_training_backward_counts_four_matmuls_and_all_gradients():
    cost = graph_cost(fx("mlp_fp32_train__02.fx.txt"))
    assert cost.flops == 4 * mm_flops(64, 4096, 1024)
    grads = 2 * 4096 * 1024 + 4096 + 64 * 1024 + 3 * 1024
    assert cost.bytes_written == 4 * grads
    saved = 2 * 4096 * 1024 + 64 * 1024 + 1024 + 2 * 64 * 4096 + 64 * 1024 + 2 * 64
    assert cost.bytes_read == 4 * (saved + 64 * 1024)  # + tangents_1


def test_bmm_and_baddbmm_are_two_m_n_k_per_batch():
    cost = graph_cost(fx("bmm_cpu.fx.txt"))
    assert dict(cost.flop_ops) == {"bmm": 4 * mm_flops(32, 8, 16), "baddbmm": 4 * mm_flops(32, 8, 16)}
    assert cost.bytes_read == 4 * (4 * 32 * 16 + 4 * 16 * 8 + 4 * 32 * 8)
    assert cost.bytes_written == 4 * 2 * 4 * 32 * 8


def test_convolution_backward_counts_input_and_weight_gradients():
    forward = graph_cost(fx("conv_train_cpu_forward.fx.txt"))
    backward = graph_cost(fx("conv_train_cpu_backward.fx.txt"))
    conv = 2 * 2 * 10 * 10 * 16 * 8 * 3 * 3
    assert forward.flops == conv
    assert backward.flops == 2 * conv  # grad_input and grad_weight, each a convolution of the same size
    assert backward.bytes_written == 4 * (16 * 8 * 3 * 3 + 16 + 2 * 8 * 10 * 10)


def test_flash_attention_backward_causal_costs_half_of_non_causal():
    cost = graph_cost(fx("sdpa_flash_backward_synthetic.fx.txt"))
    bmm = mm_flops(2 * 4 * 256, 256, 64)
    counts = dict(cost.flop_ops)
    assert counts["_scaled_dot_product_flash_attention_backward_1"] == 5 * bmm
    assert counts["_scaled_dot_product_flash_attention_backward"] == 5 * bmm // 2


def test_views_expands_and_gathers_charge_only_what_they_expose():
    cost = graph_cost(fx("views_gather_synthetic.fx.txt"))
    half_of_arg0 = 4 * 32 * 128
    gathered_rows = 4 * 8 * 32
    indices = 8 * 8
    expanded_vector = 4 * 128
    assert cost.bytes_read == half_of_arg0 + gathered_rows + indices + expanded_vector
    assert cost.bytes_written == 4 * 32 * 128 + gathered_rows  # the view of arg4_1 is an alias


def test_input_mutation_writes_the_mutated_input():
    cost = graph_cost(fx("input_mutation__09.fx.txt"))
    assert cost.bytes_read == 4 * 128 * 256
    assert cost.bytes_written == 2 * 4 * 128 * 256  # copy_ into arg0_1 and the output


def test_memory_bound_softmax_floor_is_bytes_over_bandwidth():
    cost = graph_cost(fx("softmax_bias_bf16_infer__06.fx.txt"))
    assert cost.flops == 0
    floor = floor_from_cost(cost, LIMITS)
    assert floor.bytes_moved == 2 * (2 * 8192 * 4096 + 4096)
    assert floor.floor_ms == pytest.approx(1e3 * floor.bytes_moved / 4000e9)
    assert floor.bandwidth_gbps == 4000.0


def test_floor_is_the_larger_of_memory_and_compute_time():
    cost = graph_cost(fx("gpt2_block_bf16_infer__03.fx.txt"))
    slow_memory = DeviceLimits("cuda:0", "t", copy_gbps=1.0, matmul_bf16_tflops=800.0, matmul_fp32_tflops=50.0)
    slow_compute = DeviceLimits("cuda:0", "t", copy_gbps=4000.0, matmul_bf16_tflops=1.0, matmul_fp32_tflops=1.0)
    assert floor_from_cost(cost, slow_memory).floor_ms == pytest.approx(1e3 * cost.bytes_moved / 1e9)
    assert floor_from_cost(cost, slow_compute).floor_ms == pytest.approx(1e3 * cost.flops / 1e12)


def test_dynamic_shapes_have_no_floor():
    text = fx("dynamic_softmax__11.fx.txt")
    with pytest.raises(RooflineParseError, match="dynamic"):
        graph_cost(text)
    assert floor_from_fx(text, LIMITS) is None


def test_unparseable_text_has_no_floor():
    assert floor_from_fx("this is not an FX program", LIMITS) is None


def _captured(text: str, inputs: tuple) -> CapturedGraph:
    return CapturedGraph(name="0_inference", kind="inference", source="", canonical_source="", fx_program=text,
                         inputs=inputs, output_strides=(), mutated_input_idxs=(), inputs_to_check=(),
                         device="cuda:0", inductor_key=None)


def test_roofline_floor_prefers_the_captured_input_specs():
    text = fx("softmax_bias_bf16_infer__06.fx.txt")
    # the same program, but the record says the x input is fp32 (4 bytes per element)
    specs = (TensorSpec((8192, 4096), (4096, 1), "torch.float32", "cuda:0"),
             TensorSpec((4096,), (1,), "torch.bfloat16", "cuda:0"))
    floor = roofline_floor(_captured(text, specs), LIMITS)
    assert floor is not None
    assert floor.bytes_moved == 4 * 8192 * 4096 + 2 * 4096 + 2 * 8192 * 4096


def test_roofline_floor_ignores_specs_that_do_not_match_the_placeholders():
    text = fx("softmax_bias_bf16_infer__06.fx.txt")
    floor = roofline_floor(_captured(text, (ScalarSpec(3),)), LIMITS)
    assert floor is not None
    assert floor.bytes_moved == 2 * (2 * 8192 * 4096 + 4096)


def test_device_limits_rate_by_dtype():
    assert LIMITS.tflops_for("bf16") == 800.0
    assert LIMITS.tflops_for("torch.float16") == 800.0
    assert LIMITS.tflops_for("f32") == 50.0
    assert LIMITS.tflops_for("f8e4m3fn") == 1600.0


def test_measure_device_limits_on_cpu_is_positive_and_cached():
    clear_limits_cache()
    first = measure_device_limits("cpu")
    assert first.method == "host_clock"
    assert first.copy_gbps > 0 and first.matmul_bf16_tflops > 0 and first.matmul_fp32_tflops > 0
    assert math.isfinite(first.copy_gbps)
    assert measure_device_limits("cpu") is first
    clear_limits_cache()
    assert measure_device_limits("cpu") is not first


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_measure_device_limits_on_cuda_reports_tensor_core_rates():
    clear_limits_cache()
    limits = measure_device_limits("cuda")
    assert limits.method == "cuda_event"
    assert limits.device.startswith("cuda:")
    assert limits.copy_gbps > 100
    assert limits.matmul_bf16_tflops > limits.matmul_fp32_tflops > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_training_attention_graphs_count_sdpa_forward_and_backward():
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.cases import Workload
    from bench.harness import capture_graphs
    from examples.models import GPT2Block

    model = GPT2Block(128, 2).cuda().bfloat16()
    x = torch.randn(2, 256, 128, device="cuda", dtype=torch.bfloat16)
    graphs = capture_graphs(Workload(model, (x,), train=True, grad=torch.randn_like(x)))
    kinds = {g.kind: graph_cost(g.fx_program, g.inputs) for g in graphs}
    sdpa_full = 2 * mm_flops(2 * 2 * 256, 256, 64)
    mlp = 2 * 512 * (3 + 1 + 4 + 4) * 128 * 128  # qkv, proj, fc, fc2 over 512 tokens
    assert kinds["forward"].flops == mlp + sdpa_full // 2
    assert kinds["backward"].flops == 2 * mlp + 5 * sdpa_full // 4
