"""Side effects by structure (issue 15, item 3): what a candidate's import and calls left behind in the worker.

Shared (standard library and torch only, no host or worker import): the gate worker uses :class:`SideEffects`
for every candidate, and production verification (:mod:`tilesmith.install.verify`) re-checks the cheap part of the
same snapshot in the user's process (:class:`ProductionSnapshot`). In the worker :class:`SideEffects` takes its baseline after the
worker's own set-up and before any candidate code is imported (with the other baselines of
:meth:`tilesmith.gate.worker.core.Worker._take_baselines`) and reports, after every candidate import and call,
facts only (the host turns them into failures in :mod:`tilesmith.gate.host.answers`):

- **Attribute identities** (``identity_changes``, check ``monkeypatch``): *every* attribute, not only the
  callables, of the namespaces the original wrapper uses (its imports, the objects it imports from them such as
  ``extern_kernels``, the ``torch.ops`` namespaces it calls: :func:`tilesmith.gate.torchstate.wrapper_namespaces`,
  computed by the host from the original's source) plus :data:`FIXED` (every ``torch.backends.*`` module,
  Inductor's runtime modules, ``sys``). An attribute counts as changed when the object bound to it is not the
  same object as at the baseline. Not counted (:func:`_same`): an equal immutable scalar rebound (``x = 5``
  again), ``None`` replaced by a non-callable value (lazy initialisation: ``tempfile.tempdir``), attributes
  added after the baseline (lazy imports, ``torch.ops`` overload packets resolved on first use).
- **Values** (``state_changes``, check ``global_state``): the readable value of every public scalar attribute of
  the ``torch.backends.*`` modules and their sub-objects (``torch.backends.mkldnn.enabled``,
  ``torch.backends.cuda.matmul.allow_tf32``: properties, invisible to an identity snapshot), Inductor's and
  Dynamo's configuration (``get_config_copy()``), a few interpreter settings with getters
  (:data:`_GETTERS`), and ``sys.path``, ``sys.meta_path``, ``sys.path_hooks`` element by element.
- **Every torch/Triton class** (``identity_changes``): the ``__dict__`` of every class bound at module level in a
  loaded ``torch.*``/``triton.*`` module or in a watched namespace (:mod:`tilesmith.gate.classdigest`: a replaced
  ``torch.nn.Linear.forward`` however the class was reached).
- **Hook tables** (``state_changes``, ``"hook ..."`` keys): ``warnings.showwarning``, the warning filters,
  ``sys.excepthook`` and the other interpreter hooks, exit callbacks, ``gc.callbacks``, ``copyreg``, the logging
  handlers of torch's loggers, torch's module-level hook dicts (:mod:`tilesmith.gate.hooktables`). The mode stacks,
  autocast and the saved-tensors hooks are in :func:`tilesmith.gate.torchstate.state_snapshot`
  (:mod:`tilesmith.gate.modes`).
- **Behavioural probes** (``state_changes``) of state without a getter: flush-to-zero / denormals-are-zero
  (``torch.set_flush_denormal``; :func:`probe_denormals` multiplies a float32 denormal by 1.0 in torch and a
  float64 denormal in Python on the calling thread: the mode is per thread, and the wrapper runs on this one).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from tilesmith.gate import hooktables
from tilesmith.gate.classdigest import ClassDigest

#: Namespaces watched in every worker, whatever the original imports (looked up in ``sys.modules`` first, then
#: as attributes of their parent; absent ones are not watched). ``torch.backends.*`` is added by prefix.
FIXED = ("sys", "torch", "torch.ops", "torch._inductor.select_algorithm", "torch._inductor.select_algorithm.extern_kernels",
         "torch._inductor.async_compile", "torch._inductor.codecache", "torch._inductor.cpp_builder",
         "torch._inductor.cpu_vec_isa", "torch._inductor.utils", "torch._inductor.runtime.triton_heuristics",
         "torch._inductor.runtime.benchmarking", "torch._inductor.runtime.triton_helpers",
         "torch._inductor.runtime.compile_tasks", "torch._inductor.runtime.autotune_cache",
         "torch._inductor.runtime.static_cuda_launcher", "torch.ops.aten", "torch.ops.inductor", "torch.ops.prims",
         "torch._C._dynamo.guards")

#: ``(namespace, attribute)`` pairs that the libraries rebind under honest code: never counted. Sources (torch 2.11):
#: ``async_compile._compile_start``/``_compile_end`` rebind their compile-time counters around every kernel
#: compilation (``global _t0, _cumulative_compile_time, _triton_kernel_metrics``); ``sys.last_*`` are set by
#: an uncaught exception's report.
IGNORED = frozenset({
    ("sys", "last_exc"), ("sys", "last_type"), ("sys", "last_value"), ("sys", "last_traceback"),
    ("torch._inductor.async_compile", "_t0"), ("torch._inductor.async_compile", "_cumulative_compile_time"),
    ("torch._inductor.async_compile", "_triton_kernel_metrics"),
})

_SCALARS = (bool, int, float, complex, str, bytes, type(None))

#: Interpreter and torch settings read through their getters (``name: getter``).
_GETTERS: dict[str, Any] = {
    "sys.getswitchinterval()": sys.getswitchinterval,
    "sys.getrecursionlimit()": sys.getrecursionlimit,
    "sys.getdlopenflags()": getattr(sys, "getdlopenflags", lambda: None),
    "threading.stack_size()": threading.stack_size,
    "os.getcwd()": os.getcwd,
    "torch.is_anomaly_enabled()": torch.is_anomaly_enabled,
    "torch.get_num_interop_threads()": torch.get_num_interop_threads,
    "torch.is_warn_always_enabled()": torch.is_warn_always_enabled,
    "torch.get_default_device()": lambda: str(torch.get_default_device()),
    "torch.is_autocast_enabled(cpu)": lambda: torch.is_autocast_enabled("cpu"),
    "torch.is_autocast_enabled(cuda)": lambda: torch.is_autocast_enabled("cuda"),
}

_DENORMAL32, _DENORMAL64, _ONE = 1e-39, 1e-310, 1.0

_CONFIGS = ("torch._inductor.config", "torch._dynamo.config", "torch._functorch.config")


def _resolve(name: str) -> Any:
    """The object ``name`` names: a module in ``sys.modules``, else an attribute of its parent (``extern_kernels``,
    ``torch.ops.aten``); ``None`` when neither exists. Nothing is imported."""
    module = sys.modules.get(name)
    if module is not None:
        return module
    parent, _, leaf = name.rpartition(".")
    if not parent:
        return None
    owner = _resolve(parent)
    if owner is None:
        return None
    if type(owner).__name__ == "_Ops" and leaf not in vars(owner):
        return None  # torch.ops makes a namespace for any name: watch only those already made
    try:
        return getattr(owner, leaf, None)
    except Exception:  # noqa: BLE001
        return None


def _namespace(obj: Any) -> dict[str, Any] | None:
    """The attribute dict of a module or a namespace object (``KernelNamespace``, ``_OpNamespace``); ``None``
    for functions, classes (watched elsewhere) and objects without a ``__dict__``."""
    if obj is None or isinstance(obj, type) or callable(obj) and not isinstance(obj, type(sys)):
        return None
    try:
        return vars(obj)
    except TypeError:
        return None


def _same(before: Any, now: Any) -> bool:
    if now is before:
        return True
    if type(before) in _SCALARS and type(now) is type(before) and now == before:
        return True
    return before is None and not callable(now)


def _value(obj: Any, attr: str) -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            value = getattr(obj, attr)
    except Exception as exc:  # noqa: BLE001 - a legacy getter refuses once the new API was used
        return f"<unreadable: {type(exc).__name__}>"
    return value


def backend_values() -> dict[str, Any]:
    """``{"torch.backends.mkldnn.enabled": True, "torch.backends.cuda.matmul.allow_tf32": False, ...}``: every
    public scalar attribute of every imported ``torch.backends.*`` module and of its public sub-objects (one
    level: ``cuda.matmul``, ``cudnn.conv``), read through ``getattr`` so properties count."""
    values: dict[str, Any] = {}
    for name in sorted(n for n in list(sys.modules) if n.startswith("torch.backends.")):
        module = sys.modules.get(name)
        if module is None:
            continue
        for attr in sorted(set(dir(module)) | set(dir(type(module)))):  # PropModule: properties on its class
            if attr.startswith("_"):
                continue
            value = _value(module, attr)
            if isinstance(value, _SCALARS):
                values[f"{name}.{attr}"] = value
            elif not callable(value) and not isinstance(value, type(sys)) and \
                    type(value).__module__.startswith("torch.backends"):
                for sub in sorted(set(dir(value)) | set(dir(type(value)))):
                    if not sub.startswith("_"):
                        inner = _value(value, sub)
                        if isinstance(inner, _SCALARS):
                            values[f"{name}.{attr}.{sub}"] = inner
    return values


def probe_denormals() -> dict[str, str]:
    """Flush-to-zero / denormals-are-zero on this thread, by behaviour (``torch.set_flush_denormal`` has no
    getter): a float32 denormal (1e-39) times 1.0 in torch on the CPU, and a float64 denormal (1e-310) times 1.0
    in Python. Each is ``"kept"`` normally and ``"flushed"`` when the mode is on."""
    tensor = torch.tensor([_DENORMAL32], dtype=torch.float32) * _ONE
    product = _DENORMAL64 * _ONE  # module variables: a constant expression would be folded at compile time
    return {"probe.denormal_float32_torch": "kept" if float(tensor[0]) != 0.0 else "flushed",
            "probe.denormal_float64_python": "kept" if product != 0.0 else "flushed"}


def getter_values() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, getter in _GETTERS.items():
        try:
            out[name] = getter()
        except Exception as exc:  # noqa: BLE001
            out[name] = f"<unreadable: {type(exc).__name__}>"
    for name in _CONFIGS:
        module = sys.modules.get(name)
        entries = getattr(module, "_config", None)
        if isinstance(entries, dict):  # torch.utils._config_module.ConfigModule: setattr sets user_override
            for key, entry in list(entries.items()):
                out[f"{name}.{key}"] = _Override(getattr(entry, "user_override", None))
            continue
        copy = getattr(module, "get_config_copy", None)
        if copy is None:
            continue
        try:
            config = copy()
        except Exception:  # noqa: BLE001
            continue
        for key, value in config.items():
            out[f"{name}.{key}"] = value if isinstance(value, _SCALARS) else repr(value)[:200]
    return out


class _Override:
    """A configuration entry's override, compared by identity (or equal scalars): no deep copies per snapshot."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Override) and _same(self.value, other.value) and _same(other.value, self.value)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        unset = getattr(sys.modules.get("torch.utils._config_module"), "_UNSET_SENTINEL", None)
        return "<default>" if unset is not None and self.value is unset else repr(self.value)[:200]


