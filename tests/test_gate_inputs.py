"""Input variants: layouts kept exactly, integer/boolean inputs stay valid, zero and high-magnitude
variants, and exact reproduction of the timing refresh factors."""

from __future__ import annotations

import pytest
import torch

from tilesmith.gate.inputs import (accumulates, apply_factors, clone_layout, make_variant, perturbed, scale_ladder,
                                   timing_factors)


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
def test_conservative_variant_permutes_integer_and_boolean_inputs(base, variant):
    out = make_variant(base, variant, seed=5, scale=64.0, vary=False)
    assert torch.equal(out[2].sort().values, base[2].sort().values)
    assert not torch.equal(out[2], base[2])
    assert out[3].sum() == base[3].sum()


@pytest.mark.parametrize("variant", ["random", "zero", "high_magnitude"])
def test_varied_integers_stay_in_the_captured_range_widened_towards_zero(base, variant):
    out = make_variant(base, variant, seed=5, scale=64.0)
    lo, hi = int(base[2].min()), int(base[2].max())
    assert int(out[2].min()) >= min(lo, 1) and int(out[2].max()) <= hi
    assert not torch.equal(out[2].sort().values, base[2].sort().values)  # new values, not a permutation


def test_one_element_position_gets_another_smaller_valid_value():
    seen = {int(make_variant([torch.tensor([5])], "random", seed=s)[0]) for s in range(20)}
    assert seen <= {1, 2, 3, 4} and len(seen) >= 3
    assert int(make_variant([torch.tensor([-3])], "random", seed=1)[0]) in (-2, -1)
    assert int(make_variant([torch.tensor([0, 4])], "random", seed=1)[0].min()) >= 0


def test_zero_is_drawn_only_when_the_captured_values_contain_it():
    values = torch.cat([make_variant([torch.tensor([1, 2, 3, 2])], "random", seed=s)[0] for s in range(30)])
    assert int((values == 0).sum()) == 0 and int(values.min()) >= 1


def test_all_true_mask_gets_partially_false_patterns():
    mask = torch.ones(32, 64, dtype=torch.bool)
    out = make_variant([mask], "random", seed=3)[0]
    assert 0.6 < float(out.float().mean()) < 0.9
    flags = {bool(make_variant([torch.tensor([True])], "random", seed=s)[0]) for s in range(10)}
    assert flags == {True, False}


def test_unique_indices_stay_unique_unless_the_graph_accumulates():
    idx = torch.randperm(128)[:64]
    plain = make_variant([idx], "random", seed=4)[0]
    assert plain.unique().numel() == 64 and not torch.equal(plain.sort().values, idx.sort().values)
    dup = make_variant([idx], "random", seed=4, duplicates=True)[0]
    assert dup.unique().numel() < 64 and int(dup.min()) >= 0 and int(dup.max()) <= int(idx.max())
    assert accumulates("atomic_add_vec<float, 2, 1>(out_ptr0, tmp12, tmp9);")
    assert accumulates("tl.atomic_add(out_ptr0 + (x0), tmp5, sem='relaxed')")
    assert not accumulates("tmp0 = tl.load(in_ptr0 + (x0))")


def test_infinite_positions_move_within_their_row_keeping_the_count():
    mask = torch.zeros(8, 64)
    mask[:, 48:] = float("-inf")
    out = make_variant([mask], "random", seed=2)[0]
    assert torch.equal(torch.isneginf(out).sum(1), torch.full((8,), 16))
    assert not torch.equal(torch.isneginf(out), torch.isneginf(mask))
    zero = make_variant([mask], "zero", seed=2)[0]
    assert torch.equal(torch.isneginf(zero), torch.isneginf(mask))
    kept = make_variant([mask], "random", seed=2, vary=False)[0]
    assert torch.equal(torch.isneginf(kept), torch.isneginf(mask))


def test_perturbed_inputs_differ_by_a_few_ulps_only():
    x = torch.randn(1000)
    p = perturbed([x, torch.tensor([3])], seed=1)
    rel = ((p[0] - x) / x).abs()
    assert 0 < float(rel.max()) <= 5 * torch.finfo(torch.float32).eps and torch.equal(p[1], torch.tensor([3]))


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


def test_variant_moments_are_memoized_per_tensor_and_recomputed_after_an_in_place_change():
    """A worker builds every variant from the same base tensors, so their moments are computed once; an in-place
    change (a new version) or another tensor at a reused address is never served stale moments."""
    from tilesmith.gate import inputs

    t = torch.randn(64, 64, generator=torch.Generator().manual_seed(3))
    first = inputs._float_moments(t)
    assert inputs._float_moments(t) == first and inputs._MOMENTS[id(t)][2] == first
    t.mul_(10.0)
    mean, std = inputs._float_moments(t)
    assert std == pytest.approx(10 * first[1], rel=1e-6) and mean == pytest.approx(10 * first[0], rel=1e-6)
    other = torch.full((8,), 5.0)
    assert inputs._float_moments(other) == (5.0, 0.5)  # std 0: a tenth of the mean
    same_values = [inputs.build([t.clone()], inputs.recipe("random", 7)) for _ in range(2)]
    assert torch.equal(same_values[0][0], same_values[1][0])
