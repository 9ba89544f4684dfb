"""Memory an installed wrapper keeps across its checked calls (production verification's leak rule).

The 2026-12-05 red team installed a wrapper that kept a slice of every input alive (``_keep.append(x[:16].clone())``):
+2.2 GiB of resident memory over 3,000 calls, which no output comparison sees. On every checked call
:class:`LeakWatch` reads the process's allocated bytes just before and just after the installed wrapper's run:

    retained = (after − before) − bytes of the storages of its fresh outputs

(an output that is an input or a view of one is not fresh; storages shared by several outputs count once). Inputs
the wrapper frees do not enter: the check holds every input of the call (``_Shadow.real``) until it is judged, so
Inductor's ``args.clear()`` frees nothing during the run.

The figure (:func:`allocated_bytes`):

* **CUDA**: the caching allocator's ``torch.cuda.memory_allocated(device)``, exact to its 512-byte blocks.
* **CPU**: glibc's ``mallinfo2()`` (``uordblks + hblkhd``: bytes in use in every arena plus ``mmap``-ed blocks),
  which PyTorch's CPU allocator (``posix_memalign``) goes through. Measured here (torch 2.11, glibc 2.36): a
  4 KiB to 64 MiB tensor adds its size plus 350–4,400 bytes of bookkeeping and page rounding; one call reads in
  ~0.4 µs. Without glibc (musl, macOS) the resident set size from ``/proc/self/statm`` is used: pages, and memory
  the allocator keeps after a free, so only a large steady leak shows.

Both figures are process-wide: another thread that allocates or frees during the wrapper's run moves it. The rule
is therefore a run of evidence, not one reading (:meth:`LeakWatch.problem`):

* the first :data:`WARMUP` checked calls are not judged (a CUDA-graph wrapper allocates its private pool and static
  buffers at its first captures: ``tilesmith/agent/builtin/cudagraph_runtime.py``);
* a call *retains* when ``retained`` exceeds :data:`SLACK_BYTES` plus :data:`SLACK_PER_OUTPUT` per output (the
  allocator's bookkeeping of the outputs themselves);
* the wrapper fails (``memory_leak``) when each of its last :data:`STREAK` judged checks retained and the least of
  them times the calls since install exceeds :data:`BASE_BOUND` plus twice the call's input and output bytes (the
  gate's bound on memory growth has the same shape: :func:`tilesmith.gate.host.memory.growth_bound`).

**Python objects** (the red team's R9: a module-level list of small dicts, a growing dict of small ``bytes``): CPython
keeps objects of up to 512 bytes in its own arenas (``mmap``-ed 256 KiB–1 MiB chunks), which ``mallinfo2`` does not
count. The same trend rule is applied to ``sys.getallocatedblocks()`` (the number of pymalloc blocks in use:
exact, O(1), ~0.1 µs a read here, no tracemalloc): a call *retains* blocks when it keeps more than
:data:`SLACK_BLOCKS` plus :data:`SLACK_BLOCKS_PER_OUTPUT` per output (its outputs' Python objects and returned
sequence), and the wrapper fails when each of its last :data:`STREAK` judged checks retained and the least of them
times the calls since install exceeds :data:`BLOCK_BOUND`. Why blocks and not the resident set size: RSS moves in
pages, keeps what the allocators cached after frees and includes every thread's work, so only a large steady leak
would show; the block count is exact for the objects a Python-level leak keeps. The CPU figure above (mallinfo2)
still covers objects larger than 512 bytes, which CPython takes from ``malloc``.

A leak of fewer bytes per call than the slack, a leak only on calls the wrapper guesses are unchecked, and memory
held outside the allocator (``mmap`` by native code, files) are not seen (docs/verification.md).
"""

from __future__ import annotations

import collections
import os
import sys
from typing import Any

import torch

WARMUP = 3
"""Checked calls after install whose retained bytes are not judged."""
STREAK = 6
"""Consecutive judged checks that must each retain before the estimate is compared with the bound."""
SLACK_BYTES = 4096
SLACK_PER_OUTPUT = 1024
"""Retained bytes up to ``SLACK_BYTES + SLACK_PER_OUTPUT × outputs`` are the allocator's own bookkeeping."""
SLACK_BLOCKS = 64
SLACK_BLOCKS_PER_OUTPUT = 8
"""CPython blocks up to ``SLACK_BLOCKS + SLACK_BLOCKS_PER_OUTPUT × outputs`` kept by a call are its own outputs'
objects and caches warming up."""
BLOCK_BOUND = 2_000_000
"""Estimated pymalloc blocks (≤ 512 bytes each, ~64–200 MiB for typical sizes) a leak may reach."""
BASE_BOUND = 256 * 2**20
"""Estimated total a leak may reach before the wrapper is uninstalled, plus twice the call's input+output bytes."""

_MALLINFO2: Any = None


