"""Tilesmith's native CUDA C++ kernels on a GPU (H200): each kernel against a float64 reference, odd sizes,
strided and misaligned inputs, special values, the matcher's fallbacks on real CUDA FX programs, the rewrite
on real CUDA wrappers, and one graph installed through ``tilesmith.compile`` with the built-in agent.

Run: ``python -m pytest -q -s tests/gpu/test_kernels_gpu.py`` (builds the four extensions on first use into
Tilesmith's kernel directory — ``TILESMITH_KERNEL_DIR``, default ``<cache root>/kernels`` — or reuses the build
``bench/kernels.py`` made). A failed build fails the module's first test with the compiler's message.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from tests import native_reference as ref
from tilesmith.kernels.runtime import FAMILIES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
BF, F16, F32 = torch.bfloat16, torch.float16, torch.float32
DEV = "cuda"


@pytest.fixture(scope="module")
def kernels():
    from tilesmith.kernels.build import ensure_built_many

    started = time.perf_counter()
    builds = ensure_built_many(FAMILIES, "cuda:0")
    failed = {f: str(b) for f, b in builds.items() if isinstance(b, Exception)}
    if failed:
        pytest.fail("native kernel build failed:\n" + "\n".join(f"{f}: {m}" for f, m in failed.items()), pytrace=False)
    for family, b in builds.items():
        how = "built" if b.built else "cached build loaded"
        print(f"\n[kernels] {family}: {how} in {b.seconds:.2f} s ({b.key.arch}, key {b.key.key[:12]})")
    print(f"[kernels] all {len(builds)} ready after {time.perf_counter() - started:.1f} s")
    return {f: b.module for f, b in builds.items()}


def close(got, want, dtype, *, rtol=None, atol=None):
    """Per-dtype tolerance against a float64 reference (the gate's rows for 16-bit, tighter for fp32)."""
    base = {BF: (1.6e-2, 1e-2), F16: (1e-2, 1e-3), F32: (3e-5, 1e-7)}[dtype]
    rtol = base[0] if rtol is None else rtol
    scale = max(1.0, float(want.double().abs().max())) if want.numel() else 1.0
    atol = (base[1] if atol is None else atol) * scale
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol, equal_nan=True)


# ------------------------------------------------------------------------------------------- int8 linear

INT8_SHAPES = [(1, 4096, 14336), (1, 257, 1024), (2, 130, 4096), (3, 96, 2048), (5, 64, 512), (8, 300, 1024),
               (16, 512, 2048), (16, 24, 64), (1, 100, 1000), (4, 33, 40)]


def int8_operands(m, n, k, *, seed=0, out=BF, scale_dtype=BF):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, device=DEV, generator=g).to(BF)
    w = torch.randint(-128, 128, (n, k), device=DEV, dtype=torch.int8, generator=g)
    s = (torch.rand(n, device=DEV, generator=g) * 0.02 + 0.001).to(scale_dtype)
    b = torch.randn(n, device=DEV, generator=g).to(out)
    r = torch.randn(m, n, device=DEV, generator=g).to(out)
    return x, w, s, b, r


@pytest.mark.parametrize("m,n,k", INT8_SHAPES)
@pytest.mark.parametrize("variant", [0, 1, 2, 3, 4])
def test_int8_linear_matches_the_reference(kernels, m, n, k, variant):
    mod = kernels["int8_linear"]
    x, w, s, b, r = int8_operands(m, n, k)
    got = mod.int8_linear(x, w, s, b, r, BF, variant)
    close(got, ref.int8_linear(x, w, s, b, r, BF), BF)
    if variant == 0 and (m, n, k) == (1, 4096, 14336):
        eager = r + (x @ w.to(BF).T) * s
        close(got, eager.double(), BF)


