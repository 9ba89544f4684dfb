"""What the worker's own code calls while candidate code is loaded, bound once at import (before any candidate).

:data:`T` holds the clocks, events, synchronize, ``torch.save``/``torch.load``, the thread listing, the
seeding function, ``torch.no_grad``, ``os.write`` (the protocol's answers) and ``torch.cuda.mem_get_info``;
:mod:`.core`, :mod:`.timing` and :mod:`.reference` read them from here only, so a candidate that replaces
``time.perf_counter_ns`` or ``torch.cuda.Event.elapsed_time`` changes nothing the worker measures (and the
identity check, which watches this module's namespace, reports the replacement). :func:`compact_cpu` (used by
all three) and :func:`against_expected` (by :mod:`.core` and :mod:`.timing`) are the output helpers used before
a tensor leaves the worker.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from types import SimpleNamespace
from typing import Any

import torch

from tilesmith.gate.layout import plain_sequence

T = SimpleNamespace(
    perf_ns=time.perf_counter_ns,
    cpu_ns=functools.partial(time.clock_gettime_ns, time.CLOCK_PROCESS_CPUTIME_ID),
    save=torch.save,
    load=torch.load,
    threads=threading.enumerate,
    write=os.write,
    cuda_sync=torch.cuda.synchronize,
    Event=torch.cuda.Event,
    event_record=torch.cuda.Event.record,
    event_sync=torch.cuda.Event.synchronize,
    elapsed=torch.cuda.Event.elapsed_time,
    manual_seed=torch.manual_seed,
    no_grad=torch.no_grad,
    mem_get_info=torch.cuda.mem_get_info,
    open=os.open,
    close=os.close,
)


#: A new file or nothing: never through a link, never an existing file (the ``O_`` flags are Linux's and macOS's).
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def save_new(obj: Any, path: str) -> None:
    """``torch.save(obj)`` into a file this call creates at ``path`` (mode 0600).

    The host names the worker's output files in its private folder, where candidate code may create files: red
    team 18's candidate made ``spots_<pid>.pt`` a symbolic link to a file outside the folder, and the worker's own
    save followed it and overwrote that file. Here the file is created with ``O_CREAT | O_EXCL | O_NOFOLLOW``, so
    anything already at ``path`` (a link, a file, a FIFO) makes the save fail, and the save writes through the
    descriptor (``/proc/self/fd/N``: torch's own file writer, no path lookup a thread could race).

    Raises:
        OSError: ``path`` exists (``FileExistsError``) or cannot be created."""
    fd = T.open(path, _NEW_FILE, 0o600)
    try:
        via_fd = f"/proc/self/fd/{fd}"
        if os.path.exists(via_fd):
            T.save(obj, via_fd)
        else:  # no /proc: the file object (Python-level writes)
            with os.fdopen(os.dup(fd), "wb") as handle:
                T.save(obj, handle)
    finally:
        T.close(fd)


#: Device tensors of at least this many bytes are copied to the host through page-locked memory.
PINNED_COPY_BYTES = 1 << 20


def compact_cpu(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy that owns exactly its elements (``torch.save`` writes whole storages, and a
    guarded buffer's storage includes its guard tail).

    CUDA tensors of :data:`PINNED_COPY_BYTES` or more go through page-locked host memory (PyTorch's caching host
    allocator keeps the blocks for the next copy): on the H200, a 256 MiB device-to-host copy into fresh pageable
    memory took 0.205 s (1.3 GB/s, first-touch page faults), a pinned one runs at the PCIe/C2C rate."""
    t = t.detach()
    if t.device.type == "cuda" and t.numel() * t.element_size() >= PINNED_COPY_BYTES:
        try:
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        except RuntimeError:  # no page-locked memory left: the plain copy below
            pass
        else:
            out.copy_(t)
            return out
    return t.to("cpu", copy=True).contiguous()


def fast_saves() -> None:
    """Turn off ``torch.save``'s CRC-32 of every record in this process (``torch.utils.serialization.config``;
    a no-op on a torch without it). The host never checks it (``torch.load`` does not, and a worker's file is
    untrusted whatever its checksum says) and computing it dominated the saves: 0.54 s of a 256 MiB save on the
    H200 (2026-12-04), 0.69 s vs 0.07 s on a CI machine. Called once at the worker's start, before the
    baselines of global state are taken, so a candidate sees it as part of the worker it was given."""
    try:
        from torch.utils.serialization import config
    except ImportError:
        return
    save = getattr(config, "save", None)
    if save is not None and hasattr(save, "compute_crc32"):
        save.compute_crc32 = False


def not_plain(outs: Any) -> str | None:
    """Why ``outs`` is not what a wrapper's ``call`` returns, exactly a ``tuple`` or ``list``
    (:func:`tilesmith.gate.layout.plain_sequence`), or ``None``. Looks at the type only: runs none of its code."""
    if plain_sequence(outs) is None:
        return f"the wrapper returned {type(outs).__module__}.{type(outs).__qualname__}, not a tuple or list"
    return None


def against_expected(outs: Any, expected: list[dict[str, Any]]) -> str | None:
    """Why ``outs`` cannot be the original's outputs (count, types, shapes, dtypes), or ``None``."""
    problem = not_plain(outs)
    if problem:
        return problem
    outs = list(outs)
    if len(outs) != len(expected):
        return f"{len(outs)} outputs, expected {len(expected)}"
    for i, (o, e) in enumerate(zip(outs, expected)):
        if e.get("kind") != "tensor":
            continue
        if type(o) is not torch.Tensor:
            return f"output {i} is {type(o).__module__}.{type(o).__qualname__}, expected torch.Tensor"
        if list(o.shape) != list(e["shape"]) or str(o.dtype) != e["dtype"]:
            return f"output {i} is {list(o.shape)} {o.dtype}, expected {e['shape']} {e['dtype']}"
    return None
