"""What every built-in generator shares: the proposal record, the per-graph context and the interface."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


class Skip(Exception):
    """A generator cannot (or should not) transform this source; the message says why, for the notes."""


@dataclass(frozen=True)
class Proposal:
    """One candidate source a generator proposes, with the one-line note recorded with its evaluation."""

    generator: str
    source: str
    note: str


@dataclass(frozen=True)
class KernelTiming:
    """One launch configuration of one Triton kernel, as measured by the search worker (milliseconds)."""

    config: dict[str, Any]
    ms: float
    default: bool
    """True for a configuration Inductor's own heuristics (the ones the wrapper was compiled with) propose."""


@dataclass(frozen=True)
class Profile:
    """Proposal-time measurements of the *original* wrapper, taken in a search worker on the graph's GPU.

    They only order and filter proposals; the gate re-measures everything that is installed.

    ``eager_ms``: wall-clock time per call of ``call(args)``; on CUDA each call is followed by a device
    synchronize (the latency of an isolated call, host launch work included, as the gate times calls); on the CPU
    calls back to back. ``graph_ms``: the same per replay of the call captured into one CUDA graph (GPU time
    without the host's launch work); ``None`` when the capture failed, with
    ``capture_error`` saying why. ``kernels``: per kernel variable name, every measured configuration.
    """

    eager_ms: float | None
    graph_ms: float | None
    capture_error: str | None = None
    kernels: dict[str, tuple[KernelTiming, ...]] = field(default_factory=dict)
    kernel_skips: dict[str, str] = field(default_factory=dict)
    errors: tuple[str, ...] = ()
    wall_s: float | None = None
    variants: tuple[Any, ...] = ()
    """One :class:`~tilesmith.agent.builtin.configs.VariantScreen` per configuration variant the worker compiled."""


@dataclass
class GraphContext:
    """Per-graph facts the generators read (built once per :meth:`BuiltinOptimizer.optimize`)."""

    device: str
    """``"cuda:0"``-style device of the graph, or ``"cpu"`` in test mode."""
    agency: str
    mutated_input_idxs: tuple[int, ...] = ()
    constant_names: tuple[str, ...] = ()
    min_improvement: float = 0.02
    profile: Profile | None = None
    profile_error: str | None = None
    incumbent_ms: float | None = None
    """Time per call of the current incumbent in the profile's units (the original's ``eager_ms`` until a
    candidate is accepted, then that over the gate's speedup); the configuration proposals' gains use it."""
    fx_program: str = ""
    """``CapturedGraph.fx_program``: the FX program the wrapper computes (pattern generators match on it)."""

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")


class Generator(Protocol):
    """A deterministic source transformation proposed through the gate."""

    name: str

    def inapplicable(self, source: str, ctx: GraphContext) -> str | None:
        """Why this generator cannot apply to this graph at all (``None`` when it can)."""

    def expected_gain(self, source: str, ctx: GraphContext) -> float | None:
        """Expected fractional speed-up of proposing on ``source`` now (``None``: unknown, no profile)."""

    def propose(self, source: str, ctx: GraphContext) -> Proposal:
        """The candidate built from ``source`` (the current incumbent).

        Raises:
            Skip: nothing to propose (the message is recorded in the optimizer's summary note).
        """