def test_int8_linear_epilogue_options_and_dtypes(kernels):
    mod = kernels["int8_linear"]
    x, w, s, b, r = int8_operands(3, 200, 512, out=F32, scale_dtype=F32)
    close(mod.int8_linear(x, w, None, None, None, BF, 0), ref.int8_linear(x, w), BF)
    close(mod.int8_linear(x, w, s, None, None, F32, 2), ref.int8_linear(x, w, s, out_dtype=F32), F32, rtol=8e-3)
    close(mod.int8_linear(x, w, s, b, r, F32, 1), ref.int8_linear(x, w, s, b, r, F32), F32, rtol=8e-3)


def test_int8_linear_strided_misaligned_and_batched_inputs(kernels):
    mod = kernels["int8_linear"]
    x, w, s, b, r = int8_operands(4, 128, 1024)
    strided = torch.randn(4, 2048, device=DEV).to(BF)[:, :1024].copy_(x)
    assert mod.int8_linear_kernel(strided, w, 0) == "mma"
    close(mod.int8_linear(strided, w, s, b, r, BF, 0), ref.int8_linear(x, w, s, b, r), BF)
    flat = torch.empty(4 * 1024 + 1, device=DEV, dtype=BF)
    misaligned = flat[1:].view(4, 1024).copy_(x)
    assert misaligned.data_ptr() % 16 != 0 and mod.int8_linear_kernel(misaligned, w, 0) == "scalar"
    close(mod.int8_linear(misaligned, w, s, b, r, BF, 0), ref.int8_linear(x, w, s, b, r), BF)
    r_strided = torch.randn(4, 256, device=DEV).to(BF)[:, :128].copy_(r)
    close(mod.int8_linear(x, w, s, b, r_strided, BF, 0), ref.int8_linear(x, w, s, b, r), BF)
    x3 = x.view(2, 2, 1024)
    got = mod.int8_linear(x3, w, s, None, None, BF, 0)
    assert got.shape == (2, 2, 128)
    close(got, ref.int8_linear(x3, w, s), BF)


def test_int8_linear_picks_its_kernel_and_refuses_what_it_cannot_take(kernels):
    mod = kernels["int8_linear"]
    x1, w, *_ = int8_operands(1, 64, 1024)
    x8, *_ = int8_operands(8, 64, 1024)
    assert mod.int8_linear_kernel(x1, w, 0) == "fma_splitk" and mod.int8_linear_kernel(x8, w, 0) == "mma"
    assert mod.int8_linear_kernel(x1, w, 1) == "fma" and mod.int8_linear_kernel(x1, w, 4) == "fma_splitk"
    x2, *_ = int8_operands(2, 64, 1024)
    assert mod.int8_linear_kernel(x2, w, 0) == "fma" and mod.int8_linear_kernel(x2, w, 4) == "fma"
    xo, wo, *_ = int8_operands(2, 64, 1000)
    assert mod.int8_linear_kernel(xo, wo, 0) == "scalar"
    x17, *_ = int8_operands(17, 64, 1024)
    with pytest.raises(RuntimeError, match="at most 16 rows"):
        mod.int8_linear(x17, w, None, None, None, BF, 0)
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        mod.int8_linear(x1.half(), w, None, None, None, BF, 0)
    with pytest.raises(RuntimeError, match="unit stride along K"):
        mod.int8_linear(x1, w.t().contiguous().t(), None, None, None, BF, 0)


# ----------------------------------------------------------------------------------------------- softmax

SOFTMAX_CASES = [  # rows, D, dtype, dual, scale, bias
    (64, 8192, F32, True, 1.0, False), (33, 1000, F32, False, 0.5, True), (7, 1, F32, False, 1.0, False),
    (5, 16387, F32, False, 1.0, False), (3, 40000, BF, False, 1.0, True), (128, 4096, BF, False, 0.125, True),
    (16, 2048, F16, True, 2.0, False), (4, 8195, F32, True, 1.0, True), (9, 333, BF, True, 1.0, True),
    # staged kernel (rows of >= 32 KB per row pair): more rows than SMs x stages, so every stage is refilled
    (1000, 8192, F32, True, 1.0, False), (300, 8192, F32, False, 0.5, True), (2000, 16384, BF, False, 1.0, True),
    (500, 8192, BF, True, 1.0, True), (1500, 16384, F16, False, 0.25, False), (20, 12288, F32, False, 1.0, False),
]


