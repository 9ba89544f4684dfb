"""Worker-side tensor machinery: guarded inputs, guarded allocations, allocator poisoning, output facts.

Runs only inside ``python -m tilesmith.gate.worker`` (never in the user's process).

- **Guarded inputs** (:class:`InputSet`): every input tensor lives in a private ``uint8`` storage with
  its exact size, stride and storage offset, followed by a guard tail; everything that is not one of
  the tensor's logical elements (offset prefix, stride gaps, tail) holds :data:`CANARY_BYTE`. A byte
  snapshot taken before the call tells afterwards whether the candidate changed a logical element
  (an input mutation) or anything else (an out-of-bounds write).
- **Guarded allocations** (:class:`GuardedAllocator`): during correctness checks the wrapper's own
  allocation helpers (``empty_strided_cpu``/``empty_strided_cuda``/``empty_strided``) are replaced in
  the loaded module's namespace by versions that fill the new buffer with a poison byte (an output the
  candidate never writes stays visibly poisoned) and append a canary tail (a kernel writing past the
  end of a buffer is caught). Timing runs use the module untouched.
- **Allocator poisoning** (:func:`poison_allocator`): before the candidate runs first, freed cached
  memory is released and refilled with the poison byte, so ``torch.empty`` cannot return the
  reference's stale results (the Sakana / KernelBench PR #82 exploit).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch

from tilesmith.gate.layout import bits, clone_layout, overlaps, storage_extent, write_values
from tilesmith.gate.protocol import CANARY_BYTE

#: Guard tail after every guarded buffer: a quarter of the buffer, at least 512 bytes, at most 4 MiB.
_GUARD_MIN, _GUARD_MAX = 512, 4 * 1024 * 1024
#: Guarded allocations are kept alive (so their tails can be read after the call) up to this many bytes
#: in total; later allocations in the same call are plain (documented in docs/gate.md).
GUARD_HOLD_LIMIT = 2 * 1024 ** 3


def guard_bytes_for(nbytes: int) -> int:
    return max(_GUARD_MIN, min(_GUARD_MAX, (nbytes // 4 + 511) // 512 * 512))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class GuardedTensor:
    """One input tensor in a private storage with canaries around its logical elements."""

    def __init__(self, value: torch.Tensor, device: torch.device) -> None:
        item = value.element_size()
        self.offset, self.extent = value.storage_offset(), storage_extent(value)
        self.used = (self.offset + self.extent) * item
        self.guard = guard_bytes_for(self.used)
        self.base = torch.full((self.used + self.guard,), CANARY_BYTE, dtype=torch.uint8, device=device)
        region = self.base[: self.used].view(value.dtype)
        self.tensor = torch.as_strided(region, value.shape, value.stride(), self.offset)
        write_values(self.tensor, value)
        self.overlapping = overlaps(value)
        self.snapshot: torch.Tensor | None = None
        self.view_before: torch.Tensor | None = None

    def refresh(self, value: torch.Tensor) -> None:
        """Write another input set's values into the same storage (same pointers, new values)."""
        write_values(self.tensor, value)

    def arm(self) -> None:
        """Remember the current bytes (call right before the module runs)."""
        self.snapshot = self.base.clone()
        self.view_before = None if self.overlapping else self.tensor.clone()

    def changes(self) -> tuple[bool, bool]:
        """``(logical elements changed, bytes outside the logical elements changed)`` since :meth:`arm`."""
        assert self.snapshot is not None
        if torch.equal(self.base, self.snapshot):
            return False, False
        item = self.tensor.element_size()
        if self.view_before is None:  # overlapping layout: judge by the reachable byte range
            lo, hi = self.offset * item, self.used
            in_view = not torch.equal(self.base[lo:hi], self.snapshot[lo:hi])
            probe = self.base.clone()
            probe[lo:hi] = self.snapshot[lo:hi]
            return in_view, not torch.equal(probe, self.snapshot)
        in_view = not _bit_equal(self.tensor, self.view_before)
        probe = self.base.clone()
        torch.as_strided(probe[: self.used].view(self.tensor.dtype), self.tensor.shape, self.tensor.stride(),
                         self.offset).copy_(self.view_before)
        return in_view, not torch.equal(probe, self.snapshot)


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(bits(a), bits(b)))


