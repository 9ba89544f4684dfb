"""Output comparison: tolerances per dtype, NaN/Inf positions, poison and stale-result detection,
precision-loss classification, strides and aliasing."""

from __future__ import annotations

import pytest
import torch

from tilesmith.gate.host.compare import (TOLERANCES, check_values, compare_output, compare_structure,
                                    significant_strides_differ, tolerance_for)


def _cmp(expected, got, **kw):
    return compare_output(0, expected, got, variant="random", tf32=False, poison_byte=kw.pop("poison", None),
                          others=kw.pop("others", {}), where="test", **kw)


def test_every_tolerance_row_names_its_source():
    assert all(row.source for row in TOLERANCES.values())
    assert tolerance_for(torch.int64, False) is None and tolerance_for(torch.bool, False) is None
    assert tolerance_for(torch.float32, True).name == "tf32"
    assert tolerance_for(torch.float8_e5m2, False).name == "float8_e5m2"


def test_reduction_order_noise_passes_in_float32():
    torch.manual_seed(0)
    a, b = torch.randn(256, 512), torch.randn(512, 64)
    ref = a @ b
    reordered = (a[:, :256] @ b[:256]) + (a[:, 256:] @ b[256:])
    assert _cmp(ref, reordered) is None


def test_all_zero_output_cannot_pass_a_small_reference_on_loose_atol():
    # KernelBench issue #165: |ref| < atol everywhere, yet an all-zero output is wrong.
    ref = torch.randn(1000, dtype=torch.float32).to(torch.bfloat16) * 1e-3
    failure = _cmp(ref, torch.zeros_like(ref))
    assert failure is not None and failure.check == "value_mismatch"
    assert "relative L2 error 1" in failure.message


def test_bfloat16_rounding_of_a_float32_output_is_precision_loss():
    torch.manual_seed(0)
    ref = torch.randn(64, 64)
    failure = _cmp(ref, ref.to(torch.bfloat16).float())
    assert failure.check == "precision_loss"
    assert failure.worst_index is not None and failure.expected and failure.got


def test_a_scaled_result_is_a_value_mismatch_not_precision_loss():
    torch.manual_seed(0)
    ref = torch.randn(64, 64)
    assert _cmp(ref, ref * 1.002).check == "value_mismatch"


def test_nan_positions_must_match():
    ref = torch.tensor([1.0, float("nan"), 3.0, float("inf")])
    assert _cmp(ref, ref.clone()) is None
    masked = torch.nan_to_num(ref, nan=0.0, posinf=float("inf"))
    failure = _cmp(ref, masked)
    assert failure.check == "nan_inf_mismatch" and failure.worst_index == (1,)
    assert _cmp(ref, torch.tensor([1.0, float("nan"), 3.0, float("-inf")])).check == "nan_inf_mismatch"


def test_nan_or_inf_in_only_one_of_the_outputs_is_a_position_mismatch():
    ref = torch.randn(64)
    for bad in (float("nan"), float("inf"), float("-inf")):
        got = ref.clone()
        got[7] = bad
        failure = _cmp(ref, got)
        assert failure.check == "nan_inf_mismatch" and failure.worst_index == (7,)
        failure = _cmp(got, ref.clone())
        assert failure.check == "nan_inf_mismatch" and failure.worst_index == (7,)


def test_bit_identical_outputs_pass_and_equal_values_with_other_bits_take_the_full_comparison():
    ref = torch.tensor([0.0, 1.5, float("nan"), -2.0, float("inf")])
    assert check_values(ref, ref.clone(), TOLERANCES["float32"], poison_byte=0xFF) is None
    negzero = ref.clone()
    negzero[0] = -0.0  # other bits, same value: passes through the full comparison
    assert check_values(ref, negzero, TOLERANCES["float32"]) is None
    off = ref.clone()
    off[1] = 1.6
    assert check_values(ref, off, TOLERANCES["float32"]).kind == "value"


def test_poison_in_an_output_whose_reference_lacks_it_is_never_written_even_when_all_else_matches():
    ref = torch.randn(128)
    got = ref.clone()
    got.view(torch.int32)[5] = -1
    assert check_values(ref, got, TOLERANCES["float32"], poison_byte=0xFF).kind == "uninitialized"
    same = got.clone()  # the reference itself holds the pattern there: not the candidate's doing
    assert check_values(got, same, TOLERANCES["float32"], poison_byte=0xFF) is None


def test_poisoned_elements_are_reported_as_never_written():
    ref = torch.randn(4, 8)
    got = ref.clone()
    got.view(torch.int32)[2, 3:] = -1  # 0xFFFFFFFF: the gate's poison pattern
    failure = _cmp(ref, got, poison=0xFF)
    assert failure.check == "uninitialized_output"
    assert failure.worst_index == (2, 3) and "5 of 32" in failure.message


def test_result_of_other_inputs_is_reported_as_stale():
    a, b = torch.randn(16), torch.randn(16)
    failure = _cmp(b, a.clone(), others={"normal": a})
    assert failure.check == "stale_result" and "'normal'" in failure.message


def test_integers_must_be_exact():
    ref = torch.arange(10)
    assert _cmp(ref, ref.clone()) is None
    got = ref.clone()
    got[7] += 1
    failure = _cmp(ref, got)
    assert failure.check == "value_mismatch" and failure.worst_index == (7,)
    assert check_values(torch.tensor([True, False]), torch.tensor([True, True]), None).count == 1