@pytest.mark.parametrize("rows,d,dtype,dual,scale,bias", SOFTMAX_CASES)
@pytest.mark.parametrize("variant", [0, 1, 2, 3])
def test_softmax_matches_the_reference(kernels, rows, d, dtype, dual, scale, bias, variant):
    mod = kernels["softmax"]
    g = torch.Generator(device=DEV).manual_seed(rows * d)
    a = (torch.randn(rows, d, device=DEV, generator=g) * 3).to(dtype)
    b = (torch.randn(rows, d, device=DEV, generator=g) * 3).to(dtype) if dual else None
    ba = torch.randn(d, device=DEV, generator=g).to(dtype) if bias else None
    bb = torch.randn(d, device=DEV, generator=g).to(dtype) if bias and dual else None
    got = mod.softmax(a, b, scale, ba, 0.75 if dual else 1.0, bb, variant)
    close(got, ref.softmax(a, b, scale, ba, 0.75 if dual else 1.0, bb).double(), dtype)
    if dtype == F32 and not bias and scale == 1.0:
        eager = torch.softmax(a, -1) + (torch.softmax(b * 0.75, -1) if dual else 0)
        close(got, eager.double(), F32)


def test_softmax_register_kernel_capacity_and_the_issue_shape(kernels):
    mod = kernels["softmax"]
    assert mod.register_capacity(F32, True) == 8192 and mod.register_capacity(F32, False) == 16384
    a, b = torch.randn(32768, 8192, device=DEV), torch.randn(32768, 8192, device=DEV)
    want = torch.softmax(a.double(), -1) + torch.softmax(b.double(), -1)
    staged = torch.cuda.get_device_capability()[0] >= 9
    assert mod.softmax_kernel(a, b, 0) == ("staged" if staged else "register")
    assert mod.softmax_kernel(a, b, 1) == "register" and mod.softmax_kernel(a, b, 2) == "looped"
    assert mod.softmax_kernel(a, b, 3) == ("staged" if staged else "register")
    for variant in (1, 3):
        close(mod.softmax(a, b, 1.0, None, 1.0, None, variant), want, F32)
    del want
    assert mod.softmax_kernel(a[:, :4096], b[:, :4096], 0) == ("staged" if staged else "register")  # 32 KB pairs
    assert mod.softmax_kernel(a[:, :2048], b[:, :2048], 0) == "register"  # 16 KB pairs: many blocks per SM instead
    assert mod.softmax_kernel(a[:, 1:8193 - 4], None, 3) == "register"  # misaligned rows: no bulk copies


