"""Output comparison against the original Inductor wrapper: structure, NaN/Inf positions and values.

Tolerances (see docs/gate.md for the full table and sources). For floating outputs an element passes
when ``|got - expected| <= atol * scale + rtol * |expected|`` with ``scale = max(1, rms(expected))``
(so ``atol`` is absolute for outputs of magnitude ≤ 1 and relative to the output's own magnitude for
larger ones), and the whole output passes only when, in addition, its relative L2 error
``||got - expected||₂ / ||expected||₂`` is at most ``rel_l2``. The second test is what stops an all-zero
(or constant) output from passing a loose ``atol`` on a small-magnitude reference (KernelBench issue
#165). NaN, +Inf and -Inf must sit at exactly the same positions. Integers and booleans must be equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tilesmith.gate.layout import bits, poison_pattern
from tilesmith.records import CheckFailure


@dataclass(frozen=True)
class Tolerance:
    """One row of the tolerance table."""

    name: str
    rtol: float
    atol: float
    rel_l2: float
    source: str


TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance("float64", 1e-7, 1e-7, 1e-7,
                         "torch.testing.assert_close defaults for float64 (rtol 1e-7, atol 1e-7); rel_l2 = rtol"),
    "float32": Tolerance("float32", 1e-4, 1e-5, 2e-5,
                         "rtol: KernelBench fp32 tolerance 1e-4 (src/kernelbench/eval.py, per-precision); "
                         "atol: torch.testing.assert_close float32 default 1e-5; rel_l2: ~300 fp32 ulps, "
                         "below TF32's unit roundoff 4.9e-4 so a TF32/bf16 downgrade fails"),
    "tf32": Tolerance("tf32", 5e-3, 5e-3, 2e-3,
                      "float32 outputs of graphs whose matmuls/convolutions run in TF32 under the user's flags: "
                      "PyTorch's TF32 test precision 5e-3 (torch.testing._internal tf32_on_and_off(0.005)); "
                      "rel_l2 ~4 TF32 unit roundoffs"),
    "bfloat16": Tolerance("bfloat16", 1.6e-2, 1e-2, 8e-3,
                          "rtol: torch.testing.assert_close bfloat16 default 1.6e-2; atol: KernelBench bf16 1e-2; "
                          "rel_l2: 2 bf16 unit roundoffs (2^-8)"),
    "float16": Tolerance("float16", 1e-2, 1e-3, 2e-3,
                         "rtol: KernelBench fp16 1e-2; atol: 1e-3 (10x assert_close's 1e-5: different kernels "
                         "round differently); rel_l2: 4 fp16 unit roundoffs (2^-11)"),
    "float8_e4m3": Tolerance("float8_e4m3", 0.125, 1.6e-2, 0.07,
                             "one e4m3 ulp at 1.0 (2^-3) relative; atol 1/64; rel_l2 about one unit roundoff (2^-4)"),
    "float8_e5m2": Tolerance("float8_e5m2", 0.25, 3.2e-2, 0.14,
                             "one e5m2 ulp at 1.0 (2^-2) relative; atol 1/32; rel_l2 about one unit roundoff (2^-3)"),
}
#: Rows a failing output is re-tried against to say "this looks like a precision downgrade".
_LOOSER = {"float64": ("float32",), "float32": ("tf32", "bfloat16", "float16"), "tf32": ("bfloat16", "float16")}


def tolerance_for(dtype: torch.dtype, tf32: bool) -> Tolerance | None:
    """The row for ``dtype``; ``None`` means exact equality (integers, booleans)."""
    if dtype.is_complex:
        dtype = torch.float64 if dtype == torch.complex128 else torch.float32
    if not dtype.is_floating_point:
        return None
    if dtype == torch.float64:
        return TOLERANCES["float64"]
    if dtype == torch.float32:
        return TOLERANCES["tf32" if tf32 else "float32"]
    if dtype == torch.bfloat16:
        return TOLERANCES["bfloat16"]
    if dtype == torch.float16:
        return TOLERANCES["float16"]
    name = str(dtype)
    if "e5m2" in name:
        return TOLERANCES["float8_e5m2"]
    return TOLERANCES["float8_e4m3"]


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def _index(flat_index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    idx = []
    for size in reversed(shape):
        idx.append(flat_index % size if size else 0)
        flat_index = flat_index // size if size else 0
    return tuple(reversed(idx))


@dataclass
class ValueReport:
    """Why one tensor failed: ``kind`` is ``"uninitialized"``, ``"nan_inf"`` or ``"value"``."""

    kind: str
    count: int
    total: int
    worst_index: tuple[int, ...]
    expected: str
    got: str
    detail: str


def _as_real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


#: Upper bound of the relative L2 limit on the high-magnitude variant (never looser than this).
HIGH_MAGNITUDE_REL_L2 = 1e-2
#: How many times the reference's own rounding sensitivity (its noise floor) a candidate may differ by on
#: the high-magnitude variant. At large input scales a bounded function (tanh, softmax, normalization)
#: turns the rounding error of a reordered sum — proportional to the sum of |terms|, not to the result —
#: into large per-element differences where the terms cancel. The gate measures that sensitivity: the
#: reference on the same inputs perturbed by a few ulps (:func:`tilesmith.gate.inputs.perturbed`), twice;
#: an honest reassociation (loop → BLAS, other block sizes) stays within a small multiple of it, while a
#: cheaper format (bf16 rounding at 2^-9) exceeds it by orders of magnitude. 16 = the ratio of sequential-
#: summation error (~eps·K/√2·|term|) to the 4-ulp perturbation (~4·eps·√K·|term|) at K = 512, ×4 margin.
NOISE_FACTOR = 16.0


def check_values(expected: torch.Tensor, got: torch.Tensor, tol: Tolerance | None,
                 poison_byte: int | None = None, elementwise: bool = True,
                 noise: torch.Tensor | None = None) -> ValueReport | None:
    """Compare two tensors of the same shape and dtype; ``None`` when ``got`` passes.

    ``elementwise=False`` (the high-magnitude variant) keeps the NaN/Inf, poison and integer checks and
    scales the tolerance to the reference's rounding sensitivity ``noise`` (``|ref(perturbed) − ref|``,
    same shape; ``None`` = 0): element ``i`` passes when ``|err_i| ≤ atol·scale + rtol·|e_i| +
    NOISE_FACTOR·(noise_i + rms(noise))`` (a non-finite noise element allows anything there), and the
    output when also ``rel_l2 ≤ min(HIGH_MAGNITUDE_REL_L2, max(tol.rel_l2, NOISE_FACTOR·‖noise‖/‖e‖))``.
    """
    shape = tuple(expected.shape)
    total = expected.numel()
    if total == 0:
        return None
    if _bit_identical(expected, got):
        # Every check below passes on identical bits: no poisoned element the reference lacks, the same
        # NaN/±Inf positions, zero error (≤ any tolerance, relative L2 0). One pass instead of ~20.
        return None
    if poison_byte is not None and got.dtype != torch.bool:
        pattern = poison_pattern(got.dtype, poison_byte)
        gb, eb = bits(got).reshape(-1), bits(expected).reshape(-1)
        poisoned = (gb == pattern) & (eb != pattern)
        if bool(poisoned.any()):
            first = int(poisoned.nonzero()[0, 0])
            idx = _index(first, shape)
            return ValueReport("uninitialized", int(poisoned.sum()), total, idx,
                               _fmt_elem(expected, idx), _fmt_elem(got, idx),
                               f"they still hold the byte pattern 0x{poison_byte:02X} the gate wrote into fresh memory")
    if tol is None:
        diff = (expected != got).reshape(-1)
        if bool(diff.any()):
            first = int(diff.nonzero()[0, 0])
            idx = _index(first, shape)
            return ValueReport("value", int(diff.sum()), total, idx, _fmt_elem(expected, idx), _fmt_elem(got, idx),
                               "integer and boolean outputs must be exactly equal")
        return None
    wide = expected.dtype in (torch.float64, torch.complex128)
    e = _as_real(expected).double() if wide else _as_real(expected).float()
    g = _as_real(got).double() if wide else _as_real(got).float()
    e, g = e.reshape(-1), g.reshape(-1)
    real_shape = shape + ((2,) if expected.is_complex() else ())
    finite = torch.isfinite(e)
    all_finite = bool(finite.all()) and bool(torch.isfinite(g).all())
    # With every element of both finite the NaN/±Inf positions agree (none anywhere): skip their three checks.
    for name, fn in () if all_finite else (("NaN", torch.isnan), ("+Inf", torch.isposinf), ("-Inf", torch.isneginf)):
        differ = fn(e) != fn(g)
        if bool(differ.any()):
            first = int(differ.nonzero()[0, 0])
            idx = _index(first, real_shape)
            return ValueReport("nan_inf", int(differ.sum()), total, idx, _fmt(float(e[first])), _fmt(float(g[first])),
                               f"{name} positions differ from the original's")
    ef, gf = (e, g) if all_finite else (e[finite], g[finite])
    if ef.numel() == 0:
        return None
    err = (gf - ef).abs()
    scale = max(1.0, float(ef.pow(2).mean().sqrt()))
    allowed = tol.atol * scale + tol.rtol * ef.abs()
    norm = float(ef.norm())
    rel = float((gf - ef).norm()) / norm if norm > 0 else 0.0
    limit = tol.rel_l2
    if not elementwise:
        floor, floor_rel = _noise_floor(noise, finite, norm, ef.numel())
        allowed = allowed + NOISE_FACTOR * floor
        limit = min(HIGH_MAGNITUDE_REL_L2, max(tol.rel_l2, NOISE_FACTOR * floor_rel))
    bad = err > allowed
    if not bool(bad.any()) and (rel <= limit or norm == 0):
        return None
    excess = err - allowed
    worst_local = int(excess.argmax())
    positions = finite.nonzero().reshape(-1)
    first = int(positions[worst_local])
    idx = _index(first, real_shape)
    if elementwise:
        detail = (f"|err| {_fmt(float(err[worst_local]))} vs allowed {_fmt(float(allowed[worst_local]))} "
                  f"(atol {tol.atol:g}×scale {scale:.3g} + rtol {tol.rtol:g}×|expected|); relative L2 error "
                  f"{rel:.3g} (limit {tol.rel_l2:g}); tolerance row {tol.name}")
    else:
        detail = (f"|err| {_fmt(float(err[worst_local]))} vs allowed {_fmt(float(allowed[worst_local]))} "
                  f"(atol {tol.atol:g}×scale {scale:.3g} + rtol {tol.rtol:g}×|expected| + {NOISE_FACTOR:g}× the "
                  f"original's own rounding sensitivity at these high-magnitude inputs); relative L2 error "
                  f"{rel:.3g} (limit {limit:.3g}); tolerance row {tol.name}")
    return ValueReport("value", int(bad.sum()), total, idx, _fmt(float(ef[worst_local])), _fmt(float(gf[worst_local])),
                       detail)


def _bit_identical(expected: torch.Tensor, got: torch.Tensor) -> bool:
    """``got`` holds exactly ``expected``'s element bits (same shape and dtype; -0.0 vs 0.0 and NaN payloads
    count as different, so such outputs take the full comparison)."""
    if got.shape != expected.shape or got.dtype != expected.dtype or got.device != expected.device:
        return False
    try:
        return bool(torch.equal(bits(expected), bits(got)))
    except TypeError:  # an element size without an integer view: compare in full
        return False


def _noise_floor(noise: torch.Tensor | None, finite: torch.Tensor, norm: float,
                 count: int) -> tuple[torch.Tensor | float, float]:
    """Per finite element ``noise_i + rms(noise)`` (inf where the noise is not finite), and ‖noise‖/‖e‖."""
    if noise is None or noise.numel() != finite.numel():
        return 0.0, 0.0
    n = _as_real(noise).reshape(-1).double()[finite].abs()
    ok = torch.isfinite(n)
    n_ok = torch.where(ok, n, torch.zeros_like(n))
    rms = float(n_ok.pow(2).mean().sqrt()) if count else 0.0
    floor = torch.where(ok, n_ok + rms, torch.full_like(n, float("inf")))
    return floor.to(torch.float64), (float(n_ok.norm()) / norm if norm > 0 else 0.0)


def _fmt_elem(t: torch.Tensor, idx: tuple[int, ...]) -> str:
    value = t[idx] if idx else t
    if value.dtype == torch.bool:
        return str(bool(value))
    if not value.is_floating_point() and not value.is_complex():
        return str(int(value))
    return _fmt(float(value.float() if not value.is_complex() else value.abs()))


def passes(expected: torch.Tensor, got: torch.Tensor, tol: Tolerance | None) -> bool:
    return expected.shape == got.shape and expected.dtype == got.dtype and check_values(expected, got, tol) is None


#: Outputs with at least this many elements are compared on the host process's GPU when it has one (CUDA
#: initialized: the graph is a GPU graph). The host's CPU needs seconds per comparison of a 1 GiB output (float32
#: temporaries of every element); the GPU needs milliseconds, for a few GiB of transient memory in the user's
#: process while the gate runs (the user's call is blocked meanwhile).
DEVICE_COMPARE_ELEMENTS = 1 << 24


def _on_compare_device(expected: torch.Tensor, got: Any, noise: Any) -> tuple[torch.Tensor, Any, Any]:
    if not (isinstance(got, torch.Tensor) and expected.device.type == "cpu" and got.device.type == "cpu"
            and expected.numel() >= DEVICE_COMPARE_ELEMENTS and torch.cuda.is_available()
            and torch.cuda.is_initialized()):
        return expected, got, noise
    try:
        device = torch.device("cuda", torch.cuda.current_device())
        moved = (expected.to(device), got.to(device),
                 noise.to(device) if isinstance(noise, torch.Tensor) else noise)
        return moved
    except RuntimeError:  # not enough device memory: compare on the CPU
        return expected, got, noise


def compare_output(i: int, expected: Any, got: Any, *, variant: str, tf32: bool, poison_byte: int | None,
                   others: dict[str, Any], where: str, noise: torch.Tensor | None = None) -> CheckFailure | None:
    """Compare output ``i`` (tensors already checked for shape/dtype) and classify a failure.

    ``others`` maps other variants' names to their reference value for this output: a candidate output
    that matches one of them is reported as ``stale_result`` (a result cache or leftover buffer).
    ``noise``: the reference's rounding sensitivity for this output on the high-magnitude variant
    (see :func:`check_values`).
    """
    if not isinstance(expected, torch.Tensor):
        if expected != got:
            return CheckFailure("value_mismatch", f"output {i} ({where}): expected {expected!r}, got {got!r}",
                                output_index=i, variant=variant, expected=repr(expected), got=repr(got))
        return None
    tol = tolerance_for(expected.dtype, tf32)
    elementwise = variant != "high_magnitude"
    expected, got, noise = _on_compare_device(expected, got, noise)
    report = check_values(expected, got, tol, poison_byte, elementwise, noise)
    if report is None:
        return None
    head = (f"output {i} ({str(expected.dtype).removeprefix('torch.')} {list(expected.shape)}, {where}, "
            f"input variant '{variant}')")
    common = dict(output_index=i, variant=variant, worst_index=report.worst_index,
                  expected=report.expected, got=report.got)
    at = f"first at index {list(report.worst_index)}: expected {report.expected}, got {report.got}"
    if report.kind == "uninitialized":
        return CheckFailure("uninitialized_output",
                            f"{head}: {report.count} of {report.total} elements were never written — {report.detail}; "
                            f"{at}. Every element of every output must be written on every call.", **common)
    if report.kind == "nan_inf":
        return CheckFailure("nan_inf_mismatch",
                            f"{head}: {report.detail} at {report.count} elements; {at}. Do not mask or introduce "
                            f"NaN/Inf: they must appear exactly where the original produces them.", **common)
    for name, other in others.items():
        if isinstance(other, torch.Tensor) and isinstance(got, torch.Tensor) and other.device != got.device:
            other = other.to(got.device)
        if isinstance(other, torch.Tensor) and passes(other, got, tol) and not passes(other, expected, tol):
            return CheckFailure("stale_result",
                                f"{head}: the output equals the original's result for the '{name}' inputs of an "
                                f"earlier call, not for these inputs ({at}). Results must not be cached or reused "
                                f"between calls (keyed on pointers, shapes or values) and every call must recompute.",
                                **common)
    if tol is not None and _looks_like_rounding(expected, got):
        for looser in _LOOSER.get(tol.name, ()):
            if (check_values(expected, got, TOLERANCES[looser]) is None if elementwise
                    else _rel_l2(expected, got) <= TOLERANCES[looser].rel_l2):
                return CheckFailure("precision_loss",
                                    f"{head}: {report.count} of {report.total} elements outside the {tol.name} "
                                    f"tolerance but within {looser}'s: the candidate computes in lower precision "
                                    f"than the original ({report.detail}; {at}). Keep the original's accumulation "
                                    f"and output precision.", **common)
    return CheckFailure("value_mismatch",
                        f"{head}: {report.count} of {report.total} elements differ beyond tolerance; worst {at} "
                        f"({report.detail}).", **common)


def _rel_l2(expected: torch.Tensor, got: torch.Tensor) -> float:
    e = _as_real(expected).double().reshape(-1)
    g = _as_real(got).double().reshape(-1)
    finite = torch.isfinite(e) & torch.isfinite(g)
    norm = float(e[finite].norm())
    return float((g[finite] - e[finite]).norm()) / norm if norm > 0 else 0.0


def _looks_like_rounding(expected: torch.Tensor, got: torch.Tensor) -> bool:
    """Rounding noise is uncorrelated with the values; a scaled or shifted result is not (|corr| ≥ 0.5)."""
    e = _as_real(expected).double().reshape(-1)
    g = _as_real(got).double().reshape(-1)
    finite = torch.isfinite(e) & torch.isfinite(g)
    e, err = e[finite], (g - e)[finite]
    if e.numel() < 8 or float(err.std()) == 0.0 or float(e.std()) == 0.0:
        return True
    corr = float(((e - e.mean()) * (err - err.mean())).mean() / (e.std() * err.std()))
    return abs(corr) < 0.5


def significant_strides_differ(shape: list[int], a: list[int], b: list[int]) -> bool:
    """True when strides differ in a dimension of size > 1 (size-0/1 dimensions have no meaningful stride)."""
    return any(size > 1 and x != y for size, x, y in zip(shape, a, b))


def compare_structure(ref: list[dict[str, Any]], cand: list[dict[str, Any]], *, where: str,
                      variant: str | None) -> list[CheckFailure]:
    """Output count, kinds, exact ``torch.Tensor`` type, shapes, dtypes, devices, strides and aliasing."""
    fails: list[CheckFailure] = []
    if cand and cand[0].get("kind") == "not_a_sequence":
        return [CheckFailure("output_type", f"call returned {cand[0].get('type')} ({where}); it must return a "
                                            f"tuple like the original", variant=variant)]
    if len(cand) != len(ref):
        return [CheckFailure("output_count", f"call returned {len(cand)} outputs ({where}); the original returns "
                                             f"{len(ref)}", variant=variant)]
    for i, (r, c) in enumerate(zip(ref, cand)):
        if c["kind"] == "other" or (r["kind"] != c["kind"]):
            shown = c.get("type", c["kind"])
            fails.append(CheckFailure("output_type", f"output {i} is {shown} ({where}); the original returns "
                                                     f"{'a plain torch.Tensor' if r['kind'] == 'tensor' else r['kind']}"
                                                     f" (no subclasses, lazy or proxy objects)",
                                      output_index=i, variant=variant))
            continue
        if r["kind"] == "scalar" and r.get("value") != c.get("value"):
            fails.append(CheckFailure("value_mismatch", f"output {i} is {c.get('value')!r} ({where}); the original "
                                                        f"returns {r.get('value')!r}", output_index=i, variant=variant,
                                      expected=repr(r.get("value")), got=repr(c.get("value"))))
        if r["kind"] != "tensor":
            continue
        for key, check in (("shape", "shape_mismatch"), ("dtype", "dtype_mismatch"), ("device", "device_mismatch")):
            if r[key] != c[key]:
                fails.append(CheckFailure(check, f"output {i} has {key} {c[key]} ({where}); the original's is {r[key]}",
                                          output_index=i, variant=variant, expected=str(r[key]), got=str(c[key])))
        if r["shape"] == c["shape"] and significant_strides_differ(r["shape"], r["stride"], c["stride"]):
            fails.append(CheckFailure("stride_mismatch",
                                      f"output {i} {r['shape']} has strides {c['stride']} ({where}); the original's "
                                      f"are {r['stride']} (callers and the backward graph rely on them)",
                                      output_index=i, variant=variant, expected=str(r["stride"]), got=str(c["stride"])))
        fails.extend(_alias_failures(i, r, c, where, variant))
    return fails


def _alias_failures(i: int, r: dict[str, Any], c: dict[str, Any], where: str,
                    variant: str | None) -> list[CheckFailure]:
    ri, ci = r.get("input_identity"), c.get("input_identity")
    rs, cs = r.get("input_storage"), c.get("input_storage")
    msg = None
    if ri is not None and ci != ri:
        msg = (f"output {i} must be input {ri} itself (the original returns that input tensor object, e.g. a saved "
               f"activation); the candidate returns {'input ' + str(ci) if ci is not None else 'another tensor'}")
    elif ri is None and rs is None and (ci is not None or cs is not None):
        j = ci if ci is not None else cs
        msg = (f"output {i} {'is' if ci is not None else 'shares storage with'} input {j}; the original returns a "
               f"new tensor there (writing to one would change the other)")
    elif rs is not None and cs != rs:
        msg = f"output {i} must be a view of input {rs} like the original's; the candidate's is not"
    elif sorted(r.get("shares_outputs", [])) != sorted(c.get("shares_outputs", [])):
        msg = (f"output {i} shares storage with outputs {c.get('shares_outputs', [])}; in the original it shares "
               f"with {r.get('shares_outputs', [])}")
    if msg is None:
        return []
    return [CheckFailure("alias_mismatch", f"{msg} ({where}).", output_index=i, variant=variant)]