def _show(value: Any) -> Any:
    """A value as it travels to the host (JSON: scalars as they are, anything else as a short ``repr``)."""
    return value if isinstance(value, (bool, int, float, str, type(None))) else repr(value)[:200]


class SideEffects:
    """Baseline and diff of the structural facts above (one per worker)."""

    fixed: tuple[str, ...] = FIXED
    """Namespaces watched whatever the wrapper names."""
    sys_lists: tuple[str, ...] = ("path", "meta_path", "path_hooks")
    """``sys`` lists compared element by element."""

    def __init__(self) -> None:
        self.names: tuple[str, ...] = ()
        self.base_attrs: dict[str, tuple[dict[str, Any], Any]] = {}
        self.base_values: dict[str, Any] = {}
        self.base_lists: dict[str, tuple[Any, list[Any]]] = {}
        self.classes = ClassDigest()
        """Every torch/Triton class's ``__dict__`` (:mod:`tilesmith.gate.classdigest`), and the hook-table containers."""
        self.base_hooks: dict[str, Any] = {}
        self.ignore: frozenset[str] = frozenset()
        """Names and keys the trusted original itself changes in its own process (its import, its warm-up calls:
        Triton's and Inductor's lazy runtime state on CUDA, say), sent by the host; an honest candidate changes
        them the same way, so they are not reported (:meth:`effects`)."""

    def effects(self) -> list[str]:
        """Every identity name and state key changed since :meth:`baseline`, unfiltered (the trusted worker's
        report of what loading the original did)."""
        saved, self.ignore = self.ignore, frozenset()
        try:
            return sorted({*self.identity_changes(), *self.state_changes()})
        finally:
            self.ignore = saved

    def baseline(self, wrapper_names: Iterable[str]) -> None:
        """Record everything (call before any candidate import; ``wrapper_names`` from the host)."""
        backends = [n for n in list(sys.modules) if n.startswith("torch.backends")]
        self.names = tuple(dict.fromkeys([*self.fixed, *backends, *wrapper_names]))
        self.base_attrs = {}
        for name in self.names:
            obj = _resolve(name)
            space = _namespace(obj)
            if space is not None:
                self.base_attrs[name] = (dict(space), obj)
        self.classes.baseline((name, space) for name, (space, _) in self.base_attrs.items())
        self.base_hooks = self.hooks()
        self.base_values = self.values()
        self.base_lists = {name: (getattr(sys, name), list(getattr(sys, name))) for name in self.sys_lists}

    @staticmethod
    def values() -> dict[str, Any]:
        return {**backend_values(), **getter_values(), **probe_denormals()}

    def hooks(self) -> dict[str, Any]:
        """The hook tables (:func:`tilesmith.gate.hooktables.hook_values`; signals are the worker's own check)."""
        return hooktables.hook_values(signals=False, containers=self.classes.containers, import_lists=False)

    def identity_changes(self) -> list[str]:
        """``"extern_kernels.mm"``-style names of attributes whose object changed or that disappeared, and of
        watched namespaces that are no longer the same object."""
        changed = []
        for name, (before, obj) in self.base_attrs.items():
            if _resolve(name) is not obj:
                changed.append(f"{name} (the namespace itself)")
                continue
            now = _namespace(obj) or {}
            if type(obj).__name__ == "_OpNamespace":  # packets resolved after the baseline must be genuine
                changed += [f"{name}.{attr} (added: not the operator of that name)" for attr in list(now)
                            if attr not in before and not _genuine_packet(obj, attr, now[attr])]
            for attr, value in before.items():
                if (name, attr) in IGNORED:
                    continue
                if attr not in now:
                    changed.append(f"{name}.{attr} (removed)")
                elif not _same(value, now[attr]):
                    changed.append(f"{name}.{attr}")
        changed += self.classes.changes()
        return sorted(c for c in changed if c not in self.ignore)

    def state_changes(self) -> dict[str, list[Any]]:
        """``{key: [before, after]}`` of the values, probes and import-system lists that changed."""
        now = self.values()
        changes = {k: [_show(self.base_values[k]), _show(now.get(k))] for k in sorted(self.base_values)
                   if not self.base_values[k] == now.get(k)}
        for name, (obj, items) in self.base_lists.items():
            current = getattr(sys, name)
            label = f"sys.{name}"
            if current is not obj:
                changes[f"{label} (the list itself)"] = ["the original list", "another object"]
            added = [_describe(x) for x in current if not any(_same_entry(x, y) for y in items)]
            removed = [_describe(x) for x in items if not any(_same_entry(x, y) for y in current)]
            if added or removed:
                changes[label] = [f"removed {removed}" if removed else "nothing removed",
                                  f"added {added}" if added else "nothing added"]
            elif len(current) != len(items) or not all(map(_same_entry, current, items)):
                changes[f"{label} (order)"] = [[_describe(x) for x in items], [_describe(x) for x in current]]
        changes.update(hook_changes(self.base_hooks, self.hooks()))
        return {k: v for k, v in changes.items() if k not in self.ignore}


