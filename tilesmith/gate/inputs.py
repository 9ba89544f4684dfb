"""Input variants the gate checks and times on, built in the host from the first real call's inputs.

Every variant keeps each input's exact size, stride and storage offset (values are written through
the storage, so overlapping layouts such as stride-0 broadcasts stay consistent). Floating inputs get
fresh values; integer and boolean inputs (indices, masks, positions, lengths) get other values from the
domain the captured call shows to be valid (``vary=True``, the default):

=================  ============================================  ==========================================
variant            floating inputs                               integer / boolean inputs
=================  ============================================  ==========================================
``normal``         the captured values                           the captured values
``random``         fresh N(mean, std) of the captured finite     booleans: a random quarter of the elements
                   values (std 0 → 0.1·|mean|, or 1 when the     flipped (one element: flipped with p ½);
                   mean is 0 too); captured NaN/±Inf moved to    integers: uniform in the captured range
                   random positions of their row (same count     widened towards 0 (see :func:`int_domain`);
                   per row of the last dimension)                no duplicates unless the captured values
                                                                 had some or ``duplicates=True``
``zero``           0 (captured NaN/±Inf kept in place)           as for ``random``
``high_magnitude`` ``random`` values × ``scale`` (see             as for ``random`` (same draws)
                   :func:`scale_ladder`)
=================  ============================================  ==========================================

``vary=False`` gives the conservative variants the gate falls back to when the original wrapper rejects
the varied ones (an integer the graph cannot take): integer and boolean inputs are then a random
permutation of the captured values (kept as captured when the layout overlaps itself or has < 2
elements) and NaN/±Inf stay where they were captured.

Generation is deterministic in its seed (``torch.Generator`` on the CPU), so a report can name the
seed that exposed a failure.
"""

from __future__ import annotations

import re
import weakref
from typing import Any

import torch

from tilesmith.gate.layout import clone_layout as _clone_to, flat_view, overlaps as _overlaps, storage_extent, write_values

VARIANTS = ("normal", "random", "zero", "high_magnitude")


def clone_layout(value: torch.Tensor) -> torch.Tensor:
    """CPU copy of ``value`` with identical size, stride and storage offset (:func:`tilesmith.gate.layout.clone_layout`)."""
    return _clone_to(value, "cpu")


def _same(value: torch.Tensor) -> torch.Tensor:
    """Copy of ``value`` on its own device, same layout (every variant is made where its base lives)."""
    return _clone_to(value)


def _work_dtype(t: torch.Tensor) -> torch.dtype:
    """float64 for float64/complex128 inputs, else float32: generating in float32 keeps a variant of a 1 GiB
    fp32 input at 1 GiB of temporaries instead of 2 (the values only need the input dtype's precision)."""
    return torch.float64 if t.dtype in (torch.float64, torch.complex128) else torch.float32


def _storage_tail(t: torch.Tensor) -> torch.Tensor:
    """The 1-D storage region (from the offset) a strided view reads, as a writable view."""
    return torch.as_strided(t, (storage_extent(t),), (1,), t.storage_offset())


_MOMENTS: dict[int, tuple[Any, int, tuple[float, float]]] = {}
"""``id(tensor) → (weak reference, version, (mean, std))``: a worker builds every variant from the same base
tensors, so their moments (a float64 pass over each, the largest single cost of building a variant on the CPU:
py-spy, 2026-12-06) are computed once per base tensor and in-place version."""


def _float_moments(t: torch.Tensor) -> tuple[float, float]:
    """Mean and standard deviation of the finite values of ``t`` (memoized per tensor object and version)."""
    hit = _MOMENTS.get(id(t))
    if hit is not None and hit[0]() is t and hit[1] == t._version:
        return hit[2]
    moments = _compute_moments(t)
    try:
        ref = weakref.ref(t)
    except TypeError:
        return moments
    if len(_MOMENTS) >= 256:
        _MOMENTS.clear()
    _MOMENTS[id(t)] = (ref, t._version, moments)
    return moments


