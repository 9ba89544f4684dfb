"""Input variants the gate checks and times on, built in the host from the first real call's inputs.

Every variant keeps each input's exact size, stride and storage offset (values are written through
the storage, so overlapping layouts such as stride-0 broadcasts stay consistent). Only floating-point
inputs change value; integer and boolean inputs (indices, masks, lengths) keep values that were valid
in the captured call:

=================  ============================================  ==========================================
variant            floating inputs                               integer / boolean inputs
=================  ============================================  ==========================================
``normal``         the captured values                           the captured values
``random``         fresh N(mean, std) of the captured finite     a random permutation of the captured
                   values (std 0 → 0.1·|mean|, or 1 when the     values (kept as captured when the layout
                   mean is 0 too); captured NaN/±Inf kept        overlaps itself or has < 2 elements)
``zero``           0 (captured NaN/±Inf kept)                    permuted as for ``random``
``high_magnitude`` ``random`` values × ``scale`` (see             permuted as for ``random``
                   :func:`scale_ladder`)
=================  ============================================  ==========================================

Generation is deterministic in its seed (``torch.Generator`` on the CPU), so a report can name the
seed that exposed a failure.
"""

from __future__ import annotations

from typing import Any

import torch

from tilesmith.gate.protocol import storage_extent

VARIANTS = ("normal", "random", "zero", "high_magnitude")


def clone_layout(value: torch.Tensor) -> torch.Tensor:
    """CPU copy of ``value`` with identical size, stride and storage offset (and a minimal storage)."""
    offset, extent = value.storage_offset(), storage_extent(value)
    base = torch.zeros(offset + extent, dtype=value.dtype)
    if extent:
        base[offset:] = torch.as_strided(value.detach().cpu(), (extent,), (1,), offset)
    return torch.as_strided(base, value.shape, value.stride(), offset)


def _storage_tail(t: torch.Tensor) -> torch.Tensor:
    """The 1-D storage region (from the offset) a strided view reads, as a writable view."""
    return torch.as_strided(t, (storage_extent(t),), (1,), t.storage_offset())


def _overlaps(t: torch.Tensor) -> bool:
    check = getattr(torch._C, "_debug_has_internal_overlap", None)
    return check is not None and int(check(t)) != 0


def _float_moments(t: torch.Tensor) -> tuple[float, float]:
    values = t.detach().reshape(-1).double()
    values = values[torch.isfinite(values)]
    if values.numel() == 0:
        return 0.0, 1.0
    mean = float(values.mean())
    std = float(values.std()) if values.numel() > 1 else 0.0
    if std == 0.0:
        std = 0.1 * abs(mean) if mean != 0.0 else 1.0
    return mean, std


def _fresh_float(t: torch.Tensor, gen: torch.Generator, mode: str, scale: float) -> torch.Tensor:
    out = clone_layout(t)
    tail = _storage_tail(out)
    if tail.numel() == 0:
        return out
    src = tail.double()
    keep = ~torch.isfinite(src)
    if mode == "zero":
        fresh = torch.zeros(tail.numel(), dtype=torch.float64)
    else:
        mean, std = _float_moments(t)
        fresh = torch.randn(tail.numel(), generator=gen, dtype=torch.float64) * std + mean
        fresh = fresh * scale
    info = torch.finfo(t.dtype)
    fresh = fresh.clamp(-float(info.max), float(info.max))
    fresh = torch.where(keep, src, fresh)
    tail.copy_(fresh.to(t.dtype))
    return out


def _permuted(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    out = clone_layout(t)
    if t.numel() < 2 or _overlaps(t):
        return out
    flat = t.detach().cpu().reshape(-1)
    perm = torch.randperm(flat.numel(), generator=gen)
    out.copy_(flat[perm].reshape(t.shape))
    return out


def make_variant(base: list[Any], variant: str, seed: int, scale: float = 1.0) -> list[Any]:
    """One input list for ``variant`` (see the module table). Scalars are passed through unchanged.

    Raises:
        ValueError: ``variant`` is not one of :data:`VARIANTS`.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown input variant {variant!r}; expected one of {VARIANTS}")
    gen = torch.Generator().manual_seed(int(seed))
    out: list[Any] = []
    for value in base:
        if not isinstance(value, torch.Tensor):
            out.append(value)
        elif variant == "normal":
            out.append(clone_layout(value))
        elif value.is_floating_point():
            mode = "zero" if variant == "zero" else "random"
            out.append(_fresh_float(value, gen, mode, scale if variant == "high_magnitude" else 1.0))
        elif value.is_complex():
            real = _fresh_float(torch.view_as_real(value.detach().cpu().contiguous()), gen,
                                "zero" if variant == "zero" else "random",
                                scale if variant == "high_magnitude" else 1.0)
            out.append(_with_layout(torch.view_as_complex(real), value))
        else:
            out.append(_permuted(value, gen))
    return out


def _with_layout(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    out = clone_layout(like)
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
            finite = value.detach().reshape(-1).double()
            finite = finite[torch.isfinite(finite)]
            if finite.numel():
                biggest = max(biggest, float(finite.abs().max()))
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
