"""Shared pieces of the host ↔ worker protocol: message framing and the constants both sides use.

Both sides import this module (the worker before torch: its audit hook reads :data:`AUDIT_CHECKS`); it
imports only the standard library. Tensor layout helpers are in :mod:`tilesmith.gate.layout`.

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

#: Check ids of the worker's audit hook (:mod:`tilesmith.gate.worker.audit`; the host turns its records into
#: failures in :mod:`tilesmith.gate.host.answers`).
AUDIT_CHECKS = ("audit_introspection", "audit_file_write", "audit_file_read", "audit_process", "audit_network",
                "audit_native")

#: Prefix of the ``state_changes`` keys that say what could run a candidate's code outside a timing sample's clock
#: (:mod:`tilesmith.gate.worker.outside`); the host reports them as ``outside_clock`` (red team 19).
OUTSIDE_CLOCK = "outside the clock: "


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
