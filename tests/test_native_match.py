"""The native-kernel pattern matcher (tilesmith/agent/builtin/native_match.py) on real FX programs.

FX programs are captured on CPU through Dynamo + AOTAutograd exactly as Inductor receives them
(``bench.harness.capture_graphs``: no kernel is compiled) at small shapes, plus the H200 fixtures
(tests/fixtures/inductor-h200/*.fx.txt), none of which is one of the patterns.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.harness import Workload, capture_graphs
from tests.fixture_paths import H200, NATIVE_CUDA
from tilesmith.fx_text import parse_fx
from tilesmith.agent.builtin.native_match import NORM_MAX_D, NoMatch, match_program

BF = torch.bfloat16
K, N, D = 64, 48, 128


def fx_of(fn, *inputs) -> str:
    graphs = capture_graphs(Workload(fn, inputs))
    assert len(graphs) == 1, [g.name for g in graphs]
    return graphs[0].fx_program


def rms_llama(x, r, w):
    h = x + r
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w, h


def _gn_silu(x, w, b):
    return F.silu(F.group_norm(x, 4, w, b, 1e-5))


def _int8(n=N, k=K):
    torch.manual_seed(0)
    return torch.randint(-127, 127, (n, k), dtype=torch.int8)


CASES = {
    # name: (function, inputs, family, function name, args as placeholder-index-or-literal, returns)
    "int8_scale_residual": (lambda x, w, s, r: r + (x @ w.to(BF).T) * s,
                            (torch.randn(1, K, dtype=BF), _int8(), torch.rand(N, dtype=BF), torch.randn(1, N, dtype=BF))),
    "int8_linear_bias": (lambda x, w, s, b: F.linear(x, w.to(x.dtype)) * s + b,
                         (torch.randn(4, K, dtype=BF), _int8(), torch.rand(N, dtype=BF), torch.randn(N, dtype=BF))),
    "int8_3d_fp32_scale": (lambda x, w, s: F.linear(x, w.to(x.dtype)) * s,
                           (torch.randn(2, 3, K, dtype=BF), _int8(), torch.rand(N))),
    "int8_strided_x": (lambda x, w, s: F.linear(x, w.to(x.dtype)) * s,
                       (torch.randn(1, 2 * K, dtype=BF)[:, :K], _int8(), torch.rand(N, dtype=BF))),
    "softmax_two": (lambda a, b: torch.softmax(a, -1) + torch.softmax(b, -1), (torch.randn(8, 256), torch.randn(8, 256))),
    "softmax_two_bf16": (lambda a, b: torch.softmax(a, -1) + torch.softmax(b, -1),
                         (torch.randn(8, 256, dtype=BF), torch.randn(8, 256, dtype=BF))),
    "softmax_scale_bias": (lambda a, b: torch.softmax(a * 0.125 + b, -1), (torch.randn(8, 256), torch.randn(256))),
    "softmax_divided": (lambda a: torch.softmax(a / 4.0, -1), (torch.randn(8, 256),)),
    "softmax_strided": (lambda a: torch.softmax(a, -1), (torch.randn(8, 512)[:, :256],)),
    "rms_llama_returns_sum": (rms_llama, (torch.randn(16, D, dtype=BF), torch.randn(16, D, dtype=BF),
                                          torch.randn(D, dtype=BF))),
    "rms_functional": (lambda x, r, w: F.rms_norm(x + r, (D,), w, 1e-6),
                       (torch.randn(16, D, dtype=BF), torch.randn(16, D, dtype=BF), torch.randn(D, dtype=BF))),
    "rms_fp32_no_residual": (lambda x, w: F.rms_norm(x, (D,), w, 1e-6), (torch.randn(16, D), torch.randn(D))),
    "layer_norm_residual": (lambda x, r, w, b: F.layer_norm(x + r, (D,), w, b, 1e-5),
                            (torch.randn(4, 4, D, dtype=BF), torch.randn(4, 4, D, dtype=BF), torch.randn(D, dtype=BF),
                             torch.randn(D, dtype=BF))),
    "layer_norm_returns_sum_twice_computed": (lambda x, r, w, b: (F.layer_norm(x + r, (D,), w, b, 1e-5), x + r),
                                              (torch.randn(16, D, dtype=BF), torch.randn(16, D, dtype=BF),
                                               torch.randn(D, dtype=BF), torch.randn(D, dtype=BF))),
    "layer_norm_strided_no_affine": (lambda x: F.layer_norm(x, (D,), None, None, 1e-5),
                                     (torch.randn(16, 2 * D, dtype=BF)[:, :D],)),
    # GroupNorm: the module form (affine + SiLU), every affine subset, fp32/bf16/fp16, 2-D to 5-D inputs,
    # groups of one channel and one group, weight of another dtype, the y * sigmoid(y) form (rounds before it)
    "gn_silu_affine_bf16": (_gn_silu, (torch.randn(2, 8, 4, 4, dtype=BF), torch.randn(8, dtype=BF),
                                       torch.randn(8, dtype=BF))),
    "gn_silu_affine_fp32": (_gn_silu, (torch.randn(2, 8, 4, 4), torch.randn(8), torch.randn(8))),
    "gn_weight_only_bf16": (lambda x, w: F.group_norm(x, 4, w, None, 1e-5),
                            (torch.randn(2, 8, 4, 4, dtype=BF), torch.randn(8, dtype=BF))),
    "gn_bias_only_3d": (lambda x, b: F.group_norm(x, 4, None, b, 1e-5), (torch.randn(2, 8, 6, dtype=BF),
                                                                         torch.randn(8, dtype=BF))),
    "gn_silu_no_affine_5d": (lambda x: F.silu(F.group_norm(x, 4, None, None, 1e-6)),
                             (torch.randn(2, 8, 2, 3, 4, dtype=BF),)),
    "gn_no_affine_fp32": (lambda x: F.group_norm(x, 4, None, None, 1e-5), (torch.randn(2, 8, 4, 4),)),
    "gn_silu_fp16_one_channel_groups": (lambda x, w, b: F.silu(F.group_norm(x, 8, w, b, 1e-5)),
                                        (torch.randn(2, 8, 3, 5, dtype=torch.float16),
                                         torch.randn(8, dtype=torch.float16), torch.randn(8, dtype=torch.float16))),
    "gn_silu_one_group_fp32_weight": (lambda x, w, b: F.silu(F.group_norm(x, 1, w, b, 1e-5)),
                                      (torch.randn(1, 8, 3, 5, dtype=BF), torch.randn(8), torch.randn(8))),
    "gn_sigmoid_form_2d": (lambda x, w, b: (lambda y: y * torch.sigmoid(y))(F.group_norm(x, 4, w, b, 1e-5)),
                           (torch.randn(2, 8, dtype=BF), torch.randn(8, dtype=BF), torch.randn(8, dtype=BF))),
}

REFUSED = {
    "int8_too_many_rows": ((lambda x, w, s: F.linear(x, w.to(x.dtype)) * s,
                            (torch.randn(32, K, dtype=BF), _int8(), torch.rand(N, dtype=BF))), "32 rows of x"),
    "int8_bias_before_scale": ((lambda x, w, s, b: (F.linear(x, w.to(x.dtype)) + b) * s,
                                (torch.randn(1, K, dtype=BF), _int8(), torch.rand(N, dtype=BF), torch.randn(N, dtype=BF))),
                               "an addition before the scale"),
    "int8_fp16_activations": ((lambda x, w, s: F.linear(x, w.to(x.dtype)) * s,
                               (torch.randn(1, K, dtype=torch.float16), _int8(), torch.rand(N, dtype=torch.float16))),
                              "not bf16"),
    "softmax_other_dim": ((lambda a: torch.softmax(a, 0), (torch.randn(8, 256),)), "last dimension"),
    "softmax_then_sigmoid": ((lambda a, b: torch.softmax(a * 0.125 + b, -1) * torch.sigmoid(a),
                              (torch.randn(8, 256), torch.randn(256))), "softmax"),
    "softmax_to_fp32": ((lambda a: torch.softmax(a, -1, dtype=torch.float32), (torch.randn(8, 256, dtype=BF),)),
                        "keeps shape and dtype"),
    "norm_transposed_input": ((lambda x, w, b: F.layer_norm(x, (D,), w, b, 1e-5),
                               (torch.randn(D, 16, dtype=BF).t(), torch.randn(D, dtype=BF), torch.randn(D, dtype=BF))),
                              "not a row layout"),
    "norm_too_wide": ((lambda x: F.rms_norm(x, (NORM_MAX_D + 8,), None, 1e-6), (torch.randn(2, NORM_MAX_D + 8),)),
                      f"at most {NORM_MAX_D}"),
    "norm_plus_extra_op": ((lambda x, w: F.rms_norm(x, (D,), w, 1e-6) * 2.0, (torch.randn(4, D), torch.randn(D))),
                           "norm: .*expected kind"),
    "gn_channels_last": ((_gn_silu, (torch.randn(2, 8, 4, 4, dtype=BF).to(memory_format=torch.channels_last),
                                     torch.randn(8, dtype=BF), torch.randn(8, dtype=BF))),
                         "group_norm: x arg0_1 is not contiguous NCHW .*channels-last is not supported"),
    "gn_strided_input": ((_gn_silu, (torch.randn(2, 16, 4, 4, dtype=BF)[:, :8], torch.randn(8, dtype=BF),
                                     torch.randn(8, dtype=BF))), "group_norm: x .* is not contiguous NCHW"),
    "gn_then_scale": ((lambda x, w, b: _gn_silu(x, w, b) * 2.0, (torch.randn(2, 8, 4, 4, dtype=BF),
                                                                 torch.randn(8, dtype=BF), torch.randn(8, dtype=BF))),
                      "group_norm: .* is not part of the GroupNorm decomposition"),
    "gn_gelu": ((lambda x, w, b: F.gelu(F.group_norm(x, 4, w, b, 1e-5)),
                 (torch.randn(2, 8, 4, 4, dtype=BF), torch.randn(8, dtype=BF), torch.randn(8, dtype=BF))),
                "group_norm: .* is not part of the GroupNorm decomposition"),
    "gn_extra_output": ((lambda x, w, b: (_gn_silu(x, w, b), x.float().mean()),
                         (torch.randn(2, 8, 4, 4, dtype=BF), torch.randn(8, dtype=BF), torch.randn(8, dtype=BF))),
                        "group_norm: the graph returns 2 values"),
    "gn_to_fp32": ((lambda x: F.group_norm(x.float(), 4, None, None, 1e-5), (torch.randn(2, 8, 4, 4, dtype=BF),)),
                   "group_norm: .*kernel keeps shape and dtype|group_norm: x is computed in the graph"),
    "gn_two_group_norms": ((lambda x: F.group_norm(x, 4) + F.group_norm(x, 2), (torch.randn(2, 8, 4, 4),)),
                           "group_norm: 2 var_mean operations"),
}


@pytest.fixture(scope="module")
def captured():
    return {name: fx_of(fn, *inputs) for name, (fn, inputs) in CASES.items()}


EXPECTED = {
    "int8_scale_residual": ("int8_linear", ["x", "w", "s", None, "r", "torch.bfloat16", "0"], (None,)),
    "int8_linear_bias": ("int8_linear", ["x", "w", "s", "b", None, "torch.bfloat16", "0"], (None,)),
    "int8_3d_fp32_scale": ("int8_linear", ["x", "w", "s", None, None, "torch.float32", "0"], (None,)),
    "int8_strided_x": ("int8_linear", ["x", "w", "s", None, None, "torch.bfloat16", "0"], (None,)),
    "softmax_two": ("softmax", ["a", "b", "1.0", None, "1.0", None, "0"], (None,)),
    "softmax_two_bf16": ("softmax", ["a", "b", "1.0", None, "1.0", None, "0"], (None,)),
    "softmax_scale_bias": ("softmax", ["a", None, "0.125", "b", "1.0", None, "0"], (None,)),
    "softmax_divided": ("softmax", ["a", None, "0.25", None, "1.0", None, "0"], (None,)),
    "softmax_strided": ("softmax", ["a", None, "1.0", None, "1.0", None, "0"], (None,)),
    "rms_llama_returns_sum": ("rms_norm", ["x", "r", "w", "1e-06", "True", "True"], (0, 1)),
    "rms_functional": ("rms_norm", ["x", "r", "w", "9.999999974752427e-07", "False", "False"], (0,)),
    "rms_fp32_no_residual": ("rms_norm", ["x", None, "w", "9.999999974752427e-07", "False", "False"], (0,)),
    "layer_norm_residual": ("layer_norm", ["x", "r", "w", "b", "1e-05", "False"], (0,)),
    "layer_norm_returns_sum_twice_computed": ("layer_norm", ["x", "r", "w", "b", "1e-05", "True"], (0, 1)),
    "layer_norm_strided_no_affine": ("layer_norm", ["x", None, None, None, "1e-05", "False"], (0,)),
    "gn_silu_affine_bf16": ("group_norm", ["x", "w", "b", "4", "1e-05", "True", "False", "0"], (None,)),
    "gn_silu_affine_fp32": ("group_norm", ["x", "w", "b", "4", "1e-05", "True", "False", "0"], (None,)),
    "gn_weight_only_bf16": ("group_norm", ["x", "w", None, "4", "1e-05", "False", "False", "0"], (None,)),
    "gn_bias_only_3d": ("group_norm", ["x", None, "b", "4", "1e-05", "False", "False", "0"], (None,)),
    "gn_silu_no_affine_5d": ("group_norm", ["x", None, None, "4", "1e-06", "True", "False", "0"], (None,)),
    "gn_no_affine_fp32": ("group_norm", ["x", None, None, "4", "1e-05", "False", "False", "0"], (None,)),
    "gn_silu_fp16_one_channel_groups": ("group_norm", ["x", "w", "b", "8", "1e-05", "True", "False", "0"], (None,)),
    "gn_silu_one_group_fp32_weight": ("group_norm", ["x", "w", "b", "1", "1e-05", "True", "False", "0"], (None,)),
    "gn_sigmoid_form_2d": ("group_norm", ["x", "w", "b", "4", "1e-05", "True", "True", "0"], (None,)),
}


_ABBR = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.int8: "i8"}


def _candidates(meta, fn, inputs) -> set[str]:
    """Parameters of ``fn`` whose example input has the placeholder's layout and dtype (Dynamo orders graph
    inputs by first use, not by parameter position)."""
    names = fn.__code__.co_varnames[:fn.__code__.co_argcount]
    return {n for n, t in zip(names, inputs, strict=True)
            if tuple(t.shape) == meta.shape and tuple(t.stride()) == meta.stride and _ABBR[t.dtype] == meta.dtype}


@pytest.mark.parametrize("name", sorted(CASES))
def test_pattern_graphs_match_with_the_right_arguments(name, captured):
    fn, inputs = CASES[name]
    plan = match_program(captured[name])
    function, args, returns = EXPECTED[name]
    assert plan.function == function and plan.returns == returns, plan
    g = parse_fx(captured[name])
    params = set(fn.__code__.co_varnames[:fn.__code__.co_argcount])
    assert len(plan.args) == len(args)
    for got, want in zip(plan.args, args, strict=True):
        if want is None:
            assert got.literal == "None", (name, plan.args)
        elif want in params:
            assert got.input is not None and want in _candidates(g.nodes[g.placeholders[got.input]].meta, fn, inputs), \
                (name, want, plan.args)
        else:
            assert got.literal == want, (name, plan.args)
    assert plan.bytes_moved > 0 and plan.description


def test_inputs_of_identical_layout_map_to_their_own_roles(captured):
    """a/b of the two softmaxes and x/r of the norm have identical layouts: two distinct inputs each."""
    for name in ("softmax_two", "rms_llama_returns_sum", "layer_norm_residual"):
        plan = match_program(captured[name])
        assert {plan.args[0].input, plan.args[1].input} == {0, 1}, (name, plan.args)


def test_each_softmax_keeps_its_own_scale_and_bias():
    fx = fx_of(lambda a, b, c: torch.softmax(a * 0.5, -1) + torch.softmax(b * 2.0 + c, -1),
               torch.randn(8, 256), torch.randn(8, 256), torch.randn(256))
    g = parse_fx(fx)
    plan = match_program(fx)
    bias = next(p for p in g.placeholders if g.nodes[p].meta.shape == (256,))
    add = next(n for n in g.nodes.values() if n.op == "aten.add.Tensor" and any(getattr(a, "name", "") == bias
                                                                                 for a in n.args))
    scaled_by_two = next(a for a in add.args if a.name != bias)
    b_input = g.nodes[scaled_by_two.name].args[0].name
    idx = g.placeholders.index
    assert plan.args[1].input == idx(b_input) and plan.args[4].literal == "2.0" and plan.args[5].input == idx(bias)
    assert plan.args[0].input not in (idx(b_input), idx(bias)) and plan.args[2].literal == "0.5"
    assert plan.args[3].literal == "None"


def test_int8_bytes_are_weight_activations_epilogue_and_output(captured):
    plan = match_program(captured["int8_scale_residual"])
    assert plan.bytes_moved == N * K + K * 2 + N * 2 + N * 2 + N * 2  # W, x, scale, residual, out
    assert "K=64" in plan.description and "* scale + residual" in plan.description


def test_softmax_and_norm_bytes(captured):
    assert match_program(captured["softmax_two"]).bytes_moved == 3 * 8 * 256 * 4
    assert match_program(captured["softmax_scale_bias"]).bytes_moved == 2 * 8 * 256 * 4 + 256 * 4
    # x, r read; out and h written; the weight read once
    assert match_program(captured["rms_llama_returns_sum"]).bytes_moved == 4 * 16 * D * 2 + D * 2


def test_group_norm_bytes_roles_and_description(captured):
    plan = match_program(captured["gn_silu_affine_bf16"])
    assert plan.family == "group_norm" and plan.bytes_moved == 2 * (2 * 8 * 4 * 4 * 2) + 2 * 8 * 2  # x, out, w, b
    assert plan.description.startswith("silu(GroupNorm(4, 8)) over x bf16[2, 8, 4, 4] (8 groups of 32")
    plan = match_program(captured["gn_silu_one_group_fp32_weight"])
    assert plan.bytes_moved == 2 * (8 * 15 * 2) + 2 * 8 * 4
    g = parse_fx(captured["gn_weight_only_bf16"])
    plan = match_program(captured["gn_weight_only_bf16"])
    w = g.nodes[g.placeholders[plan.args[1].input]].meta  # the weight is the [C] input, x the NCHW one
    assert w.shape == (8,) and g.nodes[g.placeholders[plan.args[0].input]].meta.shape == (2, 8, 4, 4)
    assert "rounded before the SiLU" in match_program(captured["gn_sigmoid_form_2d"]).description


def test_group_norm_refuses_groups_the_kernels_cannot_index():
    from tilesmith.agent.builtin.native_match_groupnorm import GROUP_NORM_MAX_GROUP

    fx = fx_of(lambda x: F.silu(F.group_norm(x, 2, None, None, 1e-5)), torch.randn(1, 4, 8, 8))
    c, hw = 4, GROUP_NORM_MAX_GROUP // 2  # groups of 2 * hw = 2^30 elements
    big = (fx.replace("[1, 4, 8, 8][256, 64, 8, 1]", f"[1, {c}, {hw}, 1][{c * hw}, {hw}, 1, 1]")
             .replace("[1, 2, 2, 64][256, 128, 64, 1]", f"[1, 2, 2, {hw}][{c * hw}, {2 * hw}, {hw}, 1]")
             .replace("[1, 2, 2, 64]", f"[1, 2, 2, {hw}]"))
    assert big != fx
    with pytest.raises(NoMatch, match="group_norm: groups of 1073741824 elements"):
        match_program(big)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_other_graphs_are_refused_with_the_reason(name):
    (fn, inputs), reason = REFUSED[name]
    with pytest.raises(NoMatch, match=reason):
        match_program(fx_of(fn, *inputs))


def test_dynamic_shapes_are_refused():
    fx = (H200 / "dynamic_softmax__11.fx.txt").read_text()
    with pytest.raises(NoMatch, match="dynamic shapes"):
        match_program(fx)
    torch._dynamo.reset()
    graphs = capture_graphs(Workload(lambda a: torch.softmax(a, -1), (torch.randn(8, 256),)))
    text = graphs[0].fx_program.replace("f32[8, 256][256, 1]", "f32[s0, 256][256, 1]")
    with pytest.raises(NoMatch, match="dynamic shapes"):
        match_program(text)


@pytest.mark.parametrize("path", sorted(H200.glob("*.fx.txt")), ids=lambda p: p.stem)
def test_no_h200_fixture_is_a_pattern(path):
    with pytest.raises(NoMatch):
        match_program(path.read_text())


def test_the_softmax_fixture_without_its_sigmoid_is_the_scaled_biased_softmax():
    fx = (H200 / "softmax_bias_bf16_infer__06.fx.txt").read_text()
    cut = fx[:fx.index("        sigmoid:")] + "        return (convert_element_type_1,)\n"
    plan = match_program(cut)
    assert plan.function == "softmax"
    assert [a.input if a.input is not None else a.literal for a in plan.args] == [0, "None", "0.125", 1, "1.0", "None",
                                                                                   "0"]
    assert plan.bytes_moved == 2 * 8192 * 4096 * 2 + 4096 * 2
    with pytest.raises(NoMatch, match="several devices"):
        match_program((H200 / "mixed_device__12.fx.txt").read_text())


def test_unparseable_or_constant_reading_programs_are_refused():
    with pytest.raises(NoMatch, match="not parseable"):
        match_program("class x(:\n")
    fx = fx_of(lambda a: torch.softmax(a, -1), torch.randn(4, 32))
    with_attr = fx.replace("def forward(self, arg0_1", "def forward(self, arg0_1").replace(
        "        amax", "        _frozen_param0: \"f32[32][1]cpu\" = self._frozen_param0\n        amax", 1)
    with pytest.raises(NoMatch, match="module constants"):
        match_program(with_attr)


@pytest.mark.parametrize("name,groups,silu", [("gn_silu_bf16", 32, True), ("gn_bf16", 8, False),
                                              ("gn_silu_f32", 8, True)])
def test_group_norm_programs_captured_on_cuda_match(name, groups, silu):
    """The CUDA decomposition (``view(centred) * unsqueeze(w) + unsqueeze(b)``, SiLU as ``y / (1 + exp(-y))``)
    is the one tilesmith.compile sees on a GPU; the CPU captures above broadcast the weight differently."""
    plan = match_program((NATIVE_CUDA / f"{name}.fx.txt").read_text())
    assert plan.family == "group_norm"
    x, weight, bias, g, _eps, act, round_mid = plan.args[:7]
    assert (x.input, weight.input, bias.input) == (2, 0, 1)
    assert (g.literal, act.literal, round_mid.literal) == (str(groups), str(silu), "False")


def test_group_norm_cuda_form_without_its_bias_add_is_weight_only():
    fx = (NATIVE_CUDA / "gn_bf16.fx.txt").read_text()
    lines = fx.splitlines()
    add = next(i for i, l in enumerate(lines) if " = torch.ops.aten.add.Tensor(mul_1, unsqueeze_5)" in l)
    out = lines[add].split(":", 1)[0].strip()
    kept = [l for i, l in enumerate(lines) if i != add and "unsqueeze_3" not in l and "unsqueeze_4" not in l
            and "unsqueeze_5" not in l]
    fx2 = "\n".join(kept).replace(f"({out},", "(mul_1,").replace(f"({out})", "(mul_1)")
    fx2 = fx2.replace(", arg1_1: ", ", unused_1: ")
    try:
        plan = match_program(fx2)
    except NoMatch as exc:  # a program this test edited wrongly says why
        pytest.fail(str(exc))
    assert plan.family == "group_norm" and plan.args[1].input == 0 and plan.args[2].literal == "None"