class InputSet:
    """The wrapper's argument list built from one loaded input file, with guards when asked."""

    def __init__(self, values: list[Any], device: torch.device, guarded: bool) -> None:
        self.guarded = guarded
        self.entries: list[GuardedTensor | None] = []
        self.values: list[Any] = []
        for value in values:
            if isinstance(value, torch.Tensor) and guarded:
                entry = GuardedTensor(value, device)
                self.entries.append(entry)
                self.values.append(entry.tensor)
            elif isinstance(value, torch.Tensor):
                self.entries.append(None)
                self.values.append(clone_layout(value, device))
            else:
                self.entries.append(None)
                self.values.append(value)

    def refresh(self, values: list[Any]) -> None:
        """Overwrite every tensor in place with ``values`` (same layouts): pointers stay, values change."""
        for i, value in enumerate(values):
            if isinstance(value, torch.Tensor):
                write_values(self.values[i], value)
            else:
                self.values[i] = value

    def arm(self) -> None:
        for entry in self.entries:
            if entry is not None:
                entry.arm()

    def changes(self) -> list[dict[str, Any]]:
        found = []
        for i, entry in enumerate(self.entries):
            if entry is None:
                continue
            in_view, outside = entry.changes()
            if in_view or outside:
                found.append({"index": i, "in_view": in_view, "outside_view": outside})
        return found

    def args(self) -> list[Any]:
        return list(self.values)


