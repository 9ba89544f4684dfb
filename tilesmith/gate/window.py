"""Process-global state read just before and just after code that only Tilesmith runs in between.

Shared (torch and the standard library only): production verification (:mod:`tilesmith.install.verify`) opens a
:class:`StateWindow` before an installed wrapper's import and before the wrapper runs on a checked call, and
reads it right after. Nothing but the wrapper runs inside such a window (the user's code cannot), so any change
is the wrapper's, whatever the user's own code does between calls — unlike the baseline comparison of
:class:`tilesmith.gate.sidefx.ProductionSnapshot`, which must leave out the settings users change on purpose.

What a window reads (:func:`window_values`):

- :func:`tilesmith.gate.torchstate.state_snapshot`: the numeric flags (default dtype, float32 matmul precision,
  TF32, deterministic algorithms, SDPA backends, thread count), grad and inference mode, allocator environment,
  CUDA current stream, trace/profile hooks;
- :func:`tilesmith.gate.sidefx.getter_values` (interpreter getters such as the working directory and the
  switch interval, and Inductor's, Dynamo's and functorch's configuration overrides) and the denormal probe;
- :func:`rng_digests`: Python's ``random`` and numpy's global generator. The gate compares torch's generators
  only; the red team of 2026-12-05 installed a wrapper that reseeded both on every call (docs/gate.md, "Threat
  model").

- the thread's mode stacks, autocast and saved-tensors hooks (:mod:`tilesmith.gate.modes`, through
  ``state_snapshot``) and the process's hook tables (:func:`tilesmith.gate.hooktables.hook_values`: warning
  hooks and filters, ``sys`` hooks, exit callbacks, signal handlers, logging handlers, torch's hook dicts).

On a change, :meth:`StateWindow.restore` puts back what has a setter (the numeric flags through
:func:`tilesmith.gate.torchstate.apply_flags`, the two generators' states, flush-to-zero on this thread, modes
pushed since the opening, the callable interpreter hooks); the caller reports the change and uninstalls the
wrapper. Cost: docs/verification.md ("Cost").
"""

from __future__ import annotations

import hashlib
import random
import sys
from typing import Any

import torch

from tilesmith.gate import hooktables, modes, torchstate
from tilesmith.gate.sidefx import change_lines, getter_values, hook_changes, probe_denormals


def _numpy_random() -> Any:
    np = sys.modules.get("numpy")  # only when the user's program imported it: never imported here
    return getattr(np, "random", None)


def rng_digests() -> dict[str, str]:
    """``{"rng.python_random": <hex>, "rng.numpy_random": <hex>}``: BLAKE2b digests (16 bytes) of Python's
    ``random`` module state and, when numpy is imported, of ``numpy.random``'s global (legacy) generator state."""
    out = {"rng.python_random": hashlib.blake2b(repr(random.getstate()).encode(), digest_size=16).hexdigest()}
    get_state = getattr(_numpy_random(), "get_state", None)
    if get_state is not None:
        try:
            name, keys, pos, has_gauss, cached = get_state()[:5]
            digest = hashlib.blake2b(keys.tobytes(), digest_size=16)
            digest.update(repr((name, pos, has_gauss, cached)).encode())
            out["rng.numpy_random"] = digest.hexdigest()
        except Exception:  # noqa: BLE001 - an unusual numpy: leave that generator out
            pass
    return out


def window_values(device: str) -> dict[str, Any]:
    """Everything a :class:`StateWindow` compares by value (module docstring), as ``{name: value}``."""
    return {**torchstate.state_snapshot(device), **getter_values(), **probe_denormals(), **rng_digests()}


class StateWindow:
    """Open (read everything) at construction; :meth:`changes` reads again and lists what differs.

    ``device``: the graph's device (``"cpu"``, ``"cuda:0"``), for the CUDA stream and allocator entries;
    ``containers``: torch's module-level hook tables to compare too (``ClassDigest.containers`` of the graph's
    :class:`~tilesmith.gate.sidefx.ProductionSnapshot`; ``None``: none)."""

    def __init__(self, device: str, containers: dict[str, Any] | None = None):
        self.device = device
        self.containers = containers or {}
        self.python_random = random.getstate()
        get_state = getattr(_numpy_random(), "get_state", None)
        self.numpy_random = get_state() if get_state is not None else None
        self.stacks = modes.capture()
        self.hooks = hooktables.hook_values(signals=True, containers=self.containers)
        self.before = window_values(device)

    def changes(self) -> list[str]:
        """``["default_dtype: 'torch.float32' → 'torch.float64'", ...]``: what differs from the window's opening."""
        lines = change_lines(torchstate.diff_state(self.before, window_values(self.device)))
        now = hooktables.hook_values(signals=True, containers=self.containers)
        return lines + change_lines(hook_changes(self.hooks, now))

    def restore(self) -> list[str]:
        """Put back the numeric flags, both generators' states, the interpreter's callable hooks
        (:data:`tilesmith.gate.hooktables.CALLABLE_HOOKS`) and the mode stacks (modes pushed since the opening are
        popped: :func:`tilesmith.gate.modes.pop_new`); returns the names that could not be set (a mode the wrapper
        removed, the hook tables with entries: reported, not restored)."""
        failed = [line for line in modes.pop_new(self.stacks) if line.endswith("(not restored)")]
        for name in hooktables.CALLABLE_HOOKS:
            old = self.hooks.get(name)
            module, _, attr = name.partition(".")
            owner = sys.modules.get(module)
            if isinstance(old, hooktables.Ident) and owner is not None and getattr(owner, attr, None) is not old.obj:
                setattr(owner, attr, old.obj)
        failed += torchstate.apply_flags(self.before)  # reads only the numeric flags' keys
        if self.before.get("probe.denormal_float32_torch") == "kept" and \
                probe_denormals()["probe.denormal_float32_torch"] == "flushed":
            torch.set_flush_denormal(False)
        random.setstate(self.python_random)
        set_state = getattr(_numpy_random(), "set_state", None)
        if self.numpy_random is not None and set_state is not None:
            try:
                set_state(self.numpy_random)
            except Exception:  # noqa: BLE001
                failed.append("rng.numpy_random")
        return failed
