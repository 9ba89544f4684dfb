"""Generator ``cudagraph``: replay the whole ``call`` from one CUDA graph.

The transformation keeps Inductor's body (``Runner.call``) byte for byte and rebinds the module's ``call``
to :class:`~tilesmith.agent.builtin.cudagraph_runtime._TilesmithCUDAGraphCall`, whose source is embedded
into the candidate (see that module for the staging, aliasing and fallback rules). What it removes is the
host side of every call: Python statements, allocator calls, Triton launcher dispatch and CUDA launch
latency. That is the whole cost of small, launch-bound graphs (the 64-row MLP block spends more time
launching than computing) and nearly nothing for large GPU-bound ones, which is how the optimizer orders it
(:meth:`CudaGraphGenerator.expected_gain`).

Skipped, with the reason in the note: CPU graphs (test mode), graphs on several devices, wrappers that
already use CUDA graphs (reduce-overhead partitions) or already carry this runtime, bodies with random
number generation (a replay would repeat the captured random stream) and bodies with host
synchronisation (``.item()``, ``nonzero``: not capturable).
"""

from __future__ import annotations

from pathlib import Path

from tilesmith.agent.builtin.base import GraphContext, Proposal, Skip
from tilesmith.agent.builtin.wrapper_text import rewritable_entry, written_inputs

NAME = "cudagraph"
MARKER = "class _TilesmithCUDAGraphCall"

#: Text that means the body draws random numbers (Inductor's seeded RNG, aten random ops).
RNG_TOKENS = ("inductor_seeds", "inductor_lookup_seed", "inductor_random", "philox", "aten.rand", "aten.randn",
              "aten.randint", "aten.bernoulli", "aten.normal", "aten.uniform", "aten.exponential",
              "aten.multinomial", "native_dropout", "torch.rand(", "torch.randn(", "torch.randint(")
#: Text that means the body synchronises with the host (capture would fail).
SYNC_TOKENS = (".item()", "_local_scalar_dense", "aten.nonzero", ".tolist()", ".cpu()", "torch.cuda.synchronize")

#: Host cost of one replay with output copies, milliseconds: the figure subtracted from a measured profile
#: when estimating the gain (one graph launch ~5 µs plus a few copy/alloc calls ~2 µs each).
REPLAY_OVERHEAD_MS = 0.012

_BEGIN, _END = "# BEGIN EMBEDDED\n", "# END EMBEDDED\n"


def embedded_runtime() -> str:
    """The runtime source copied into candidates (``cudagraph_runtime.py`` between its markers)."""
    text = (Path(__file__).with_name("cudagraph_runtime.py")).read_text(encoding="utf-8")
    start, end = text.index(_BEGIN) + len(_BEGIN), text.index(_END)
    return text[start:end]


def cudagraph_source(source: str, *, device: str | None = None, mutated_input_idxs: tuple[int, ...] = (),
                     allow_cpu: bool = False) -> str:
    """Return ``source`` with ``call`` rebound to a whole-call CUDA-graph replay.

    Args:
        source: an Inductor Python wrapper (canonical or raw).
        device: the graph's device (``"cuda:0"``); default: from ``torch.cuda._DeviceGuard(i)`` in the body.
        mutated_input_idxs: the graph's mutated inputs (staged and copied back like in-place reused ones).
        allow_cpu: tests only: accept a CPU wrapper (the runtime is then driven with a simulated graph).

    Raises:
        Skip: the graph is outside what this generator handles (message says which rule).
    """
    if MARKER in source:
        raise Skip("the source already replays a whole-call CUDA graph")
    entry = rewritable_entry(source, partitions="the wrapper already runs CUDA-graph partitions (mode='reduce-overhead')")
    if device is None:
        device = f"cuda:{entry.device_indices[0]}" if entry.device_indices else "cpu"
    if not device.startswith("cuda") and not allow_cpu:
        raise Skip("CPU graph: CUDA graphs do not apply")
    body_text = _body_text(source, entry)
    rng = [t for t in RNG_TOKENS if t in body_text]
    if rng:
        raise Skip(f"the body draws random numbers ({rng[0]}): a replay would repeat the captured stream")
    sync = [t for t in SYNC_TOKENS if t in body_text]
    if sync:
        raise Skip(f"the body synchronises with the host ({sync[0]}), which CUDA graphs cannot capture")
    written = written_inputs(source, entry, mutated_input_idxs)
    lines = source.splitlines(keepends=True)
    cut = entry.insert_after_line
    head, tail = "".join(lines[:cut]), "".join(lines[cut:])
    if not head.endswith("\n"):
        head += "\n"
    return head + _block(entry.eager_expr, device, written, entry.input_names) + tail


