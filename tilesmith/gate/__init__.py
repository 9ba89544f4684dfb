"""gate stage: the host-owned decision on candidate wrappers (see :mod:`tilesmith.gate.host.gate`).

Public: :class:`Gate`, :class:`GateProblem`. Importing this package is cheap; the gate's modules (and
torch) load on first attribute access, so ``python -m tilesmith.gate.worker`` pays nothing extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tilesmith.gate.host.gate import Gate
    from tilesmith.gate.host.problem import GateProblem

__all__ = ["Gate", "GateProblem"]


def __getattr__(name: str) -> Any:
    if name == "Gate":
        from tilesmith.gate.host.gate import Gate

        return Gate
    if name == "GateProblem":
        from tilesmith.gate.host.problem import GateProblem

        return GateProblem
    raise AttributeError(f"module 'tilesmith.gate' has no attribute {name!r}")