def _genuine_packet(namespace: Any, attr: str, value: Any) -> bool:
    """An attribute ``torch.ops.<ns>`` resolved on first use: ``OpOverloadPacket`` ``<ns>::<attr>`` (plain
    attributes such as ``name`` are set when the namespace is made, before any baseline)."""
    if attr.startswith("_") or attr in ("name",):
        return True
    qualified = getattr(value, "_qualified_op_name", None)
    return type(value).__name__ == "OpOverloadPacket" and qualified == f"{getattr(namespace, 'name', '?')}::{attr}"


def _same_entry(a: Any, b: Any) -> bool:
    """``sys.path`` entries are equal strings; finders and hooks are the same objects."""
    return a == b if isinstance(a, str) and isinstance(b, str) else a is b


def _describe(item: Any) -> str:
    if isinstance(item, str):
        return item[:200]
    kind = item if isinstance(item, type) else type(item)
    return f"{getattr(kind, '__module__', '?')}.{getattr(kind, '__qualname__', '?')}"[:200]


#: Namespaces production verification watches whatever the wrapper imports (the operator namespaces a wrapper
#: calls through and the extern kernels). Not :data:`FIXED`'s Inductor modules, whose module state the user's
#: later compilations legitimately change, nor ``sys`` (the user's ``sys.stdout`` and friends).
PRODUCTION_FIXED = ("torch.ops.aten", "torch.ops.prims", "torch.ops.inductor",
                    "torch._inductor.select_algorithm.extern_kernels")