def _block(eager_expr: str, device: str, written: tuple[int, ...], names: tuple[str, ...]) -> str:
    shown = ", ".join(f"{i} ({names[i]})" for i in written) if written else "none"
    prefix = ""
    if eager_expr == "call":
        prefix, eager_expr = "_tilesmith_eager_call = call\n", "_tilesmith_eager_call"
    return (
        "\n\n# ---- Tilesmith built-in agent, generator 'cudagraph': whole-call CUDA graph ----\n"
        "# The Inductor body above is unchanged. `call` below runs it eagerly once (kernel compilation and\n"
        "# autotuning), then captures it into one torch.cuda.CUDAGraph and replays it: inputs at the same\n"
        "# address as on the previous call (parameters) are read in place, other inputs are copied into\n"
        "# static buffers, fresh outputs are copied out of the graph's memory pool so that the caller owns\n"
        "# them, and outputs that are inputs stay the caller's tensors.\n"
        f"# Inputs the body writes into (staged, then copied back after each replay): {shown}.\n"
        f"{prefix}{embedded_runtime()}\n\n"
        f"_tilesmith_cudagraph = _TilesmithCUDAGraphCall({eager_expr}, device={device!r}, "
        f"written_inputs={tuple(written)!r})\n\n\n"
        "def call(args):\n"
        "    \"\"\"Entry point with Inductor's ABI (takes the argument list and clears it).\"\"\"\n"
        "    return _tilesmith_cudagraph(args)\n"
        "# ---- end of generator 'cudagraph' ----\n\n"
    )


def _body_text(source: str, entry) -> str:
    import ast

    tree = ast.parse(source)
    if entry.form == "runner":
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Runner")
        node = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "call")
    else:
        node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "call")
    return ast.get_source_segment(source, node) or ""


class CudaGraphGenerator:
    """Generator 1 (see the module docstring)."""

    name = NAME

    def inapplicable(self, source: str, ctx: GraphContext) -> str | None:
        if not ctx.is_cuda:
            return "CPU graph: CUDA graphs do not apply"
        if ctx.agency == "low":
            return "agency 'low' keeps the wrapper's structure (only launch configurations and cleanup)"
        if ctx.profile is not None and ctx.profile.capture_error:
            return f"the original call could not be captured in the search worker: {ctx.profile.capture_error}"
        return None

    def expected_gain(self, source: str, ctx: GraphContext) -> float | None:
        profile = ctx.profile
        if profile is None or not profile.eager_ms or profile.graph_ms is None:
            return None
        return max(0.0, 1.0 - (profile.graph_ms + REPLAY_OVERHEAD_MS) / profile.eager_ms)

    def propose(self, source: str, ctx: GraphContext) -> Proposal:
        new = cudagraph_source(source, device=ctx.device, mutated_input_idxs=ctx.mutated_input_idxs)
        gain = self.expected_gain(source, ctx)
        detail = "" if gain is None else f" (profile: eager {ctx.profile.eager_ms:.4f} ms/call, graph replay " \
                                         f"{ctx.profile.graph_ms:.4f} ms)"
        return Proposal(NAME, new, "whole-call CUDA graph replay with staged inputs and copied-out outputs"
                        + detail)
