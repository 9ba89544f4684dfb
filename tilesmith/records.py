"""Frozen records that cross stage and process boundaries.

Data flows one way: ``capture`` produces a :class:`CapturedGraph`; ``track`` gives it a cache key and a
folder; an optimizer proposes :class:`Candidate` sources; the ``gate`` answers with a :class:`Verdict`
holding :class:`Timing` samples; ``install`` produces the :class:`BenchmarkRecord` users read.
:class:`Diagnostic` records say why a graph stayed on ordinary Inductor.

Units are in field names (``_ms`` milliseconds, ``_s`` seconds). Absent values are ``None``, never a
sentinel number. Every number in these records is computed in the host process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

GraphKind = Literal["inference", "forward", "backward"]


class GraphState(str, Enum):
    """Where one eligible graph is in its life in the user's process (``GraphHandle.state``).

    ``pending`` (captured, waiting for its first real call) → ``optimizing`` (this process runs the optimizer) or
    ``rechecking`` (a cached artifact is re-checked by the gate) or, under torch.distributed, ``following`` (another
    rank optimizes) and ``agreeing`` (the ranks vote on the winner) → ``installed`` or ``kept_inductor``;
    ``installed`` → ``uninstalled`` when production verification finds a mismatch. A ``str`` enum: members equal
    their value, so records and JSON keep the plain strings.
    """

    PENDING = "pending"
    OPTIMIZING = "optimizing"
    RECHECKING = "rechecking"
    FOLLOWING = "following"
    AGREEING = "agreeing"
    INSTALLED = "installed"
    KEPT_INDUCTOR = "kept_inductor"
    UNINSTALLED = "uninstalled"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class TensorSpec:
    """Metadata of one tensor input as the wrapper's ``assert_size_stride`` expects it."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    """``str(torch.dtype)``, e.g. ``"torch.float32"``."""
    device: str
    """``str(torch.device)``, e.g. ``"cuda:0"`` or ``"cpu"``."""
    storage_offset: int = 0


@dataclass(frozen=True)
class ScalarSpec:
    """A non-tensor input (an ``int``/``float``/``bool`` the wrapper receives in ``args``)."""

    value: int | float | bool


InputSpec = TensorSpec | ScalarSpec


@dataclass(frozen=True)
class CapturedGraph:
    """One Inductor-generated Python wrapper, as captured at ``compile_fx_inner``.

    ``source`` is the module exactly as Inductor wrote it; ``canonical_source`` is the same text with
    machine-specific paths removed (see :func:`tilesmith.capture.source.canonicalize`), which is what
    the cache key hashes, what attempts contain and what candidates are derived from.
    """

    name: str
    """AOTAutograd id of the graph, e.g. ``"0_inference"``, ``"1_forward"``, ``"1_backward"``."""
    kind: GraphKind
    source: str
    canonical_source: str
    fx_program: str
    """Readable FX graph (with shapes, strides and devices) as it reached Inductor, before its passes; for a
    graph an AOTAutograd cache hit loaded, Inductor's stored graph after its post-grad passes."""
    inputs: tuple[InputSpec, ...]
    output_strides: tuple[tuple[str, ...] | None, ...]
    """Inductor's ``output_strides`` (stride expressions as text); ``None`` for non-tensor outputs."""
    mutated_input_idxs: tuple[int, ...]
    inputs_to_check: tuple[int, ...]
    """Input indices whose 16-byte alignment Inductor checks (``align_inputs_from_check_idxs``)."""
    device: str
    """The one device the graph runs on: ``"cuda:0"``, ``"cpu"`` (test mode only)."""
    inductor_key: str | None
    """Inductor's FX graph cache key (``_fx_graph_cache_key``), stable across cache dirs."""
    compile_mode: str | None = None
    constant_names: tuple[str, ...] = ()
    """Module attributes Inductor passes at load time (constants, frozen parameters)."""
    static_input_idxs: tuple[int, ...] = ()
    """Inputs Inductor treats as living at one address across calls (the ``static_input_idxs`` it passes to
    ``inner_compile``: the module's parameters and buffers, and tensors marked with
    ``torch._dynamo.mark_static_address``), recorded for forward and inference graphs only; always ``()``
    for backward graphs (Inductor marks their saved activations static for its own CUDA-graph trees,
    although their addresses change from step to step in training) and under ``freezing`` (the indices then
    refer to the argument list before frozen parameters were removed). The gate's timing keeps these
    inputs at one address across the calls of a sample (docs/gate.md, "Timing method"). Not part of the
    cache key."""
    fx_module: Any = field(default=None, repr=False, compare=False)
    """The graph as ``inner_compile`` received it, serialized (:class:`tilesmith.capture.fxgraph.FxModule`), so
    that the built-in agent's configuration generator can compile it again under other Inductor configurations in
    its search worker; ``None`` when it could not be serialized or the graph came from the AOTAutograd cache. Not
    part of the cache key."""