def _mallinfo2() -> Any:
    """glibc's ``mallinfo2`` through ctypes, ``False`` when unavailable (read once per process)."""
    global _MALLINFO2
    if _MALLINFO2 is None:
        try:
            import ctypes

            class _Info(ctypes.Structure):
                _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                                  "usmblks", "fsmblks", "uordblks", "fordblks",
                                                                  "keepcost")]

            fn = ctypes.CDLL(None).mallinfo2
            fn.restype, fn.argtypes = _Info, []
            _MALLINFO2 = fn
        except (OSError, AttributeError):
            _MALLINFO2 = False
    return _MALLINFO2


def allocated_bytes(device: torch.device) -> int | None:
    """Bytes allocated on ``device`` now (module docstring), or ``None`` when no figure is available."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    if device.type != "cpu":
        return None
    info = _mallinfo2()
    if info:
        got = info()
        return int(got.uordblks + got.hblkhd)
    try:
        with open("/proc/self/statm", "rb") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def fresh_bytes(outputs: Any, inputs: list[Any], device: torch.device) -> tuple[int, int]:
    """``(bytes, count)`` of the storages of ``outputs`` on ``device`` that are not storages of ``inputs``."""
    taken = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
    total = count = 0
    for out in outputs if isinstance(outputs, (list, tuple)) else (outputs,):
        if not isinstance(out, torch.Tensor) or out.device.type != device.type:
            continue
        count += 1
        storage = out.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in taken:
            continue
        taken.add(ptr)
        total += storage.nbytes()
    return total, count


def io_bytes(outputs: Any, inputs: list[Any]) -> int:
    """Bytes of the call's input and output storages (each storage once)."""
    seen: set[int] = set()
    total = 0
    items = list(inputs) + list(outputs if isinstance(outputs, (list, tuple)) else (outputs,))
    for t in items:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


class LeakWatch:
    """The retained bytes of one installed wrapper's checked calls, and the rule (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.judged = 0
        self.recent: collections.deque[int] = collections.deque(maxlen=STREAK)
        self.available = allocated_bytes(device) is not None
        self.blocks: collections.deque[int] = collections.deque(maxlen=STREAK)
        self._blocks_before = 0

    def before(self) -> int | None:
        """Read just before the wrapper runs."""
        self._blocks_before = sys.getallocatedblocks()
        return allocated_bytes(self.device) if self.available else None

    def after(self, before: int | None, outputs: Any, inputs: list[Any]) -> int | None:
        """Read just after the wrapper ran (and its stream was synchronized); returns the call's retained bytes."""
        kept_blocks = sys.getallocatedblocks() - self._blocks_before
        if before is None:
            return None
        now = allocated_bytes(self.device)
        if now is None:
            return None
        fresh, count = fresh_bytes(outputs, inputs, self.device)
        retained = now - before - fresh
        self.judged += 1
        if self.judged > WARMUP:
            self.recent.append(retained if retained > SLACK_BYTES + SLACK_PER_OUTPUT * count else 0)
            n_out = len(outputs) if isinstance(outputs, (list, tuple)) else 1
            self.blocks.append(kept_blocks if kept_blocks > SLACK_BLOCKS + SLACK_BLOCKS_PER_OUTPUT * n_out else 0)
        return retained

    def problem(self, calls: int, outputs: Any, inputs: list[Any]) -> str | None:
        """A ``memory_leak`` detail when the rule holds after this check (``calls``: calls since install)."""
        if len(self.blocks) == STREAK and min(self.blocks) > 0 and min(self.blocks) * calls > BLOCK_BOUND:
            least = min(self.blocks)
            return (f"the installed wrapper kept at least {least} Python object blocks after each of its last "
                    f"{STREAK} checked calls (sys.getallocatedblocks() after its run minus before: objects it keeps "
                    f"in CPython's arenas, which the allocator's byte count does not see); at that rate about "
                    f"{least * calls} blocks over the {calls} calls since install, above the bound of {BLOCK_BOUND}")
        if len(self.recent) < STREAK or min(self.recent) <= 0:
            return None
        least = min(self.recent)
        io = io_bytes(outputs, inputs)
        bound = BASE_BOUND + 2 * io
        estimate = least * calls
        if estimate <= bound:
            return None
        figure = "torch.cuda.memory_allocated" if self.device.type == "cuda" else (
            "malloc's bytes in use (mallinfo2)" if _mallinfo2() else "the resident set size")
        return (f"the installed wrapper kept at least {_mib(least)} after each of its last {STREAK} checked calls "
                f"({figure} after its run minus before, less its fresh outputs' storages); at that rate about "
                f"{_mib(estimate)} over the {calls} calls since install, above the bound of {_mib(bound)} "
                f"({_mib(BASE_BOUND)} + 2 × the call's {_mib(io)} of inputs and outputs)")


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if abs(n) >= 2**20 else f"{n / 2**10:.1f} KiB"