def _compute_moments(t: torch.Tensor) -> tuple[float, float]:
    values = t.detach().reshape(-1).to(torch.float64 if t.numel() <= 1 << 24 else torch.float32)
    values = values[torch.isfinite(values)]
    if values.numel() == 0:
        return 0.0, 1.0
    mean = float(values.mean())
    std = float(values.std()) if values.numel() > 1 else 0.0
    if std == 0.0:
        std = 0.1 * abs(mean) if mean != 0.0 else 1.0
    return mean, std


def _fresh_float(t: torch.Tensor, gen: torch.Generator, mode: str, scale: float, move: bool = False) -> torch.Tensor:
    out = _same(t)
    tail = _storage_tail(out)
    if tail.numel() == 0:
        return out
    work = _work_dtype(t)
    keep = ~torch.isfinite(tail)
    if mode == "zero":
        fresh = torch.zeros(tail.numel(), dtype=work, device=t.device)
    else:
        mean, std = _float_moments(t)
        fresh = torch.randn(tail.numel(), generator=gen, dtype=work, device=t.device).mul_(std).add_(mean)
        fresh.mul_(scale)
    info = torch.finfo(t.dtype)
    fresh.clamp_(-float(info.max), float(info.max))
    fresh = torch.where(keep, tail.to(work), fresh)
    tail.copy_(fresh.to(t.dtype))
    del fresh
    if move and bool(keep.any()):
        _shuffle_rows(out, gen)
    return out


def _shuffle_rows(out: torch.Tensor, gen: torch.Generator) -> None:
    """Move NaN/±Inf to random positions of their row (last dimension of size > 1; the whole tensor when
    there is none): an additive ``-inf`` padding mask gets another padding pattern with the same number of
    masked elements per row, so no row becomes fully masked that was not."""
    if out.numel() < 2 or _overlaps(out):
        return
    dims = [d for d in range(out.dim()) if out.shape[d] > 1]
    last = dims[-1]
    values = out.detach().movedim(last, -1).contiguous()
    rows = values.reshape(-1, values.shape[-1])
    order = torch.rand(rows.shape, generator=gen, device=out.device).argsort(dim=1)
    shuffled = rows.gather(1, order).reshape(values.shape).movedim(-1, last)
    out.copy_(shuffled)