@dataclass(frozen=True)
class Candidate:
    """A wrapper source proposed by an optimizer. Untrusted until the gate accepts it."""

    source: str
    proposer: str
    """Who wrote it: ``"builtin:<generator>"``, ``"llm:<agent name>"``, ``"scripted"``, ``"cache"``."""
    attempt: int | None = None
    """Ring slot (0–4) the source was read from, when it came from an attempt file."""
    note: str = ""
    """One line saying what the candidate changes, for reports."""


@dataclass(frozen=True)
class Timing:
    """Paired timing samples of a baseline and a candidate, and their host-computed statistics.

    Samples alternate baseline/candidate (order randomized per pair); each sample is the mean time of
    ``calls_per_sample`` calls, in milliseconds. ``speedup`` is the median over pairs of
    ``baseline_ms[i] / candidate_ms[i]``; ``ci_low``/``ci_high`` a 95 % percentile-bootstrap interval
    of that median.
    """

    method: Literal["cuda_event", "process_cpu_time", "host_clock"]
    """How a sample was measured: CUDA events around the calls (GPU), the worker process's CPU time of every
    thread (CPU test mode, the gate), or a host wall clock (CPU, outside the gate: roofline, benchmarks)."""
    calls_per_sample: int
    baseline_ms: tuple[float, ...]
    candidate_ms: tuple[float, ...]
    speedup: float
    ci_low: float
    ci_high: float
    baseline_label: str = "inductor"
    """``"inductor"`` when the baseline is the original wrapper, else ``"incumbent"``."""
    original_ms: tuple[float, ...] | None = None
    """Samples of the original Inductor wrapper when the baseline is an earlier accepted candidate."""
    speedup_vs_original: float | None = None
    speedup_vs_original_ci: tuple[float, float] | None = None
    """95 % percentile-bootstrap interval of ``speedup_vs_original`` (same construction as ``ci_low``/``ci_high``)."""
    control_ms: tuple[float, ...] | None = None
    """Samples of the baseline's code timed in the candidate's own process (the gate's in-process control arm)."""
    speedup_vs_control: float | None = None
    """Median per-pair ratio control / candidate: what the gate's rule decides on when a control arm ran."""
    speedup_vs_control_ci: tuple[float, float] | None = None

    @property
    def baseline_median_ms(self) -> float:
        return _median(self.baseline_ms)

    @property
    def candidate_median_ms(self) -> float:
        return _median(self.candidate_ms)


@dataclass(frozen=True)
class CheckFailure:
    """One failed gate check, written so that an agent can act on it."""

    check: str
    """Stable id, e.g. ``"value_mismatch"``, ``"stride_mismatch"``, ``"input_mutated"``, ``"crash"``."""
    message: str
    output_index: int | None = None
    input_index: int | None = None
    variant: str | None = None
    """Input variant that exposed it: ``"normal"``, ``"zero"``, ``"high_magnitude"`` …"""
    worst_index: tuple[int, ...] | None = None
    """Index of the worst (or first) offending element of ``output_index``, when the check is elementwise."""
    expected: str | None = None
    """The original wrapper's value at ``worst_index`` (or the expected shape/stride/dtype), as text."""
    got: str | None = None
    """The candidate's value at ``worst_index`` (or its shape/stride/dtype), as text."""