class GuardedAllocator:
    """Replacement allocation helpers for a loaded wrapper module during correctness checks."""

    NAMES = ("empty_strided_cpu", "empty_strided_cuda", "empty_strided")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.poison = 0xFF
        self.records: list[tuple[torch.Tensor, int, tuple[int, ...], str]] = []
        self.held = 0

    def install(self, namespace: dict[str, Any]) -> dict[str, Any]:
        """Swap the helpers in ``namespace``; returns the originals for :meth:`uninstall`."""
        saved = {}
        for name in self.NAMES:
            if name in namespace:
                saved[name] = namespace[name]
                namespace[name] = self._make(name, namespace[name])
        return saved

    @staticmethod
    def uninstall(namespace: dict[str, Any], saved: dict[str, Any]) -> None:
        namespace.update(saved)

    def reset(self, poison: int) -> None:
        self.poison = poison
        self.records.clear()
        self.held = 0

    def _make(self, name: str, original: Any) -> Any:
        def allocate(size: Any, stride: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            dtype = kwargs.get("dtype", args[0] if args else None)
            device = kwargs.get("device")
            if name == "empty_strided_cuda":
                device = self.device
            elif name == "empty_strided_cpu":
                device = torch.device("cpu")
            if dtype is None or device is None or torch.device(device) != self.device:
                return original(size, stride, *args, **kwargs)
            size_t, stride_t = tuple(int(s) for s in size), tuple(int(s) for s in stride)
            probe = torch.empty((), dtype=dtype)
            item = probe.element_size()
            extent = 0 if 0 in size_t else 1 + sum((s - 1) * st for s, st in zip(size_t, stride_t))
            nbytes = extent * item
            guard = guard_bytes_for(nbytes)
            if self.held + nbytes + guard > GUARD_HOLD_LIMIT:
                return original(size, stride, *args, **kwargs)
            base = torch.empty(nbytes + guard, dtype=torch.uint8, device=self.device)
            base[:nbytes].fill_(self.poison)
            base[nbytes:].fill_(CANARY_BYTE)
            region = base[:nbytes].view(dtype) if nbytes else torch.empty(0, dtype=dtype, device=self.device)
            tensor = torch.as_strided(region, size_t, stride_t, 0)
            self.records.append((base[nbytes:], base.data_ptr(), size_t, str(dtype)))
            self.held += nbytes + guard
            return tensor

        allocate.__name__ = f"guarded_{name}"
        return allocate

    def own_refs(self, data_ptr: int) -> list[int]:
        """The TensorImpls (``_cdata``) through which this allocator holds the buffer at ``data_ptr``: each
        record's guard tail and its ``_base`` chain (:func:`tilesmith.gate.retained.call_measured`)."""
        found = []
        for tail, ptr, _, _ in self.records:
            t = tail if ptr == data_ptr else None
            while t is not None:
                found.append(t._cdata)
                t = t._base
        return found

    def violations(self, outputs: list[Any]) -> list[dict[str, Any]]:
        """Guarded buffers whose tail changed, with the output index when an output lives in one."""
        found = []
        for number, (tail, base_ptr, size, dtype) in enumerate(self.records):
            if bool((tail != CANARY_BYTE).any()):
                owner = None
                for j, out in enumerate(outputs):
                    if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() == base_ptr:
                        owner = j
                        break
                found.append({"allocation": number, "shape": list(size), "dtype": dtype, "output_index": owner})
        return found


def poison_allocator(device: torch.device, sizes: list[int], byte: int, budget: int | None = None) -> None:
    """Refill the memory that fresh allocations will get with ``byte``.

    CUDA: release every unused cached block (``empty_cache``), then allocate, fill and free blocks of
    each expected output size (four times) plus one large block, so the caching allocator's free lists hold
    only poisoned memory. CPU: the same sizes through malloc (best effort: glibc may return fresh
    zeroed pages for large sizes, which is also not the reference's data). ``budget`` (bytes, from the host's
    memory plan) caps the blocks: fewer copies of large outputs, a smaller large block.
    """
    blocks = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    total = 0
    limit = budget if budget is not None and budget > 0 else 1 << 62
    for n in sizes:
        for _ in range(4):
            if total + int(n) > limit and blocks:
                break
            blocks.append(torch.full((max(int(n), 1),), byte, dtype=torch.uint8, device=device))
            total += int(n)
    if device.type == "cuda":
        large = min(max(64 * 1024 * 1024, 2 * total), max(0, limit - total))
        if large > 0:
            blocks.append(torch.full((large,), byte, dtype=torch.uint8, device=device))
    del blocks
    sync(device)


def memory_facts(device: torch.device) -> dict[str, int]:
    """Device memory as this process sees it (bytes): ``free`` and ``total`` of the device, what this process's
    caching allocator has ``allocated`` and ``reserved``. CPU (test mode): ``MemAvailable``/``MemTotal`` of
    ``/proc/meminfo`` and this process's resident set size."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return {"free": int(free), "total": int(total), "allocated": int(torch.cuda.memory_allocated(device)),
                "reserved": int(torch.cuda.memory_reserved(device))}
    info = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                name, value = line.split(":", 1)
                info[name] = int(value.split()[0]) * 1024
        with open("/proc/self/statm", encoding="ascii") as handle:
            rss = int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return {}
    return {"free": info.get("MemAvailable", 0), "total": info.get("MemTotal", 0), "allocated": rss, "reserved": rss}


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def allocated(device: torch.device) -> int:
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0


def peak(device: torch.device) -> int:
    """Peak bytes allocated since :func:`reset_peak` (CUDA; 0 on the CPU, where the host plans with sizes)."""
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0


def rng_digest(device: torch.device) -> str:
    """SHA-256 prefix of the CPU (and CUDA) generator states."""
    h = hashlib.sha256(bytes(torch.get_rng_state().tolist()))  # uint8 states; no numpy (not a dependency)
    if device.type == "cuda":
        h.update(bytes(torch.cuda.get_rng_state(device).tolist()))
    return h.hexdigest()[:16]


def storage_ptrs(outputs: Any) -> set[int]:
    """Storage addresses of the (non-empty, plain) tensors in ``outputs``."""
    if not isinstance(outputs, (tuple, list)):
        return set()
    return {o.untyped_storage().data_ptr() for o in outputs
            if type(o) is torch.Tensor and o.numel()}


def input_aliased(outputs: Any, inputs: list[Any]) -> set[int]:
    """Indices of outputs that live in an input's storage (returned inputs, views of inputs)."""
    ptrs = storage_ptrs(inputs)
    if not isinstance(outputs, (tuple, list)):
        return set()
    return {i for i, o in enumerate(outputs)
            if type(o) is torch.Tensor and o.numel() and o.untyped_storage().data_ptr() in ptrs}


def snapshot_outputs(outputs: Any, max_bytes: int = 1 << 62) -> list[torch.Tensor | None]:
    """Clone tensor outputs on the current stream right after return (before any synchronization).

    Outputs larger than ``max_bytes`` (far beyond what the original returns) are not cloned: they are
    rejected by their shape anyway and must not cost the worker memory.
    """
    if not isinstance(outputs, (tuple, list)):
        return []
    return [o.clone() if type(o) is torch.Tensor and o.numel() * o.element_size() <= max_bytes else None
            for o in outputs]


def changed_since(outputs: Any, snaps: list[torch.Tensor | None], skip: set[int] = frozenset()) -> list[int]:
    """Outputs whose bits differ from their snapshot (``skip``: indices not to judge)."""
    changed = []
    for i, (o, s) in enumerate(zip(outputs, snaps)):
        if i in skip:
            continue
        if s is not None and type(o) is torch.Tensor and not torch.equal(bits(o), bits(s)):
            changed.append(i)
    return changed