def _permuted(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    out = _same(t)
    if t.numel() < 2 or _overlaps(t):
        return out
    flat = t.detach().reshape(-1)
    perm = torch.randperm(flat.numel(), generator=gen, device=t.device)
    out.copy_(flat[perm].reshape(t.shape))
    return out


#: Fraction of a boolean input's elements the varied variants flip (one-element booleans: ½).
BOOL_FLIP_FRACTION = 0.25
#: Integer domains up to this many values are sampled without replacement through ``randperm``.
_EXACT_SAMPLE_LIMIT = 1 << 22
_ACCUMULATE = re.compile(r"atomic_add|index_add|scatter_add|scatter_reduce|index_put_?\([^\n]*\bTrue\b")


def accumulates(source: str) -> bool:
    """True when a wrapper scatters with accumulation (Inductor's ``atomic_add`` in C++/Triton kernels, or
    an ``index_add``/``scatter_add``/``scatter_reduce``/``index_put_(..., True)`` fallback): duplicate
    indices are then well defined, so the varied variants may repeat index values that were unique in the
    captured call. Without accumulation a repeated scatter index has no defined result (PyTorch documents
    ``index_put_``/``index_copy_`` with duplicates as undefined), so no duplicates are introduced."""
    return bool(_ACCUMULATE.search(source or ""))


def int_domain(t: torch.Tensor) -> tuple[int, int, bool]:
    """``(low, high, zero_allowed)``: the values the varied variants draw an integer input from.

    The captured range widened towards zero, on the side the captured values are on: all positive → [1,
    max]; all negative → [min, −1]; otherwise [min, max]. Rationale: an index, position or length that was
    valid in the captured call stays valid when smaller in magnitude (``table[5]`` valid ⇒ ``table[3]``
    valid; negative indices wrap), which is what a one-element position tensor needs to be varied at all.
    0 is drawn only when the captured values contain 0 (an integer divisor must not become 0).
    """
    flat = t.detach().reshape(-1).long()
    lo, hi = int(flat.min()), int(flat.max())
    zero = bool((flat == 0).any())
    if lo > 0:
        return 1, hi, zero
    if hi < 0:
        return lo, -1, zero
    return lo, hi, zero


def _varied_int(t: torch.Tensor, gen: torch.Generator, duplicates: bool) -> torch.Tensor:
    out = _same(t)
    n = t.numel()
    if n == 0 or _overlaps(t):
        return out
    dev = t.device
    flat = t.detach().reshape(-1)
    lo, hi, zero = int_domain(t)
    hi = min(hi, (1 << 62))
    lo = max(lo, -(1 << 62))
    unique = n == 1 or int(flat.unique().numel()) == n
    fresh: torch.Tensor | None = None
    if n == 1:
        pool = torch.arange(lo, hi + 1, device=dev) if hi - lo < _EXACT_SAMPLE_LIMIT else None
        if pool is not None:
            pool = pool[(pool != int(flat[0])) & ((pool != 0) | zero)]
            if pool.numel():
                fresh = pool[torch.randint(0, pool.numel(), (1,), generator=gen, device=dev)]
    elif unique and not duplicates:
        if hi - lo < _EXACT_SAMPLE_LIMIT:
            pool = torch.arange(lo, hi + 1, device=dev)
            pool = pool[(pool != 0) | zero]
            if pool.numel() >= n:
                fresh = pool[torch.randperm(pool.numel(), generator=gen, device=dev)[:n]]
        else:
            draws = torch.randint(lo, hi + 1, (2 * n,), generator=gen, device=dev)
            draws = draws[(draws != 0) | zero].unique()
            if draws.numel() >= n:
                fresh = draws[torch.randperm(draws.numel(), generator=gen, device=dev)[:n]]
    else:
        fresh = torch.randint(lo, hi + 1, (n,), generator=gen, device=dev)
        if not zero:
            fresh = torch.where(fresh == 0, torch.full_like(fresh, hi if hi != 0 else lo), fresh)
    if fresh is None:  # no room for other values: the conservative permutation
        return _permuted(t, gen)
    out.copy_(fresh.to(t.dtype).reshape(t.shape))
    return out


def _varied_bool(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    out = _same(t)
    if t.numel() == 0 or _overlaps(t):
        return out
    p = 0.5 if t.numel() == 1 else BOOL_FLIP_FRACTION
    flip = torch.rand(t.shape, generator=gen, device=t.device) < p
    out.copy_(torch.where(flip, ~t.detach(), t.detach()))
    return out


def make_variant(base: list[Any], variant: str, seed: int, scale: float = 1.0, *, vary: bool = True,
                 duplicates: bool = False) -> list[Any]:
    """One input list for ``variant`` (see the module table). Scalars are passed through unchanged.

    Every tensor is made on ``base``'s device from a generator on that device seeded with ``seed`` (one per
    device), so two processes given the same base, recipe and device type make the same values, and nothing is
    staged through host memory on a GPU.

    ``vary=False``: integer/boolean inputs only permuted and NaN/±Inf kept in place (the fallback when the
    original rejects the varied values). ``duplicates=True``: index-like integer inputs may repeat values
    although the captured ones were unique (set when :func:`accumulates` holds for the original wrapper).

    Raises:
        ValueError: ``variant`` is not one of :data:`VARIANTS`.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown input variant {variant!r}; expected one of {VARIANTS}")
    gens: dict[str, torch.Generator] = {}
    out: list[Any] = []
    mode = "zero" if variant == "zero" else "random"
    factor = scale if variant == "high_magnitude" else 1.0
    move = vary and variant != "zero"
    for value in base:
        if not isinstance(value, torch.Tensor):
            out.append(value)
            continue
        gen = _generator(gens, value.device, seed)
        if variant == "normal":
            out.append(_same(value))
        elif value.is_floating_point():
            out.append(_fresh_float(value, gen, mode, factor, move))
        elif value.is_complex():
            real = _fresh_float(torch.view_as_real(value.detach().contiguous()), gen, mode, factor)
            out.append(_with_layout(torch.view_as_complex(real), value))
        elif not vary:
            out.append(_permuted(value, gen))
        elif value.dtype == torch.bool:
            out.append(_varied_bool(value, gen))
        else:
            out.append(_varied_int(value, gen, duplicates))
    return out


def _generator(gens: dict[str, torch.Generator], device: torch.device, seed: int) -> torch.Generator:
    key = str(device)
    if key not in gens:
        gens[key] = torch.Generator(device=device).manual_seed(int(seed))
    return gens[key]


def _with_layout(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    out = _same(like)
    out.copy_(values)
    return out


def scale_ladder(base: list[Any], cap: float | None = None) -> list[float]:
    """Scales to try for ``high_magnitude``, largest first (the gate takes the first that does not overflow).

    The largest is ``min(finfo.max ** 0.25, 1024)`` over the floating input dtypes divided by the
    largest captured finite magnitude (at least 1), so that products of up to four scaled values stay
    finite; each next rung is 8× smaller; rungs below 4 are dropped (no meaningful "high" left).
    """
    top = float(cap) if cap is not None else 1024.0
    biggest = 1.0
    for value in base:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel():
            top = min(top, float(torch.finfo(value.dtype).max) ** 0.25)
            flat = value.detach().reshape(-1)
            magnitude = torch.where(torch.isfinite(flat), flat.abs(), torch.zeros((), dtype=flat.dtype,
                                                                                   device=flat.device))
            biggest = max(biggest, float(magnitude.max()))
    rungs = []
    scale = top / biggest
    while scale >= 4.0 and len(rungs) < 4:
        rungs.append(float(2 ** round(torch.log2(torch.tensor(scale)).item())))
        scale /= 8.0
    return rungs


def timing_factors(base: list[Any], rounds: int, gen: torch.Generator) -> list[list[float]]:
    """Per round, one factor per input from {-2, -1, 1, 2} for floating tensors (1 otherwise).

    Sign flips and powers of two are exact in every floating format, so the host reproduces the
    worker's refreshed inputs bit for bit when it spot-checks a sample.
    """
    choices = torch.tensor([-2.0, -1.0, 1.0, 2.0])
    floating = [isinstance(v, torch.Tensor) and v.is_floating_point() for v in base]
    table = []
    for _ in range(rounds):
        picks = choices[torch.randint(0, 4, (len(base),), generator=gen)].tolist()
        table.append([p if f else 1.0 for p, f in zip(picks, floating)])
    return table


def apply_factors(values: list[Any], factors: list[float]) -> list[Any]:
    """The input list a timing round sees: ``values`` with floating tensors multiplied by their factor."""
    out = []
    for value, factor in zip(values, factors):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and factor != 1.0:
            scaled = clone_layout(value)
            tail = _storage_tail(scaled)
            tail.copy_((tail.float() * factor).to(value.dtype) if value.element_size() == 1 else tail * factor)
            out.append(scaled)
        else:
            out.append(value)
    return out


#: Relative size of the rounding-level perturbation :func:`perturbed` applies (in units of the input
#: dtype's machine epsilon; 16- and 8-bit floats: one unit on a random sixteenth of the elements).
PERTURB_ULPS = 4


def perturbed(values: list[Any], seed: int) -> list[Any]:
    """``values`` with every floating tensor multiplied elementwise by ``1 ± PERTURB_ULPS·eps`` (random
    sign; float16/bfloat16/float8: ``1 ± eps`` on a random 1/16 of the elements, since smaller changes
    round away). The reference's response to this is its own rounding sensitivity at these inputs, the noise
    floor :func:`tilesmith.gate.host.compare.check_values` allows on the high-magnitude variant."""
    gens: dict[str, torch.Generator] = {}
    out: list[Any] = []
    for value in values:
        if not (isinstance(value, torch.Tensor) and value.is_floating_point()) or value.numel() == 0:
            out.append(value)
            continue
        gen = _generator(gens, value.device, seed)
        copy = _same(value)
        tail = _storage_tail(copy)
        eps = float(torch.finfo(value.dtype).eps)
        work = _work_dtype(value)  # 1 ± 4·eps of the input dtype is exact in float32 for every narrower float
        sign = torch.randint(0, 2, (tail.numel(),), generator=gen, dtype=work, device=value.device) * 2 - 1
        if value.element_size() >= 4:
            factor = 1 + PERTURB_ULPS * eps * sign
        else:
            hit = torch.randint(0, 16, (tail.numel(),), generator=gen, device=value.device) == 0
            factor = torch.where(hit, 1 + eps * sign, torch.ones_like(sign))
        tail.copy_((tail.to(work) * factor).to(value.dtype))
        out.append(copy)
    return out


# -- timing input sets (both sides: the worker fills them, the host rebuilds a spot-checked call's) --------
_FLOAT_KINDS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _scale(t: torch.Tensor, factor: float) -> None:
    if factor == 1.0 or not t.is_floating_point():
        return
    flat = torch.as_strided(t, (flat_view(t).numel() // t.element_size(),), (1,), t.storage_offset())
    if t.dtype in _FLOAT_KINDS:
        flat.mul_(factor)
    else:  # float8 and other formats without in-place arithmetic: round-trip through float32
        flat.copy_(flat.float().mul_(factor).to(t.dtype))


def _finite(flat: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(flat if flat.dtype in _FLOAT_KINDS else flat.float())


def roll_finite_(t: torch.Tensor, shift: int) -> None:
    """Rotate the finite values of floating tensor ``t`` by ``shift`` positions among themselves, in place.

    Works on the logical elements in row-major order (never on stride gaps, whose bytes the worker and the
    host do not share) and moves raw bits through an integer view, so the result is bit-identical on every
    device and dtype (float8 included); NaN and ±Inf stay where they are (masks keep their structure) and
    the multiset of values is unchanged (positive inputs stay positive). Integer, boolean and complex
    tensors, and layouts that overlap themselves (stride 0), are left alone.
    """
    if not t.is_floating_point() or t.numel() < 2 or _overlaps(t):
        return
    flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
    fin = _finite(flat)
    bits = flat.view(_INT_VIEW[t.element_size()])
    if bool(fin.all()):
        rolled = torch.roll(bits, int(shift))
    else:
        idx = fin.nonzero().squeeze(1)
        if idx.numel() < 2:
            return
        rolled = bits.clone()
        rolled[idx] = torch.roll(bits[idx], int(shift))
    if t.is_contiguous():
        bits.copy_(rolled)
    else:
        t.copy_(rolled.view(t.dtype).view(t.shape))


def distinct_capacity(values: list[Any], static: Any = ()) -> int:
    """How many pairwise different input sets :func:`roll_finite_` with shifts ``0 … n-1`` can make.

    The largest number of finite logical elements of a (non-overlapping) floating input that holds at
    least two different finite values (a shift that is not a multiple of that count moves some value to
    a new position, unless the values repeat with a shorter period); 1 when no floating input varies (only
    integer/boolean inputs, or constant floats): then every call of a sample would read the same values,
    and ``k`` is capped to 1. Inputs in ``static`` (shared by the calls of a sample) do not count: a graph
    whose only varying floating inputs are static gets ``k = 1``.
    """
    best = 1
    skip = {int(i) for i in static}
    for i, value in enumerate(values):
        if i in skip:
            continue
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() >= 2 \
                and not _overlaps(value):
            flat = value.reshape(-1)
            finite = flat[_finite(flat)]
            if finite.numel() >= 2 and bool((finite != finite[0]).any()):
                best = max(best, int(finite.numel()))
    return best


def fill_set(targets: list[Any], source: list[Any], factors: list[float], shift: int, skip: Any = (),
             static: Any = (), static_shift: int | None = None) -> None:
    """Write one timing input set in place: ``source`` × per-input ``factors``, finite values rolled by ``shift``.

    Inputs in ``skip`` are left alone (static inputs shared with a set already written); inputs in ``static``
    are rolled by ``static_shift`` instead of ``shift`` (call ``c`` of a sample with base shift ``s`` reads its
    set rolled by ``s + c`` and the static inputs, one buffer for the sample's calls, rolled by ``s``). Every
    step is exact (sign, power of two, moving raw bits), so the trusted worker rebuilds the inputs of any timed
    call bit for bit (:func:`call_values`).
    """
    skipped = {int(i) for i in skip}
    fixed = {int(i) for i in static}
    for i, value in enumerate(source):
        if isinstance(value, torch.Tensor) and i not in skipped:
            write_values(targets[i], value)
            _scale(targets[i], float(factors[i]) if i < len(factors) else 1.0)
            by = int(static_shift) if i in fixed and static_shift is not None else int(shift)
            if by:
                roll_finite_(targets[i], by)


def call_values(source: list[Any], factors: list[float], shift: int, call: int, static: Any = ()) -> list[Any]:
    """The inputs timed call ``call`` of a sample read: ``source`` × ``factors`` rolled by ``shift + call``, its
    ``static`` inputs rolled by ``shift`` (fresh copies; what :func:`fill_set` wrote into that call's set)."""
    out = [_same(v) if isinstance(v, torch.Tensor) else v for v in source]
    fill_set(out, source, factors, int(shift) + int(call), static=static, static_shift=int(shift))
    return out


RECIPE_KEYS = ("variant", "seed", "scale", "vary", "duplicates", "perturb")


def recipe(variant: str, seed: int, scale: float = 1.0, *, vary: bool = True, duplicates: bool = False,
           perturb: int | None = None) -> dict[str, Any]:
    """A JSON description of one input list: :func:`make_variant` arguments, then :func:`perturbed` with seed
    ``perturb`` when given. Host and workers exchange recipes, never input values; :func:`build` makes them."""
    return {"variant": variant, "seed": int(seed), "scale": float(scale), "vary": bool(vary),
            "duplicates": bool(duplicates), "perturb": None if perturb is None else int(perturb)}


def build(base: list[Any], spec: dict[str, Any]) -> list[Any]:
    """The input list ``spec`` (a :func:`recipe`) describes, made from ``base`` on its device.

    Raises:
        ValueError: an unknown variant or a malformed recipe.
    """
    try:
        values = make_variant(base, str(spec["variant"]), int(spec["seed"]), float(spec.get("scale", 1.0)),
                              vary=bool(spec.get("vary", True)), duplicates=bool(spec.get("duplicates", False)))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed input recipe {spec!r}: {exc}") from None
    if spec.get("perturb") is not None:
        values = perturbed(values, int(spec["perturb"]))
    return values


def recipe_key(spec: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(spec.get(k) for k in RECIPE_KEYS)


def static_indices(requested: Any, values: list[Any]) -> tuple[int, ...]:
    """The host's ``static`` list, validated: sorted distinct indices of tensor inputs of ``values``."""
    found = set()
    for i in requested or ():
        idx = int(i)
        if 0 <= idx < len(values) and isinstance(values[idx], torch.Tensor):
            found.add(idx)
    return tuple(sorted(found))