VerdictStatus = Literal[
    "accepted",
    "rejected_static",
    "rejected_load",
    "rejected_crash",
    "rejected_timeout",
    "rejected_incorrect",
    "rejected_global_state",
    "rejected_slower",
    "rejected_marginal",
    "rejected_unconfirmed",
    "rejected_duplicate",
    "rejected_policy",
    "gate_memory",
]


@dataclass(frozen=True)
class Verdict:
    """The host gate's decision on one candidate."""

    accepted: bool
    status: VerdictStatus
    reasons: tuple[str, ...]
    failures: tuple[CheckFailure, ...] = ()
    timing: Timing | None = None
    confirmation: Timing | None = None
    report_path: str | None = None
    evaluation_id: str = ""
    wall_s: float | None = None

    def summary(self) -> str:
        """One line for logs and agent tool results."""
        head = f"{self.status}"
        if self.timing is not None:
            head += f" speedup={self.timing.speedup:.3f} [{self.timing.ci_low:.3f}, {self.timing.ci_high:.3f}]"
        if self.confirmation is not None:
            head += f" confirmed={self.confirmation.speedup:.3f}"
        if self.reasons:
            head += ": " + "; ".join(self.reasons[:3])
        return head


@dataclass(frozen=True)
class Diagnostic:
    """Why something happened (or did not) to a graph or a run. ``kind`` values are stable."""

    kind: str
    message: str
    graph_key: str | None = None
    """64-hex cache key of the graph, when the diagnostic concerns one eligible graph."""
    graph_name: str | None = None
    """AOT id of the graph (``"0_inference"``) when known."""


@dataclass(frozen=True)
class RooflineFloor:
    """Lower bound on a graph's time from the bytes it must move and the FLOPs it must run.

    Bytes count each input read once and each output written once; FLOPs count matmul/conv/SDPA
    multiply-adds as 2. Limits are measured on the device (a large device-to-device copy, counting bytes
    read plus written; large bf16 and fp32 matmuls, each dtype's FLOPs against its own measured rate),
    not taken from a datasheet (see :mod:`tilesmith.roofline`).
    """

    bytes_moved: int
    flops: int
    bandwidth_gbps: float
    flops_tflops: float
    floor_ms: float


@dataclass(frozen=True)
class BenchmarkRecord:
    """One installed graph: Inductor's time against Tilesmith's, both measured by the host gate.

    ``torch_inductor_ms`` and ``tilesmith_ms`` are medians of the confirmation's paired samples (ms per
    call); ``speedup`` is the median of per-pair ratios (not the ratio of medians), with its bootstrap
    95 % interval in ``speedup_ci``.
    """

    graph_key: str
    graph_name: str
    kind: GraphKind
    torch_inductor_ms: float
    tilesmith_ms: float
    speedup: float
    speedup_ci: tuple[float, float]
    source: Literal["optimizer", "cache"]
    loops_accepted: int
    track_dir: str
    roofline_floor_ms: float | None = None
    roofline: RooflineFloor | None = None
    method: str = "cuda_event"
    extras: tuple[tuple[str, str], ...] = field(default=())
    measured_by_rank: int | None = None
    """Under ``torch.distributed`` (docs/distributed.md): the global rank whose gate measured these numbers,
    the graph's leader; on the other ranks the wrapper was re-checked for correctness on their own device and
    installed with the leader's numbers. ``None`` outside a multi-rank job."""


def _median(values: tuple[float, ...]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        return float("nan")
    mid = n // 2
    return ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])
