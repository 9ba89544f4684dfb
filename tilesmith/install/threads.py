"""OS thread census of the user's process, for production verification (:mod:`tilesmith.install.verify`).

The census reads the kernel's list of the process's threads (``/proc/self/task``, Linux), not Python's: a thread
started through ``_thread`` or from native code is invisible to ``threading.enumerate()`` but not to the kernel.
The baseline is taken at install, just before the accepted wrapper is imported into the user's process, after
the intra-op (OpenMP) pool has been brought to its full size (:func:`warm_intra_op_pool`), so that pool threads
the user's own CPU work would start later are already counted.

A thread that appears after install is *explained* (and added to the baseline) when

- it is a ``threading.Thread`` whose target and current stack are code of some module other than
  ``threading`` and the installed wrapper (a library's or the user's own Python thread: Inductor's compile pool,
  a data loader's pin-memory thread, Tilesmith's own clock), or
- it is unknown to Python and its OS name (``/proc/self/task/<tid>/comm``) was set by whoever created it: a
  name no thread had at install and no other thread has now (a new thread inherits its creator's name unless it
  sets one, so a helper thread started from the main thread or from an autograd thread shares that thread's
  name), or
- it is unknown to Python and carries the name of PyTorch's autograd engine threads, ``pt_autograd_<index>``
  (``torch/csrc/autograd/engine.cpp``, ``Engine::thread_init``). The engine starts them at the first backward
  that uses an accelerator, one per device index *for every device type it knows*, so several threads share one
  such name (seen on the H200, torch 2.11: four ``pt_autograd_0`` threads at the first CUDA backward after
  install, which the unique-name rule took for inherited names and uninstalled a training step's graphs).

Everything else is reported: a Python thread that runs code of the installed wrapper, one that runs nothing
identifiable (e.g. ``threading.Thread(target=time.sleep)``), and an unnamed native or ``_thread`` thread.
Limits (docs/verification.md): a thread that has already exited is not seen; a thread running library code
with no frame from the wrapper is taken for a library's; a native thread that names itself (``pt_autograd_<n>``
included) is taken for a runtime's; OpenMP threads added later by the user (``torch.set_num_threads`` raised) are
reported.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections import Counter
from typing import Any

_TASKS = "/proc/self/task"
_AUTOGRAD = re.compile(r"pt_autograd_\d+")


def os_threads() -> dict[int, str]:
    """``{thread id: OS name}`` of every thread of this process; ``{}`` where ``/proc`` is unavailable."""
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return {}
    out: dict[int, str] = {}
    for name in tids:
        try:
            with open(f"{_TASKS}/{name}/comm", encoding="utf-8", errors="replace") as fh:
                out[int(name)] = fh.read().strip()
        except (OSError, ValueError):
            continue  # exited while listing
    return out


def warm_intra_op_pool() -> None:
    """Run one elementwise op large enough to use every intra-op thread, so the pool is at full size.

    ATen splits elementwise loops in chunks of ``at::internal::GRAIN_SIZE`` = 32768 elements
    (aten/src/ATen/Parallel.h); ``2 × 32768 × torch.get_num_threads()`` float32 elements use all threads. Costs
    one allocation of that size (4 MiB at 16 threads) once per install; never raises.
    """
    try:
        import torch

        n = 2 * 32768 * max(1, int(torch.get_num_threads()))
        torch.empty(n, dtype=torch.float32).fill_(1.0)
    except Exception:  # noqa: BLE001 - best effort; the census then may report pool threads started later
        pass


class ThreadCensus:
    """Threads of this process at install, and the check of the threads that appeared since.

    ``own``: native ids of threads Tilesmith itself started (always explained). ``available`` is False where the
    OS does not list threads (then :meth:`unexplained` always returns ``[]``).
    """

    def __init__(self, own: tuple[int, ...] = ()):
        self.baseline = os_threads()
        self.baseline_names = set(self.baseline.values())
        self.explained: set[int] = set(own)
        self.available = bool(self.baseline)

    def unexplained(self, wrapper_files: tuple[str, ...]) -> list[str]:
        """One line per thread started since install that no rule explains (see the module text).

        ``wrapper_files``: the installed wrapper module's file(s); frames from them attribute a thread to it.
        """
        if not self.available:
            return []
        try:
            listed = [int(t) for t in os.listdir(_TASKS)]
        except (OSError, ValueError):
            return []
        if all(tid in self.baseline or tid in self.explained for tid in listed):
            return []  # the common case: one listdir, no file reads
        now = os_threads()
        fresh = [tid for tid in now if tid not in self.baseline and tid not in self.explained]
        if not fresh:
            return []
        python = {t.native_id: t for t in threading.enumerate() if getattr(t, "native_id", None)}
        frames = sys._current_frames()
        names = Counter(now.values())
        out = []
        for tid in sorted(fresh):
            why = _why(tid, now[tid], python.get(tid), frames, set(wrapper_files), names, self.baseline_names)
            if why is None:
                self.explained.add(tid)
            else:
                out.append(why)
        return out


def _files(frame: Any) -> list[str]:
    files = []
    while frame is not None:
        files.append(frame.f_code.co_filename)
        frame = frame.f_back
    return files


def _why(tid: int, comm: str, thread: threading.Thread | None, frames: dict[int, Any], wrapper: set[str],
         names: Counter, baseline_names: set[str]) -> str | None:
    """``None`` when thread ``tid`` is explained, else why it is not."""
    if thread is not None:
        files = _files(frames.get(thread.ident)) if thread.ident is not None else []
        target = getattr(thread, "_target", None) or getattr(thread, "function", None)  # threading.Timer's
        target_file = getattr(getattr(target, "__code__", None), "co_filename", None)
        if target_file is not None:
            files.append(target_file)
        if wrapper.intersection(files):
            return f"thread {tid} ({thread.name!r}) runs code of the installed wrapper"
        others = [f for f in files if f != threading.__file__]
        if not others:
            shown = getattr(target, "__qualname__", None) or type(target).__name__
            return (f"thread {tid} ({thread.name!r}, target {shown}) started after install runs no code that "
                    f"identifies its owner")
        return None
    if names[comm] == 1 and comm not in baseline_names:
        return None
    if _AUTOGRAD.fullmatch(comm):
        return None
    return (f"thread {tid} (OS name {comm!r}) started after install is unknown to Python's threading module and "
            f"carries an inherited name")
