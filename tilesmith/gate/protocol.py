"""Shared pieces of the host ↔ worker protocol: message framing, tensor layout helpers, bit views.

Both sides import this module; it imports only the standard library and ``torch``.

Framing: one JSON object per line (UTF-8) in each direction. The host writes requests on the worker's
stdin; the worker answers on a private duplicate of its original stdout (fd 1 itself is redirected to
the worker's log so that ``print`` in candidate code cannot corrupt the protocol). Every request has an
integer ``id`` that its answer repeats. Tensors never travel in JSON: the host writes input lists with
``torch.save`` and the worker writes output lists with ``torch.save``; both sides read them with
``torch.load(weights_only=True)``. Layout (shape, stride, offset), aliasing and every other fact about
tensors travels in JSON.
"""

from __future__ import annotations

import json
from typing import Any

import torch

PROTOCOL_VERSION = 1

#: Longest JSON line the host accepts from a worker (bytes). Outputs travel in files, so an answer is
#: small; a longer line means a broken or hostile worker.
MAX_MESSAGE_BYTES = 32 * 1024 * 1024

#: Byte written into the unused part of input storages and into guard tails of allocations, so that
#: writes outside a tensor's logical elements are visible afterwards.
CANARY_BYTE = 0xA5

#: Bytes the worker fills fresh allocations with before the candidate runs (cycled per step). 0xFF is a
#: NaN in every IEEE float format and -1 in integers; 0x7F.. is NaN in float16 and a huge finite value
#: in float32/bfloat16 (3.4e38), so an unwritten element differs from any plausible reference value.
POISON_BYTES = (0xFF, 0x7F)


def dumps(message: dict[str, Any]) -> bytes:
    """Encode one protocol message as a JSON line (non-finite floats are written as strings)."""
    return (json.dumps(_jsonable(message), separators=(",", ":"), allow_nan=False) + "\n").encode()


def loads(line: bytes) -> dict[str, Any]:
    """Decode one protocol line; raises ``ValueError`` when it is not a JSON object."""
    value = json.loads(line.decode("utf-8"))
    if not isinstance(value, dict):
        raise ValueError("protocol message is not a JSON object")
    return value


def _jsonable(value: Any) -> Any:
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value in (float("inf"), float("-inf")):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def storage_extent(t: torch.Tensor) -> int:
    """Elements from the first to one past the last element a strided view can reach (0 if empty)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))


def overlaps(t: torch.Tensor) -> bool:
    """True when two logical elements of ``t`` share memory (a stride-0 broadcast, an overlapping view).
    torch's ``_debug_has_internal_overlap`` answers 0 (no), 1 (yes) or 2 (too costly to tell): only a
    definite no counts as not overlapping; a torch without the function is taken at its word (no)."""
    check = getattr(torch._C, "_debug_has_internal_overlap", None)
    return check is not None and int(check(t)) != 0


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


def parse_dtype(name: str) -> torch.dtype:
    """``"torch.float32"`` → ``torch.float32``; raises ``ValueError`` for anything else."""
    attr = name.removeprefix("torch.")
    value = getattr(torch, attr, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return value
