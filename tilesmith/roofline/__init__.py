"""Roofline floor of a captured graph: the bytes it must move and the FLOPs it must run, against the
device's measured copy bandwidth and matrix-multiply rate.

Two parts: :mod:`tilesmith.roofline.cost`, the cost model (pure and CPU-testable: bytes, FLOPs and floors from the
FX program text; its docstring has the counting rules), and :mod:`tilesmith.roofline.measure`, the device
measurement (:func:`measure_device_limits`). This package re-exports the public names of both.
"""

from tilesmith.roofline.cost import (
    DeviceLimits,
    GraphCost,
    RooflineParseError,
    floor_from_cost,
    floor_from_fx,
    graph_cost,
    roofline_floor,
)
from tilesmith.roofline.measure import clear_limits_cache, measure_device_limits

__all__ = ["DeviceLimits", "GraphCost", "RooflineParseError", "clear_limits_cache", "floor_from_cost",
           "floor_from_fx", "graph_cost", "measure_device_limits", "roofline_floor"]
