"""The graphs of a benchmark case as Inductor receives them, and their roofline costs (no kernel is generated).

``capture_graphs`` traces a case through Dynamo and AOTAutograd with a record-only inner compiler; ``cost_graphs``
turns each graph's FX program into bytes, FLOPs and a floor (``tilesmith/roofline/cost.py``; docs/benchmarks.md,
"The roofline floor").
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from bench.cases import Workload
from tilesmith.records import ScalarSpec, TensorSpec
from tilesmith.roofline import DeviceLimits, floor_from_cost, graph_cost

@dataclasses.dataclass(frozen=True)
class CapturedFx:
    """One graph as it reached Inductor's ``compile_fx_inner`` (record only: nothing is compiled)."""

    name: str
    kind: str
    fx_program: str
    inputs: tuple[Any, ...]


def capture_graphs(workload: Workload) -> list[CapturedFx]:
    """Trace ``workload`` through Dynamo and AOTAutograd exactly as Inductor would and keep each graph's FX text.

    The inner compiler records ``print_readable(include_stride=True, include_device=True)`` and returns
    the graph to run eagerly, so no kernel is generated; the AOT cache is off so that every graph is
    seen. Runs on a copy of the module; Dynamo is reset before and afterwards (so call it before any arm).
    """
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import compile_fx

    records: list[CapturedFx] = []

    def inner(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        kind = "backward" if kwargs.get("is_backward") else "inference" if kwargs.get("is_inference") else "forward"
        specs = tuple(
            TensorSpec(tuple(t.shape), tuple(t.stride()), str(t.dtype), str(t.device), int(t.storage_offset()))
            if isinstance(t, torch.Tensor) else ScalarSpec(t if isinstance(t, (int, float, bool)) else 0)
            for t in example_inputs)
        text = gm.print_readable(print_output=False, include_stride=True, include_device=True)
        records.append(CapturedFx(f"{kwargs.get('graph_id', len(records))}_{kind}", kind, text, specs))
        return make_boxed_func(gm.forward)

    def backend(gm: torch.fx.GraphModule, example_inputs: Any, **_: Any) -> Any:
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, inner_compile=inner)

    model = copy.deepcopy(workload.model)
    torch._dynamo.reset()
    fn = torch.compile(model, backend=backend)
    try:
        if workload.train:
            fn(*workload.inputs).backward(workload.grad)
        else:
            with torch.no_grad():
                fn(*workload.inputs)
        if workload.inputs and workload.inputs[0].device.type == "cuda":
            torch.cuda.synchronize()
    finally:
        torch._dynamo.reset()
    return records


def cost_graphs(graphs: list[CapturedFx], limits: DeviceLimits) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per-graph costs and floors, and the end-to-end floor (the sum over graphs; ``None`` if any is uncostable)."""
    rows = []
    total_ms: float | None = 0.0
    total_bytes = total_flops = 0
    for g in graphs:
        row: dict[str, Any] = {"name": g.name, "kind": g.kind}
        try:
            cost = graph_cost(g.fx_program, g.inputs)
            floor = floor_from_cost(cost, limits)
            row.update(bytes_read=cost.bytes_read, bytes_written=cost.bytes_written, flops=cost.flops,
                       flops_by_dtype=dict(cost.flops_by_dtype), floor_ms=floor.floor_ms,
                       memory_ms=1e3 * cost.bytes_moved / (limits.copy_gbps * 1e9),
                       flops_tflops=floor.flops_tflops)
            total_bytes += cost.bytes_moved
            total_flops += cost.flops
            total_ms = None if total_ms is None else total_ms + floor.floor_ms
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {exc}"
            total_ms = None
        rows.append(row)
    memory_ms = 1e3 * total_bytes / (limits.copy_gbps * 1e9)
    bound = None if total_ms is None else ("memory" if memory_ms >= 0.999 * total_ms else "compute")
    return rows, {"floor_ms": total_ms, "bytes_moved": total_bytes, "flops": total_flops,
                  "memory_ms": memory_ms, "bound": bound}