def test_complex_outputs_compare_through_their_real_view():
    ref = torch.randn(8, dtype=torch.complex64)
    assert _cmp(ref, ref.clone()) is None
    assert _cmp(ref, ref * 1.5) is not None


def test_strides_of_size_one_dimensions_do_not_matter():
    assert not significant_strides_differ([32, 1], [1, 1], [1, 32])
    assert significant_strides_differ([32, 64], [64, 1], [1, 32])


def _fact(**kw):
    base = {"kind": "tensor", "shape": [4, 4], "stride": [4, 1], "dtype": "torch.float32", "device": "cpu",
            "input_identity": None, "input_storage": None, "shares_outputs": []}
    base.update(kw)
    return base


@pytest.mark.parametrize("cand, check", [
    ([_fact(), _fact()], "output_count"),
    ([{"kind": "other", "type": "mylib.LazyTensor"}], "output_type"),
    ([_fact(shape=[4, 5])], "shape_mismatch"),
    ([_fact(dtype="torch.float16")], "dtype_mismatch"),
    ([_fact(device="cuda:0")], "device_mismatch"),
    ([_fact(stride=[1, 4])], "stride_mismatch"),
    ([_fact(input_identity=0, input_storage=0)], "alias_mismatch"),
])
def test_structure_failures(cand, check):
    failures = compare_structure([_fact()], cand, where="test", variant="normal")
    assert check in [f.check for f in failures]


def test_returned_inputs_must_be_the_same_objects():
    ref = [_fact(input_identity=1, input_storage=1)]
    assert compare_structure(ref, [_fact(input_identity=1, input_storage=1)], where="t", variant=None) == []
    [failure] = compare_structure(ref, [_fact()], where="t", variant=None)
    assert failure.check == "alias_mismatch" and "input 1 itself" in failure.message


def test_scalar_and_none_outputs_must_match():
    ref = [{"kind": "scalar", "value": 3}, {"kind": "none"}]
    assert compare_structure(ref, [{"kind": "scalar", "value": 3}, {"kind": "none"}], where="t", variant=None) == []
    [failure] = compare_structure(ref, [{"kind": "scalar", "value": 4}, {"kind": "none"}], where="t", variant=None)
    assert failure.check == "value_mismatch" and failure.output_index == 0
    [failure] = compare_structure(ref, [{"kind": "scalar", "value": 3}, _fact()], where="t", variant=None)
    assert failure.check == "output_type" and failure.output_index == 1


def _high(ref, got, noise=None):
    return compare_output(0, ref, got, variant="high_magnitude", tf32=False, poison_byte=None, others={},
                          where="t", noise=noise)


def test_high_magnitude_tolerance_scales_with_the_references_own_rounding_sensitivity():
    torch.manual_seed(0)
    ref = torch.tanh(torch.randn(4096) * 0.5)
    got = ref.clone()
    got[7] += 0.02  # an ill-conditioned element: cancellation amplified by the input scale
    noise = torch.zeros_like(ref)
    noise[7] = 2e-3  # ... where the reference itself moves by 2e-3 under a few-ulp input perturbation
    assert _cmp(ref, got) is not None  # the normal/random variants judge every element strictly
    assert _high(ref, got, noise) is None
    assert _high(ref, got) is not None  # no sensitivity there: the per-dtype tolerance applies
    zeros = _high(ref, torch.zeros_like(ref), noise)
    assert zeros.check == "value_mismatch" and "high-magnitude" in zeros.message
    overflow = got.clone()
    overflow[3] = float("inf")
    assert _high(ref, overflow, noise).check == "nan_inf_mismatch"


def test_bf16_rounding_at_high_magnitude_is_precision_loss_although_under_one_percent():
    torch.manual_seed(0)
    ref = torch.randn(64, 64) * 300
    got = ref.to(torch.bfloat16).float()
    rel = float((got - ref).norm() / ref.norm())
    assert rel < 1e-2  # what the old rule (relative L2 <= 1 %) accepted
    noise = (ref * 4 * torch.finfo(torch.float32).eps).abs()  # a well-conditioned output: ~4 ulps
    failure = _high(ref, got, noise)
    assert failure is not None and failure.check == "precision_loss", failure


def test_honest_reassociation_at_high_magnitude_passes_with_the_measured_noise_floor():
    from tilesmith.gate.inputs import perturbed

    torch.manual_seed(0)
    # high-magnitude activations with a large common offset: the dot products cancel (sum of |terms| ≫ result)
    x = 1000 + torch.randn(64, 512)
    w = torch.randn(512, 256) / 512 ** 0.5
    w = w - w.mean(0)

    def reference(values):
        return torch.tanh(values[0] @ values[1])

    ref = reference([x, w])
    # an honest rewrite: the same sum accumulated in another order (chunks of 64, then the partial sums)
    honest = torch.tanh(sum(x[:, i:i + 64] @ w[i:i + 64] for i in range(448, -1, -64)))
    assert check_values(ref, honest, TOLERANCES["float32"]) is not None  # elementwise fp32 fails at cancellations
    noise = torch.maximum(*((reference(perturbed([x, w], s)) - ref).abs() for s in (1, 2)))
    assert _high(ref, honest, noise) is None
    cheap = torch.tanh(x.bfloat16().float() @ w.bfloat16().float())  # a bf16 matmul
    assert _high(ref, cheap, noise) is not None
