"""Input variants: layouts kept exactly, integer/boolean inputs stay valid, zero and high-magnitude
variants, and exact reproduction of the timing refresh factors."""

from __future__ import annotations

import pytest
import torch

from tilesmith.gate.inputs import apply_factors, clone_layout, make_variant, scale_ladder, timing_factors


def _layout(t):
    return tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype


@pytest.fixture
def base():
    torch.manual_seed(0)
    strided = torch.randn(10, 20)[:, 3:11]                      # non-contiguous, offset 3
    expanded = torch.randn(1, 8).expand(5, 8)                   # stride 0
    idx = torch.randint(0, 50, (32,))
    mask = torch.rand(4, 4) > 0.5
    masked = torch.tensor([0.0, float("-inf"), 2.0, float("nan")])
    return [strided, expanded, idx, mask, masked, 7, 0.5]


@pytest.mark.parametrize("variant", ["normal", "random", "zero", "high_magnitude"])
def test_layouts_and_scalars_are_kept(base, variant):
    out = make_variant(base, variant, seed=1, scale=64.0)
    for a, b in zip(base, out):
        if isinstance(a, torch.Tensor):
            assert _layout(a) == _layout(b)
        else:
            assert a == b


def test_normal_variant_is_the_captured_values(base):
    out = make_variant(base, "normal", seed=1)
    assert torch.equal(out[0], base[0]) and torch.equal(out[2], base[2])
    assert out[0].data_ptr() != base[0].data_ptr()


@pytest.mark.parametrize("variant", ["random", "zero", "high_magnitude"])
def test_integer_and_boolean_inputs_keep_their_values_as_a_permutation(base, variant):
    out = make_variant(base, variant, seed=5, scale=64.0)
    assert torch.equal(out[2].sort().values, base[2].sort().values)
    assert not torch.equal(out[2], base[2])
    assert out[3].sum() == base[3].sum()


def test_zero_variant_zeroes_floats_but_keeps_non_finite_markers(base):
    out = make_variant(base, "zero", seed=1)
    assert out[0].abs().sum() == 0 and out[1].abs().sum() == 0
    assert torch.isneginf(out[4][1]) and torch.isnan(out[4][3]) and out[4][0] == 0 and out[4][2] == 0


def test_random_variant_matches_the_captured_moments():
    torch.manual_seed(0)
    x = torch.randn(4096) * 3 + 10
    out = make_variant([x], "random", seed=2)[0]
    assert not torch.equal(out, x)
    assert out.mean().item() == pytest.approx(10, abs=0.3) and out.std().item() == pytest.approx(3, rel=0.1)
    const = make_variant([torch.ones(64)], "random", seed=2)[0]
    assert const.std() > 0.05  # a constant input (LayerNorm weight) still gets varied values


def test_variants_are_deterministic_in_their_seed(base):
    a, b, c = (make_variant(base, "random", seed=s) for s in (3, 3, 4))
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])


def test_high_magnitude_is_the_random_variant_scaled(base):
    plain = make_variant(base, "random", seed=9)
    high = make_variant(base, "high_magnitude", seed=9, scale=64.0)
    assert torch.allclose(high[0], plain[0] * 64)
    assert torch.equal(high[2], plain[2])


def test_scale_ladder_respects_the_dtype_range():
    assert scale_ladder([torch.randn(16)])[0] >= 128
    half = scale_ladder([torch.randn(16, dtype=torch.float16)])
    assert all(s <= 16 for s in half)
    assert scale_ladder([torch.full((4,), 60000.0, dtype=torch.float16)]) == []


def test_timing_factors_are_exact_and_reproducible(base):
    gen = torch.Generator().manual_seed(0)
    table = timing_factors(base, 50, gen)
    assert {f for row in table for f in row[:2]} <= {-2.0, -1.0, 1.0, 2.0}
    assert all(row[2] == row[3] == row[5] == 1.0 for row in table)
    bf = torch.randn(8, dtype=torch.bfloat16)
    scaled = apply_factors([bf], [-2.0])[0]
    assert torch.equal(scaled, bf * -2) and torch.equal(scaled / -2, bf)


def test_clone_layout_copies_only_the_reachable_storage():
    big = torch.randn(1000)
    view = big[500:510]
    copy = clone_layout(view)
    assert torch.equal(copy, view) and copy.storage_offset() == 500
    assert copy.untyped_storage().nbytes() == 510 * 4
