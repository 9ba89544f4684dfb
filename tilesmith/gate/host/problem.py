"""What the gate is asked about: one captured graph, its first call's inputs and the trusted original."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tilesmith.records import CapturedGraph, ScalarSpec, TensorSpec


@dataclass(frozen=True)
class GateProblem:
    """The graph a :class:`~tilesmith.gate.Gate` evaluates candidates for.

    ``snapshot_dir`` (a private 0700 folder the pipeline fills before building the gate) holds
    ``inputs.pt`` — ``torch.save`` of the first real call's argument list, tensors cloned with identical
    size/stride/storage offset, Python scalars as they are — and ``constants.pt`` — ``torch.save`` of the
    ``dict[str, Tensor]`` of module attributes the wrapper needs at load time (may be ``{}``; the file
    may also be absent, meaning ``{}``).
    """

    label: str
    """Cache-key prefix and graph name, e.g. ``"1a2b3c4d (0_inference)"``; starts every message."""
    graph: CapturedGraph
    snapshot_dir: Path
    original_source: str
    """The reference wrapper (trusted), normally ``graph.canonical_source``."""

    @property
    def static_input_idxs(self) -> tuple[int, ...]:
        """Inputs the timing keeps at one address (one buffer) across the ``k`` calls of a sample.

        ``graph.static_input_idxs`` (parameters and buffers, recorded for forward and inference graphs
        only), minus inputs the graph mutates (``graph.mutated_input_idxs``: a shared buffer would carry one
        call's writes into the next, and the host could not rebuild a call's inputs), minus indices that are
        not tensor inputs of ``graph.inputs``; ``()`` for backward graphs whatever the record says.
        Every other input gets its own buffer per call (docs/gate.md, "Timing method").
        """
        graph = self.graph
        if graph.kind == "backward":
            return ()
        mutated = set(graph.mutated_input_idxs)
        n = len(graph.inputs)
        return tuple(sorted({int(i) for i in getattr(graph, "static_input_idxs", ()) or ()
                             if 0 <= int(i) < n and int(i) not in mutated and isinstance(graph.inputs[int(i)],
                                                                                        TensorSpec)}))

    @property
    def inputs_path(self) -> Path:
        return Path(self.snapshot_dir) / "inputs.pt"

    @property
    def constants_path(self) -> Path:
        return Path(self.snapshot_dir) / "constants.pt"

    def load_inputs(self) -> list[Any]:
        """The first call's inputs as CPU tensors (layouts kept; memory-mapped from the file) and scalars,
        validated against the graph.

        Raises:
            FileNotFoundError: ``inputs.pt`` is missing.
            ValueError: the list does not match ``graph.inputs`` (count, kinds, shape, stride, dtype); the
                message names the input index and says the pipeline must snapshot the first call's args.
        """
        if not self.inputs_path.is_file():
            raise FileNotFoundError(f"{self.label}: {self.inputs_path} is missing; the pipeline must save the first "
                                    f"call's inputs there before building the gate")
        # mmap: a snapshot of gigabytes is validated without a host copy of it (the workers read it themselves)
        values = torch.load(self.inputs_path, weights_only=True, map_location="cpu", mmap=True)
        if not isinstance(values, list):
            raise ValueError(f"{self.label}: {self.inputs_path} must hold a list (got {type(values).__name__})")
        specs = self.graph.inputs
        if specs and len(specs) != len(values):
            raise ValueError(f"{self.label}: inputs.pt has {len(values)} inputs, the graph {len(specs)}; save exactly "
                             f"the argument list the wrapper's call(args) received")
        for i, (value, spec) in enumerate(zip(values, specs)):
            if isinstance(spec, TensorSpec):
                if not isinstance(value, torch.Tensor):
                    raise ValueError(f"{self.label}: input {i} is {type(value).__name__}, the graph expects a tensor")
                if tuple(value.shape) != tuple(spec.shape) or str(value.dtype) != spec.dtype:
                    raise ValueError(f"{self.label}: input {i} is {tuple(value.shape)} {value.dtype}, the graph "
                                     f"expects {tuple(spec.shape)} {spec.dtype}")
                if _significant(value.shape, value.stride()) != _significant(spec.shape, spec.stride):
                    raise ValueError(f"{self.label}: input {i} has strides {tuple(value.stride())}, the graph expects "
                                     f"{tuple(spec.stride)}; clone with torch.empty_strided + copy_")
            elif isinstance(spec, ScalarSpec) and isinstance(value, torch.Tensor):
                raise ValueError(f"{self.label}: input {i} is a tensor, the graph expects a Python scalar")
        return values


def _significant(shape: Any, stride: Any) -> tuple[tuple[int, int], ...]:
    return tuple((int(i), int(st)) for i, (sz, st) in enumerate(zip(shape, stride)) if int(sz) > 1)
