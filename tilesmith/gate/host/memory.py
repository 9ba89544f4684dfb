"""How much memory an evaluation takes, sized from the graph's own bytes and the device's free memory.

The trusted worker reports, once per gate, the bytes of the first call's inputs, of the original's outputs, the
original's peak allocation during one call (CUDA) and the memory free on the device with it loaded
(:func:`tilesmith.gate.worker.runtime.memory_facts`; on the CPU, test mode, ``MemAvailable``). From these the
gate derives (:class:`MemoryPlan`): the held calls of the correctness checks, the poisoned blocks, and whether
a candidate's worker can run an evaluation at all. The timing input sets are sized by the workers' own free
memory at warm-up (:func:`tilesmith.gate.host.timing.choose_k`). A graph that cannot be evaluated in the
memory left gets the ``gate_memory`` status and diagnostic naming the bytes needed and free — never a crash
attributed to an honest candidate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tilesmith.gate.host.checks import HELD_BYTES_BUDGET, MIN_HELD_CALLS
from tilesmith.records import CheckFailure

GIB = float(1 << 30)
#: A CUDA context and the worker's torch import on the device (H200, torch 2.11: ≈ 0.5 GiB per process).
CONTEXT_BYTES = 768 << 20
#: Device copies of the inputs one candidate worker holds at once during the checks: the first call's inputs,
#: two cached variants, one guarded set (+ ¼ canary tail) with its byte snapshot and its logical-value copy.
INPUT_COPIES = 1 + 2 + 1.25 + 1.25 + 1
#: Output copies beyond the held calls: the first call's outputs and snapshot, one more call's and its snapshot.
OUTPUT_COPIES = 4


@dataclass(frozen=True)
class MemoryPlan:
    """Sizes in bytes; ``free``/``total``: the device's (host RAM on the CPU) with the trusted worker loaded."""

    device: str
    free: int
    total: int
    input_bytes: int
    output_bytes: int
    call_peak_bytes: int

    @property
    def minimum(self) -> int:
        """Bytes one candidate worker needs for the smallest evaluation (:data:`MIN_HELD_CALLS` held calls)."""
        outputs = self.output_bytes * (2 * MIN_HELD_CALLS + OUTPUT_COPIES)
        return int(CONTEXT_BYTES + INPUT_COPIES * self.input_bytes + outputs + max(self.call_peak_bytes,
                                                                                   self.output_bytes))

    @property
    def fits(self) -> bool:
        return self.free <= 0 or self.minimum <= self.free

    def spares_fit(self, spares: int) -> bool:
        """Whether ``spares`` idle candidate workers may each hold a device context and two copies of the inputs
        (a spare's early ``init``): all of them within a quarter of what stays free beyond :attr:`minimum`
        (``True`` when the free memory is unknown)."""
        if self.free <= 0:
            return True
        return (CONTEXT_BYTES + 2 * self.input_bytes) * max(1, spares) <= max(0, self.free - self.minimum) // 4

    @property
    def held_budget(self) -> int:
        """Bytes for held outputs and their snapshots: half of what stays free beyond the minimum (≤ 8 GiB)."""
        if self.free <= 0:
            return HELD_BYTES_BUDGET
        spare = self.free - self.minimum + 2 * MIN_HELD_CALLS * self.output_bytes
        return int(max(0, min(HELD_BYTES_BUDGET, spare // 2)))

    @property
    def poison_budget(self) -> int:
        """Bytes of poisoned blocks before a poisoned call: a quarter of what stays free beyond the minimum,
        at least the output bytes once (``0``: no cap, when the free memory is unknown)."""
        if self.free <= 0:
            return 0
        return int(max(self.output_bytes, (self.free - self.minimum) // 4))

    def message(self, label: str) -> str:
        return (f"{label}: the gate cannot evaluate this graph in the memory left on {self.device}: a candidate's "
                f"worker needs about {self.minimum / GIB:.2f} GiB (inputs {self.input_bytes / GIB:.2f} GiB × "
                f"{INPUT_COPIES:g} copies, outputs {self.output_bytes / GIB:.2f} GiB × "
                f"{2 * MIN_HELD_CALLS + OUTPUT_COPIES} for held calls and snapshots, the original's peak "
                f"{self.call_peak_bytes / GIB:.2f} GiB per call, {CONTEXT_BYTES / GIB:.2f} GiB for its context) and "
                f"{self.free / GIB:.2f} GiB of {self.total / GIB:.2f} GiB are free with the trusted worker loaded. "
                f"Free memory on the device (other processes, a smaller batch) to let Tilesmith optimize it; the "
                f"graph stays on Inductor.")


def plan_from(device: str, init: dict[str, object]) -> MemoryPlan:
    """The plan from the trusted worker's ``init`` answer (``memory``, ``input_bytes``, ``output_bytes``,
    ``call_peak_bytes``)."""
    memory = init.get("memory") if isinstance(init.get("memory"), dict) else {}
    assert isinstance(memory, dict)
    return MemoryPlan(device=device, free=int(memory.get("free", 0) or 0), total=int(memory.get("total", 0) or 0),
                      input_bytes=int(init.get("input_bytes", 0) or 0), output_bytes=int(init.get("output_bytes", 0) or 0),
                      call_peak_bytes=int(init.get("call_peak_bytes", 0) or 0))


def oom_message(error: dict[str, object], memory: dict[str, object] | None) -> str:
    """Why a call ran out of memory, with the worker's memory facts at that moment."""
    facts = memory or {}
    free, total = int(facts.get("free", 0) or 0), int(facts.get("total", 0) or 0)
    held = int(facts.get("allocated", 0) or 0)
    return (f"ran out of memory with {free / GIB:.2f} GiB of {total / GIB:.2f} GiB free while the worker held "
            f"{held / GIB:.2f} GiB (gate inputs, held outputs and the call's own buffers)")


#: Memory a candidate's import, or its correctness calls taken together, may add to its worker beyond
#: :data:`GROWTH_FACTOR` × the original's bytes (inputs, outputs, peak per call): the Python modules and compiled
#: kernels an honest wrapper loads (a few MiB to tens of MiB for the CPU wrappers of the test suite) with margin.
GROWTH_SLACK_BYTES = 256 << 20
GROWTH_FACTOR = 2


def growth_bound(plan: MemoryPlan) -> int:
    """Bytes of growth allowed at import and over the correctness calls (:data:`GROWTH_SLACK_BYTES` +
    :data:`GROWTH_FACTOR` × (input + output + per-call peak bytes of the original))."""
    return int(GROWTH_SLACK_BYTES + GROWTH_FACTOR * (plan.input_bytes + plan.output_bytes + plan.call_peak_bytes))


def growth_failure(before: Any, after: Any, plan: MemoryPlan, where: str, retained: int = 0) -> CheckFailure | None:
    """``memory_growth`` when the worker's memory (``allocated`` of
    :func:`tilesmith.gate.worker.runtime.memory_facts`: CUDA's caching allocator; resident set size on the CPU)
    grew by more than :func:`growth_bound` between two answers' facts; ``None`` otherwise or when either is
    unknown. ``retained``: bytes the gate's own buffers may still hold in that figure (freed but not returned to
    the operating system: CPU). Issue 15 (leaks and blow-ups: a 4 GiB buffer allocated at import, every output
    kept alive)."""
    try:
        grown = int(after["allocated"]) - int(before["allocated"])
    except (TypeError, KeyError, ValueError):
        return None
    bound = growth_bound(plan) + max(0, int(retained))
    if grown <= bound:
        return None
    return CheckFailure("memory_growth", f"{where} the candidate's worker holds {grown / GIB:.2f} GiB more memory "
                                         f"({'resident set' if plan.device.startswith('cpu') else 'allocated on the device'}) "
                                         f"than before; the bound is {bound / GIB:.2f} GiB ({GROWTH_SLACK_BYTES >> 20} MiB "
                                         f"+ {GROWTH_FACTOR} × the original's inputs, outputs and per-call peak"
                                         f"{', + what the gate itself held' if retained else ''}). A "
                                         f"wrapper must not allocate large buffers at import nor keep its inputs or "
                                         f"outputs alive across calls.")


_UNITS = {"bytes": 1, "b": 1, "kb": 1e3, "kib": 1 << 10, "mb": 1e6, "mib": 1 << 20, "gb": 1e9, "gib": 1 << 30,
          "tb": 1e12, "tib": 1 << 40}


def requested_bytes(message: str) -> int | None:
    """The allocation size an out-of-memory message names (CUDA: ``Tried to allocate 20.00 GiB``; c10's CPU
    allocator: ``you tried to allocate 1125899906842624 bytes``), or ``None``."""
    import re

    match = re.search(r"tried to allocate\s+([\d.]+)\s*([KMGT]i?B|bytes|B)\b", message, re.IGNORECASE)
    if not match:
        return None
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def oom_check(message: str, plan: MemoryPlan) -> str:
    """``gate_memory`` when a candidate's failed allocation would have fit in what the device had free before the
    gate held anything for the evaluation (or the size is unknown): the gate's own buffers may be what left too
    little; ``oom`` (a crash of the candidate) when it asked for more than that (``torch.empty(2**50)``)."""
    size = requested_bytes(message)
    if size is not None and plan.free > 0 and size > plan.free:
        return "oom"
    return "gate_memory"


__all__ = ["MemoryPlan", "growth_bound", "growth_failure", "oom_check", "oom_message", "plan_from", "requested_bytes"]