@pytest.mark.parametrize("variant", [0, 2, 3])
@pytest.mark.parametrize("d", [256, 8192, 20000])
def test_softmax_special_values_follow_torch(kernels, variant, d):
    mod = kernels["softmax"]
    a = torch.randn(6, d, device=DEV)
    a[0, ::7] = float("-inf")
    a[1] = float("-inf")
    a[2, 5] = float("nan")
    a[3, 3] = float("inf")
    a[4, d // 2:] = float("-inf")
    got, want = mod.softmax(a, None, 1.0, None, 1.0, None, variant), torch.softmax(a, -1)
    assert torch.equal(got.isnan(), want.isnan())
    close(got, want.double(), F32)
    both = mod.softmax(a, a.flip(0), 1.0, None, 1.0, None, variant)
    assert torch.equal(both.isnan(), (want + torch.softmax(a.flip(0), -1)).isnan())


def test_softmax_strided_and_misaligned_rows(kernels):
    mod = kernels["softmax"]
    a = torch.randn(16, 2000, device=DEV)[:, :1000]
    close(mod.softmax(a, None, 1.0, None, 1.0, None, 0), torch.softmax(a.double(), -1), F32)
    flat = torch.randn(16 * 1000 + 1, device=DEV)
    mis = flat[1:].view(16, 1000)
    close(mod.softmax(mis, mis, 1.0, None, 1.0, None, 0), 2 * torch.softmax(mis.double(), -1), F32)
    wide = torch.randn(400, 16384, device=DEV)[:, 4096:12288]  # row stride 16384, 16-byte aligned: staged
    for variant in (0, 1, 3):
        close(mod.softmax(wide, wide, 1.0, None, 0.5, None, variant),
              torch.softmax(wide.double(), -1) + torch.softmax(wide.double() * 0.5, -1), F32)
    a3 = torch.randn(2, 3, 512, device=DEV)
    got = mod.softmax(a3, None, 1.0, None, 1.0, None, 0)
    assert got.shape == a3.shape and got.is_contiguous()
    close(got, torch.softmax(a3.double(), -1), F32)


# -------------------------------------------------------------------------------------------------- norm

NORM_CASES = [  # rows, D, dtype, layer_norm, residual, weight, bias, return_sum, round_before_weight
    (256, 4096, BF, False, True, True, False, True, True), (256, 4096, BF, True, True, True, True, True, False),
    (7, 1001, BF, True, True, True, True, False, False), (3, 16384, F32, False, False, True, False, False, False),
    (5, 16384, BF, True, True, False, False, False, False), (9, 100, F16, False, True, True, False, True, False),
    (4, 1, F32, True, False, True, True, False, False), (33, 768, F32, True, True, True, True, True, False),
    (300, 4096, F16, True, True, True, True, True, False), (64, 16384, BF, False, True, True, False, True, True),
    (17, 16384, F32, True, True, True, True, False, False), (11, 4104, BF, True, True, True, True, True, False),
]


@pytest.mark.parametrize("rows,d,dtype,ln,res,weight,bias,ret,rbw", NORM_CASES)
@pytest.mark.parametrize("variant", [0, 1])
def test_norms_match_the_reference(kernels, rows, d, dtype, ln, res, weight, bias, ret, rbw, variant):
    mod = kernels["norm"]
    g = torch.Generator(device=DEV).manual_seed(rows + d)
    x = (torch.randn(rows, d, device=DEV, generator=g) * 2 + 0.5).to(dtype)
    r = torch.randn(rows, d, device=DEV, generator=g).to(dtype) if res else None
    w = (torch.rand(d, device=DEV, generator=g) + 0.5).to(dtype) if weight else None
    b = torch.randn(d, device=DEV, generator=g).to(dtype) if bias else None
    if ln:
        got, want = mod.layer_norm(x, r, w, b, 1e-5, ret, variant), ref.layer_norm(x, r, w, b, 1e-5, ret)
    else:
        got, want = mod.rms_norm(x, r, w, 1e-6, rbw, ret, variant), ref.rms_norm(x, r, w, 1e-6, rbw, ret)
    assert len(got) == len(want) == (2 if ret else 1)
    close(got[0], want[0].double(), dtype, rtol=3e-5 if dtype == F32 else None, atol=3e-6 if dtype == F32 else None)
    if ret:
        assert torch.equal(got[1], want[1])  # x + r in the input dtype, bit for bit
    if ln and dtype == BF and res and weight and bias:
        eager = torch.nn.functional.layer_norm(x + r, (d,), w, b, 1e-5)
        close(got[0], eager.double(), BF)


def test_norm_issue_shape_strided_input_and_limits(kernels):
    mod = kernels["norm"]
    x, r = torch.randn(32768, 4096, device=DEV, dtype=BF), torch.randn(32768, 4096, device=DEV, dtype=BF)
    w = torch.rand(4096, device=DEV, dtype=BF) + 0.5
    out, h = mod.rms_norm(x, r, w, 1e-6, True, True)
    close(out, ref.rms_norm(x, r, w, 1e-6, True)[0].double(), BF)
    assert torch.equal(h, x + r)
    b = torch.randn(4096, device=DEV, dtype=BF)
    want = torch.nn.functional.layer_norm((x + r).double(), (4096,), w.double(), b.double(), 1e-5)
    for variant in (0, 1):
        close(mod.layer_norm(x, r, w, b, 1e-5, False, variant)[0], want, BF)
    del want
    big = torch.randn(64, 8192, device=DEV, dtype=BF)
    xs = big[:, :4096]
    close(mod.layer_norm(xs, None, w, None, 1e-5, False)[0], ref.layer_norm(xs, None, w)[0].double(), BF)
    assert mod.max_d(BF) == mod.max_d(F32) == 16384
    from tilesmith.agent.builtin.native_match import NORM_MAX_D

    assert NORM_MAX_D == mod.max_d(BF)
    with pytest.raises(RuntimeError, match="rows of at most 16384"):
        mod.rms_norm(torch.randn(2, 16392, device=DEV), None, None, 1e-6, False, False)


# -------------------------------------------------------------------------------------------- group_norm

GN_CASES = [  # N, C, spatial, G, dtype, weight, bias, silu
    (16, 512, (64, 64), 32, BF, True, True, True),     # the benchmark shape: register kernel, cluster of 8
    (2, 320, (32, 32), 32, F16, True, True, True),     # groups of 10240
    (4, 64, (16, 16), 64, F32, True, True, True),      # groups of one channel
    (3, 96, (8, 8), 1, BF, True, False, False),        # one group per sample
    (2, 32, (7, 7), 8, BF, True, True, True),          # HW = 49: scalar path
    (5, 12, (3, 5), 4, F32, False, False, True),       # C/G*HW = 45, no affine
    (2, 8, (33,), 2, F16, False, True, False),         # 3-D input, odd length
    (2, 16, (2, 3, 4), 4, BF, True, True, True),       # 5-D input
    (1, 2048, (32, 32), 2, BF, True, True, True),      # groups of 2^20: looped kernel
    (2, 256, (128, 128), 8, F32, True, True, True),    # groups of 2^19 fp32: looped, cluster split
    (3, 6, (), 3, F32, True, True, True),              # [N, C]: HW = 1
]


def gn_operands(n, c, spatial, dtype, weight, bias, *, seed=0, wdtype=None):
    g = torch.Generator(device=DEV).manual_seed(seed + n * c)
    x = (torch.randn(n, c, *spatial, device=DEV, generator=g) * 2 + 0.7).to(dtype)
    w = (torch.rand(c, device=DEV, generator=g) + 0.5).to(wdtype or dtype) if weight else None
    b = torch.randn(c, device=DEV, generator=g).to(wdtype or dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("n,c,spatial,groups,dtype,weight,bias,silu", GN_CASES)
@pytest.mark.parametrize("variant", [0, 1, 2, 3, 4])
def test_group_norm_matches_the_reference(kernels, n, c, spatial, groups, dtype, weight, bias, silu, variant):
    mod = kernels["group_norm"]
    x, w, b = gn_operands(n, c, spatial, dtype, weight, bias)
    got = mod.group_norm(x, w, b, groups, 1e-5, silu, False, variant)
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
    close(got, ref.group_norm(x, w, b, groups, 1e-5, silu).double(), dtype, atol=3e-6 if dtype == F32 else None)
    if variant == 0 and dtype != F32:
        eager = torch.nn.functional.group_norm(x, groups, w, b, 1e-5)
        close(got, (torch.nn.functional.silu(eager) if silu else eager).double(), dtype)


def test_group_norm_picks_its_kernel(kernels):
    mod = kernels["group_norm"]
    hopper = torch.cuda.get_device_capability()[0] >= 9
    x = torch.randn(16, 512, 64, 64, device=DEV, dtype=BF)
    assert mod.group_norm_kernel(x, 32, 0) == ("register cluster=8 threads=128 vectors=8" if hopper else
                                               mod.group_norm_kernel(x, 32, 2))
    assert mod.group_norm_kernel(x, 32, 4).startswith("register cluster=8 threads=256 vectors=4" if hopper else "looped")
    assert mod.group_norm_kernel(x, 32, 2).startswith("looped") and mod.group_norm_kernel(x, 32, 3).startswith("scalar")
    small = torch.randn(2, 64, 8, 8, device=DEV, dtype=BF)
    assert mod.group_norm_kernel(small, 32, 0) == "register cluster=1 threads=32 vectors=1"
    assert mod.group_norm_kernel(torch.randn(2, 32, 7, 7, device=DEV, dtype=BF), 8, 0).startswith("scalar")
    flat = torch.empty(2 * 64 * 8 * 8 + 1, device=DEV, dtype=BF)
    misaligned = flat[1:].view(2, 64, 8, 8)
    assert mod.group_norm_kernel(misaligned, 32, 0).startswith("scalar")
    with pytest.raises(RuntimeError, match="variant must be"):
        mod.group_norm_kernel(small, 32, 7)


def test_group_norm_the_benchmark_shape_against_eager(kernels):
    mod = kernels["group_norm"]
    x, w, b = gn_operands(16, 512, (64, 64), BF, True, True, seed=1)
    eager = torch.nn.functional.silu(torch.nn.functional.group_norm(x, 32, w, b, 1e-5))
    want = ref.group_norm(x, w, b, 32, 1e-5, True).double()
    for variant in (0, 1, 2, 4):
        got = mod.group_norm(x, w, b, 32, 1e-5, True, False, variant)
        close(got, want, BF)
        close(got, eager.double(), BF)
    y = mod.group_norm(x, w, b, 32, 1e-5, True, False, 0)
    assert torch.equal(y, mod.group_norm(x, w, b, 32, 1e-5, True, False, 0))  # deterministic


def test_group_norm_options_layouts_and_refusals(kernels):
    mod = kernels["group_norm"]
    x, w, b = gn_operands(4, 64, (16, 16), BF, True, True, wdtype=F32)  # fp32 weight/bias with bf16 x
    close(mod.group_norm(x, w, b, 8, 1e-5, True, False, 0), ref.group_norm(x, w, b, 8, 1e-5, True).double(), BF)
    close(mod.group_norm(x, w, b, 8, 1e-5, True, True, 0), ref.group_norm(x, w, b, 8, 1e-5, True, True).double(), BF)
    flat = torch.randn(4 * 64 * 16 * 16 + 1, device=DEV).to(BF)
    misaligned = flat[1:].view(4, 64, 16, 16)
    close(mod.group_norm(misaligned, w, b, 8, 1e-5, True, False, 0),
          ref.group_norm(misaligned, w, b, 8, 1e-5, True).double(), BF)
    # mean 1000, spread 1 (fp32): E[x^2] - E[x]^2 in fp32 would be off by ~6 %; the merged (n, mean, M2) is not
    big = torch.randn(2, 8, 64, 64, device=DEV) + 1000.0
    for variant in (0, 2, 3):
        close(mod.group_norm(big, None, None, 2, 1e-6, False, False, variant),
              ref.group_norm(big, None, None, 2, 1e-6, False).double(), F32, rtol=1e-4, atol=1e-4)
    special = torch.randn(2, 8, 4, 4, device=DEV)
    special[0, 0, 0, 0] = float("nan")
    got = mod.group_norm(special, None, None, 4, 1e-5, True, False, 0)
    assert got[0, :2].isnan().all() and not got[0, 2:].isnan().any() and not got[1].isnan().any()
    cl = x.to(memory_format=torch.channels_last)
    with pytest.raises(RuntimeError, match="must be contiguous NCHW"):
        mod.group_norm(cl, w, b, 8, 1e-5, True, False, 0)
    with pytest.raises(RuntimeError, match="must be contiguous NCHW"):
        mod.group_norm(x[:, :32], None, None, 8, 1e-5, True, False, 0)
    with pytest.raises(RuntimeError, match="must be positive and divide the channels"):
        mod.group_norm(x, w, b, 7, 1e-5, True, False, 0)
    with pytest.raises(RuntimeError, match="weight must have 64 elements"):
        mod.group_norm(x, w[:32], b, 8, 1e-5, True, False, 0)
    with pytest.raises(RuntimeError, match="must be a CUDA tensor"):
        mod.group_norm(x.cpu(), None, None, 8, 1e-5, True, False, 0)
    assert mod.group_norm(x[:0], w, b, 8, 1e-5, True, False, 0).shape == (0, 64, 16, 16)


def test_group_norm_runs_inside_a_cuda_graph(kernels):
    mod = kernels["group_norm"]
    x, w, b = gn_operands(16, 512, (64, 64), BF, True, True, seed=2)
    want = mod.group_norm(x, w, b, 32, 1e-5, True, False, 0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the cluster launch (cudaLaunchKernelEx) is captured on the current stream
        out = mod.group_norm(x, w, b, 32, 1e-5, True, False, 0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


# ----------------------------------------------------------------------------- matcher and rewrite on CUDA

def _int8_fn(x, w, s, r):
    return r + (x @ w.to(torch.bfloat16).T) * s


def _int8_fp16_fn(x, w, s, r):
    return r + (x @ w.to(torch.float16).T) * s


def _sm2_fn(a, b):
    return torch.softmax(a, -1) + torch.softmax(b, -1)


def _rms_fn(x, r, w):
    h = x + r
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w, h


class _Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _gn_fn(x, w, b):
    return torch.nn.functional.silu(torch.nn.functional.group_norm(x, 32, w, b, 1e-5))


def _cases():
    x, w, s, _, r = int8_operands(1, 4096, 14336)
    gx, gw, gb = gn_operands(8, 256, (32, 32), BF, True, True)
    return {
        "group_norm": (_gn_fn, (gx, gw, gb)),
        "int8_linear": (_int8_fn, (x, w, s, r)),
        "softmax": (_sm2_fn, (torch.randn(512, 8192, device=DEV), torch.randn(512, 8192, device=DEV))),
        "norm": (_rms_fn, (torch.randn(512, 4096, device=DEV, dtype=BF), torch.randn(512, 4096, device=DEV, dtype=BF),
                           torch.rand(4096, device=DEV, dtype=BF) + 0.5)),
    }


def test_matcher_falls_back_on_other_dtypes_and_dynamic_shapes():
    from bench.harness import Workload, capture_graphs
    from tilesmith.agent.builtin.native_match import NoMatch, match_program

    x, w, s, _, r = int8_operands(1, 256, 512)
    assert match_program(capture_graphs(Workload(_Fn(_int8_fn), (x, w, s, r)))[0].fx_program).family == "int8_linear"
    with pytest.raises(NoMatch, match="not bf16"):
        match_program(capture_graphs(Workload(_Fn(_int8_fp16_fn), (x.half(), w, s.half(), r.half())))[0].fx_program)
    a = torch.randn(64, 1024, device=DEV)
    torch._dynamo.mark_dynamic(a, 0)
    with pytest.raises(NoMatch, match="dynamic shapes"):
        match_program(capture_graphs(Workload(_Fn(lambda t: torch.softmax(t, -1)), (a,)))[0].fx_program)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_native_candidate_matches_the_original_cuda_wrapper(kernels, family):
    from bench.harness import Workload, capture_graphs
    from tests import gate_support as gs
    from tilesmith.agent.builtin.base import GraphContext
    from tilesmith.agent.builtin.native import NativeKernelGenerator
    from tilesmith.gate.host.static_scan import scan
    from tilesmith.gate.layout import clone_layout
    from tilesmith.install.loader import load_wrapper

    fn, inputs = _cases()[family]
    fx = capture_graphs(Workload(_Fn(fn), inputs))[0].fx_program
    cap = gs.capture(_Fn(fn), *inputs)[0]
    ctx = GraphContext(device="cuda:0", agency="medium", fx_program=fx)
    gen = NativeKernelGenerator()
    assert gen.inapplicable(cap.source, ctx) is None
    proposal = gen.propose(cap.source, ctx)
    print(f"\n[{family}] {proposal.note}")
    assert scan(proposal.source) == []
    module = load_wrapper(proposal.source, cap.constants)
    # gate_support.capture records the first call's inputs as CPU copies (the gate's snapshot form)
    got = module.call([clone_layout(t, DEV) for t in cap.inputs])
    want = cap.ref_fn([clone_layout(t, DEV) for t in cap.inputs])
    assert len(got) == len(want)
    for g_, w_ in zip(got, want, strict=True):
        assert g_.stride() == w_.stride()
        close(g_, w_.double(), w_.dtype, rtol=1e-4 if w_.dtype == F32 else None,
              atol=1e-6 if w_.dtype == F32 else None)


def _compile_installs_native(model, inputs, tmp_path, monkeypatch, tag):
    """tilesmith.compile with the built-in agent; the gate accepts the native_kernels candidate (returns records)."""
    import tilesmith
    from tilesmith.kernels.runtime import kernel_dir

    monkeypatch.setenv("TILESMITH_KERNEL_DIR", str(kernel_dir()))  # reuse the build above
    monkeypatch.setenv("TILESMITH_CACHE_DIR", str(tmp_path / "ts"))
    monkeypatch.delenv("TILESMITH_ALLOW_CPU", raising=False)
    torch._dynamo.reset()
    compiled = tilesmith.compile(model, example_inputs=inputs, agent_model="tilesmith/builtin", loops=1)
    started = time.perf_counter()
    with torch.no_grad():
        close(compiled(*inputs), model(*inputs).double(), BF)
        close(compiled(*inputs), model(*inputs).double(), BF)
    records = tilesmith.benchmarks(compiled)
    diagnostics = tilesmith.diagnostics(compiled)
    print(f"\n[e2e {tag}] {time.perf_counter() - started:.1f} s; diagnostics: "
          f"{[(d.kind, d.message[:300]) for d in diagnostics]}")
    for rec in records:
        print(f"[e2e {tag}] benchmark {rec.graph_name}: torch_inductor_ms={rec.torch_inductor_ms:.4f} "
              f"tilesmith_ms={rec.tilesmith_ms:.4f} speedup={rec.speedup:.2f} ci={rec.speedup_ci} "
              f"roofline_floor_ms={rec.roofline_floor_ms}")
    evaluations = [e for p in sorted((tmp_path / "ts").glob("runs/*/*/track.json"))
                   for e in json.loads(p.read_text()).get("evaluations", [])]
    for e in evaluations:
        print(f"[e2e {tag}] evaluation {e.get('proposer')}: {e.get('status')} speedup {e.get('speedup')} "
              f"confirmation {e.get('confirmation_speedup')} {e.get('reasons', [])[:2]}")
    assert records, diagnostics
    accepted = [e.get("proposer") for e in evaluations if e.get("accepted")]
    assert "builtin:native_kernels" in accepted
    torch._dynamo.reset()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"kernels-e2e-{tag}.json").write_text(json.dumps(
            [{"graph": r.graph_name, "torch_inductor_ms": r.torch_inductor_ms, "tilesmith_ms": r.tilesmith_ms,
              "speedup": r.speedup, "speedup_ci": list(r.speedup_ci), "roofline_floor_ms": r.roofline_floor_ms,
              "accepted": accepted} for r in records], indent=1))
    return records


def test_compile_with_the_builtin_agent_installs_the_native_int8_gemv(kernels, tmp_path, monkeypatch):
    fn, inputs = _cases()["int8_linear"]
    _compile_installs_native(_Fn(fn), inputs, tmp_path, monkeypatch, "int8")


def test_compile_with_the_builtin_agent_installs_the_native_group_norm(kernels, tmp_path, monkeypatch):
    """The benchmark case groupnorm_silu_bf16: examples.models.GroupNormSiLU(512, 32), x 16x512x64x64 bf16."""
    from examples.models import GroupNormSiLU

    torch.manual_seed(0)
    model = GroupNormSiLU(512, 32).to(device=DEV, dtype=BF).eval().requires_grad_(False)
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.normal_()
    x = torch.randn(16, 512, 64, 64, device=DEV, dtype=BF)
    _compile_installs_native(model, (x,), tmp_path, monkeypatch, "group_norm")
