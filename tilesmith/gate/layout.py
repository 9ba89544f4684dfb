"""Tensor layout helpers both sides of the gate use: storage extents, overlap, bit views, strided copies.

One home for the strided copy (:func:`clone_layout`: same size, stride and storage offset, on any device)
and for the description of outputs a worker and the host compare (:func:`output_facts`). Imports only
``torch``.
"""

from __future__ import annotations

from typing import Any

import torch


def plain_sequence(value: Any) -> list[Any] | None:
    """``value``'s items when it is exactly a ``tuple`` or ``list`` (what a wrapper's ``call`` returns), else ``None``.

    Exact types, never ``isinstance``: iterating or measuring a subclass runs its code, so a candidate returning a
    ``tuple`` subclass could compute its outputs when the gate reads them, after the clock stopped (red team 18:
    accepted at 6.98× in CPU test mode before this). ``type()`` itself runs nothing of the object's."""
    return list(value) if type(value) in (tuple, list) else None


def storage_extent(t: torch.Tensor) -> int:
    """Elements from the first to one past the last element a strided view can reach (0 if empty)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))


def overlaps(t: torch.Tensor) -> bool:
    """True when two logical elements of ``t`` share memory (a stride-0 broadcast, an overlapping view).
    torch's ``_debug_has_internal_overlap`` (``torch.`` in 2.11, ``torch._C.`` in older versions) answers 0
    (no), 1 (yes) or 2 (too costly to tell): only a definite no counts as not overlapping. Without the function,
    a zero stride on a dimension of size > 1 counts as overlapping."""
    check = getattr(torch, "_debug_has_internal_overlap", None) or getattr(torch._C, "_debug_has_internal_overlap",
                                                                            None)
    if check is None:
        return any(st == 0 and sz > 1 for sz, st in zip(t.shape, t.stride()))
    return int(check(t)) != 0


def layout_of(t: torch.Tensor) -> dict[str, Any]:
    """JSON description of a tensor's metadata (no values)."""
    return {
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "storage_offset": int(t.storage_offset()),
        "dtype": str(t.dtype),
        "device": str(t.device),
    }


_INT_FOR_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Contiguous integer view of ``t``'s element bits, for exact (NaN-aware) comparisons.

    Complex tensors are viewed as pairs of reals first. Raises ``TypeError`` for element sizes without
    an integer type of the same width.
    """
    if t.is_complex():
        t = torch.view_as_real(t)
    t = t.contiguous()
    size = t.element_size()
    if size not in _INT_FOR_SIZE:
        raise TypeError(f"no integer view for element size {size}")
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view(_INT_FOR_SIZE[size])


def poison_pattern(dtype: torch.dtype, byte: int) -> int:
    """Integer value of one element of ``dtype`` whose bytes all equal ``byte`` (as read by :func:`bits`)."""
    size = torch.empty((), dtype=dtype).element_size()
    if dtype.is_complex:
        size //= 2
    raw = int.from_bytes(bytes([byte]) * size, "little", signed=size > 1)
    return raw


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """1-D ``uint8`` view (not a copy) of the storage bytes a strided tensor can reach, from its offset."""
    flat = torch.as_strided(t, (storage_extent(t),), (1,), t.storage_offset())
    return flat.view(torch.uint8)


def write_values(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy ``value`` into ``target`` (same layout), also when the layout overlaps itself (stride 0)."""
    if not overlaps(value):
        target.copy_(value.to(target.device))
    else:
        flat_view(target).copy_(flat_view(value).to(target.device))


def clone_layout(value: Any, device: torch.device | str | None = None) -> Any:
    """Copy of tensor ``value`` on ``device`` (default: its own) with identical size, stride and storage offset
    and a storage just large enough (bytes outside the reachable elements are zero); other values as they are.
    Overlapping layouts (stride 0) are copied through their storage bytes, so they stay consistent."""
    if not isinstance(value, torch.Tensor):
        return value
    device = value.device if device is None else torch.device(device)
    base = torch.zeros(value.storage_offset() + storage_extent(value), dtype=value.dtype, device=device)
    out = torch.as_strided(base, value.shape, value.stride(), value.storage_offset())
    write_values(out, value.detach())
    return out


def output_facts(outputs: Any, inputs: list[Any]) -> list[dict[str, Any]]:
    """Type, layout and aliasing of each output. Never calls a method on a non-``torch.Tensor`` object (a
    ``tuple``/``list`` subclass is ``not_a_sequence``: :func:`plain_sequence`)."""
    items = plain_sequence(outputs)
    if items is None:
        return [{"kind": "not_a_sequence", "type": _type_name(outputs)}]
    facts: list[dict[str, Any]] = []
    storages: list[int | None] = []
    for out in items:
        kind = type(out)
        if out is None:
            facts.append({"kind": "none"})
            storages.append(None)
        elif kind in (int, float, bool):
            facts.append({"kind": "scalar", "value": out})
            storages.append(None)
        elif kind is torch.Tensor:
            fact = {"kind": "tensor", **layout_of(out), "storage_nbytes": int(out.untyped_storage().nbytes())}
            fact["input_identity"] = next((j for j, a in enumerate(inputs) if a is out), None)
            ptr = out.untyped_storage().data_ptr()
            fact["input_storage"] = next(
                (j for j, a in enumerate(inputs)
                 if isinstance(a, torch.Tensor) and a.numel() and out.numel()
                 and a.untyped_storage().data_ptr() == ptr), None)
            facts.append(fact)
            storages.append(ptr if out.numel() else None)
        else:
            facts.append({"kind": "other", "type": _type_name(out)})
            storages.append(None)
    for i, fact in enumerate(facts):
        if storages[i] is not None:
            fact["shares_outputs"] = [j for j, p in enumerate(storages) if j != i and p == storages[i]]
    return facts


def _type_name(value: Any) -> str:
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}"