class ProductionSnapshot(SideEffects):
    """The cheap part of :class:`SideEffects`, for production verification in the user's process
    (:mod:`tilesmith.install.verify`): the identity of every attribute of the namespaces the installed wrapper's
    source names (:func:`tilesmith.gate.torchstate.wrapper_namespaces`, passed in) plus :data:`PRODUCTION_FIXED`,
    every torch/Triton class's ``__dict__`` (:class:`~tilesmith.gate.classdigest.ClassDigest`: a replaced method
    of ``torch.nn.Linear``), the interpreter's callable hooks (:data:`tilesmith.gate.hooktables.CALLABLE_HOOKS`:
    ``warnings.showwarning``, ``sys.excepthook``, ...), the ``torch.backends.*`` values (:func:`backend_values`) and
    the denormal probe (:func:`probe_denormals`). Left out: the compiler configurations, the getters, the
    import-system lists and the hook tables with entries (warning filters, logging handlers, exit callbacks,
    torch's global hook dicts: the user's own code and its imports change those between calls as they like; a
    change made by the wrapper *during* a checked call is seen by :class:`tilesmith.gate.window.StateWindow`).

    :meth:`baseline` before the wrapper's import (about 36 ms on the CPU with Inductor and Dynamo loaded);
    :meth:`changes` on a checked call (about 1.4 ms; 6.7 ms when the class digest is due, at most once a second:
    docs/verification.md, "Cost")."""

    fixed = PRODUCTION_FIXED
    sys_lists = ()
    digest_interval_s = 1.0
    """The class digest (5–10 ms, most of a check's snapshot cost) is compared on a checked call only when this many
    seconds passed since its last comparison, so cheap graphs keep frequent checks; a class patched on any call is
    still seen at the first checked call after that."""
    _digest_at: float | None = None

    def identity_changes(self) -> list[str]:
        now = time.monotonic()
        if self._digest_at is not None and now - self._digest_at < self.digest_interval_s:
            saved, self.classes.entries = self.classes.entries, []
            try:
                return super().identity_changes()
            finally:
                self.classes.entries = saved
        self._digest_at = now
        return super().identity_changes()

    @staticmethod
    def values() -> dict[str, Any]:
        return {**backend_values(), **probe_denormals()}

    def hooks(self) -> dict[str, Any]:
        return hooktables.callable_hooks()

    def changes(self) -> list[str]:
        """What differs from the baseline, one short line each: ``"extern_kernels.mm"``-style names of replaced
        or removed attributes, ``"torch.backends.mkldnn.enabled: True → False"`` for values."""
        return list(self.identity_changes()) + change_lines(self.state_changes())


def hook_changes(before: dict[str, Any], now: dict[str, Any]) -> dict[str, list[Any]]:
    """``{"hook warnings.showwarning": [before, after]}`` for every hook table of ``before`` that differs (short
    ``repr`` s; for tables with entries, which entries)."""
    out: dict[str, list[Any]] = {}
    for key, value in before.items():
        current = now.get(key)
        if value == current:
            continue
        if isinstance(value, hooktables.Keeps) and isinstance(current, hooktables.Keeps):
            out[f"hook {key}"] = ["as at the baseline", "; ".join(value.differences(current))[:400]]
        else:
            out[f"hook {key}"] = [repr(value)[:200], repr(current)[:200]]
    return out


def change_lines(diff: dict[str, list[Any]]) -> list[str]:
    """``{key: [before, after]}`` as ``"key: before → after"`` lines (values as they travel to the host)."""
    return [f"{k}: {_show(a)!r} → {_show(b)!r}" for k, (a, b) in diff.items()]
