"""The process's hook tables: where a candidate can install code that runs later, outside its own calls.

Shared (standard library and torch only). Red team, 2026-12-05 ("R7"): a candidate replaced
``warnings.showwarning``; every later warning of the process ran its code. Nothing an honest Inductor wrapper does
touches any of these tables, so every change is reported. :func:`hook_values` reads, as ``{name: value}``:

- ``warnings``: ``showwarning``, ``formatwarning``, ``_showwarnmsg_impl``, ``defaultaction``, the ``filters`` list
  (entry by entry);
- ``sys``: ``excepthook``, ``displayhook``, ``unraisablehook``, ``breakpointhook``, the ``meta_path`` and
  ``path_hooks`` lists (finder by finder, by identity), ``path_importer_cache`` (every finder recorded must stay:
  new directories add entries when anything imports);
- ``threading.excepthook``, ``atexit._ncallbacks()`` (the number of exit callbacks), ``gc.callbacks`` (by
  identity), ``gc.isenabled()`` and ``gc.get_threshold()``, ``copyreg.dispatch_table`` (every reducer recorded must
  stay), ``signal.getsignal`` of every signal (``signals=True``: the gate worker reads signals itself);
- ``logging``: the record factory, the logger class, ``logging.disable``'s level, and for the root logger and every
  ``torch*``/``tilesmith*`` logger its handlers, filters, level, ``disabled`` and ``propagate`` (loggers made later
  are not a change: torch makes them lazily);
- every module-level ``dict``/``list``/``set``/``deque`` of a loaded ``torch.*``/``triton.*`` module whose name says
  it holds hooks, callbacks or handlers (``torch.nn.modules.module._global_forward_hooks``,
  ``torch.optim.optimizer._global_optimizer_pre_hooks``, Dynamo's ``_bytecode_hooks``: found by
  :func:`tilesmith.gate.classdigest.scan`, entry by entry).

Values hold the objects themselves (:class:`Same`, :class:`Keeps`), so an id cannot be recycled behind the
comparison; they compare with ``==`` (``before == after``: :class:`Keeps` is deliberately one-sided, additions
allowed) and print short ``repr`` s for the host and the diagnostics.
"""

from __future__ import annotations

import atexit
import builtins
import copyreg
import gc
import logging
import signal
import sys
import threading
import warnings
from typing import Any

_MISSING = object()
#: ``[gc.isenabled()]`` from before a gate worker's timing run while the worker holds the collector off for that run
#: (``tilesmith.gate.worker.seal``, red team 20), else ``[None]``: what :func:`hook_values` reports meanwhile.
COLLECTOR_BEFORE: list[bool | None] = [None]


def _label(obj: Any) -> str:
    if isinstance(obj, (str, int, float, bool, type(None))):
        return repr(obj)[:80]
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{getattr(obj, '__module__', None) or type(obj).__module__}.{name}"[:120]


class Same:
    """A sequence of objects compared element by element by identity (``is``), and by length."""

    __slots__ = ("items",)

    def __init__(self, items: Any) -> None:
        self.items = tuple(items)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Same) and len(other.items) == len(self.items) and \
            all(map(_same, self.items, other.items))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        shown = ", ".join(_label(x) for x in self.items[:6])
        return f"[{shown}{', ...' if len(self.items) > 6 else ''}] ({len(self.items)})"


class Keeps:
    """A mapping whose recorded entries must all stay bound to the same objects (``before == after``); entries added
    later are allowed. One-sided on purpose: the baseline is always the left operand."""

    __slots__ = ("entries",)

    def __init__(self, entries: dict[Any, Any]) -> None:
        self.entries = dict(entries)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Keeps):
            return False
        now = other.entries
        return all(_same(v, now.get(k, _MISSING)) for k, v in self.entries.items())

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<{len(self.entries)} entries>"

    def differences(self, other: Keeps) -> list[str]:
        out = []
        for k, v in self.entries.items():
            now = other.entries.get(k, _MISSING)
            if not _same(v, now):
                out.append(f"{_label(k)} {'removed' if now is _MISSING else 'replaced'}")
        return out


def _equal_scalar(a: Any, b: Any) -> bool:
    return type(a) is type(b) and isinstance(a, (str, int, float, bool, bytes)) and a == b


def _same(a: Any, b: Any) -> bool:
    """Identity; equal scalars of one type; element-wise for tuples and the comparable wrappers."""
    if a is b or _equal_scalar(a, b):
        return True
    if isinstance(a, (Same, Keeps, Ident)):
        return a == b
    return isinstance(a, tuple) and isinstance(b, tuple) and Same(a) == Same(b)


class Ident:
    """One object, compared by identity."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ident) and other.obj is self.obj

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return _label(self.obj)


def _torchs_own(handler: Any) -> bool:
    """Torch's ``LazyTraceHandler`` as torch made it (no filters, no callable instance attribute such as a replaced
    ``emit`` beyond torch's ``_builtin_open``): it removes itself from ``logging.getLogger('torch.__trace')`` at torch's first structured-trace record
    (``torch/_logging/_internal.py``), which may fall in a candidate's import (a C++ build of a ``cpp_wrapper``
    variant on a cold cache; fresh-clone CI, 2026-12-05) and not in the original's. It runs only torch's code, so
    its presence is not compared."""
    lazy = getattr(sys.modules.get("torch._logging._internal"), "LazyTraceHandler", None)
    return (lazy is not None and type(handler) is lazy and not getattr(handler, "filters", None)
            and all(not callable(v) or (k == "_builtin_open" and v is builtins.open)  # torch's own attribute
                    for k, v in vars(handler).items()))


def _logger_state(logger: Any) -> Same:
    handlers = [h for h in getattr(logger, "handlers", ()) if not _torchs_own(h)]
    return Same((Same(handlers), Same(getattr(logger, "filters", ())),
            getattr(logger, "level", None), getattr(logger, "disabled", None), getattr(logger, "propagate", None)))


def logging_values() -> dict[str, Any]:
    out: dict[str, Any] = {
        "logging.getLogRecordFactory()": Ident(logging.getLogRecordFactory()),
        "logging.getLoggerClass()": Ident(logging.getLoggerClass()),
        "logging.root.manager.disable": getattr(logging.root.manager, "disable", None),
    }
    out["logging.root (handlers, filters, level, disabled, propagate)"] = _logger_state(logging.root)
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and name.split(".", 1)[0] in ("torch", "tilesmith", "triton"):
            # one key per logger: the trusted original's own effects (torch drops its lazy trace handler on a
            # fresh process's first compile: logging.getLogger('torch.__trace')) exclude that logger only
            out[f"logging.getLogger({name!r}) (handlers, filters, level, disabled, propagate)"] = _logger_state(logger)
    return out


#: Interpreter hooks replaced only by a program's start-up (read by production verification against its baseline).
CALLABLE_HOOKS: dict[str, Any] = {
    "warnings.showwarning": lambda: warnings.showwarning,
    "warnings.formatwarning": lambda: warnings.formatwarning,
    "warnings._showwarnmsg_impl": lambda: getattr(warnings, "_showwarnmsg_impl", None),
    "sys.excepthook": lambda: sys.excepthook,
    "sys.displayhook": lambda: sys.displayhook,
    "sys.unraisablehook": lambda: sys.unraisablehook,
    "sys.breakpointhook": lambda: sys.breakpointhook,
    "threading.excepthook": lambda: threading.excepthook,
}


def callable_hooks() -> dict[str, Any]:
    return {name: Ident(getter()) for name, getter in CALLABLE_HOOKS.items()}


def signal_values() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for sig in signal.valid_signals():
        try:
            out[f"signal.getsignal({getattr(sig, 'name', sig)})"] = Ident(signal.getsignal(sig))
        except (ValueError, OSError):
            continue
    return out


def hook_values(signals: bool = True, containers: dict[str, Any] | None = None,
                import_lists: bool = True) -> dict[str, Any]:
    """Every table of the module docstring as ``{name: comparable value}``. ``containers``: the torch hook
    containers found by :func:`tilesmith.gate.classdigest.scan` (``None``: scanned here); ``import_lists=False``
    leaves ``sys.meta_path`` and ``sys.path_hooks`` out (the gate worker compares them element by element itself)."""
    out: dict[str, Any] = callable_hooks()
    out["warnings.defaultaction"] = getattr(warnings, "defaultaction", None)
    out["warnings.filters"] = Same(getattr(warnings, "filters", ()))
    if import_lists:
        out["sys.meta_path"] = Same(sys.meta_path)
        out["sys.path_hooks"] = Same(sys.path_hooks)
    out["sys.path_importer_cache"] = Keeps(sys.path_importer_cache)
    ncallbacks = getattr(atexit, "_ncallbacks", None)
    if ncallbacks is not None:
        out["atexit._ncallbacks()"] = int(ncallbacks())
    out["gc.callbacks"] = Same(gc.callbacks)
    held = COLLECTOR_BEFORE[0]
    out["gc.isenabled()"] = held if held is not None and not gc.isenabled() else gc.isenabled()
    out["gc.get_threshold()"] = repr(gc.get_threshold())
    out["copyreg.dispatch_table"] = Keeps(copyreg.dispatch_table)
    out.update(logging_values())
    if signals:
        out.update(signal_values())
    if containers is None:
        from tilesmith.gate.classdigest import scan

        containers = scan().containers
    out.update(container_values(containers))
    return out


def container_values(containers: dict[str, Any]) -> dict[str, Any]:
    """``{"torch.nn.modules.module._global_forward_hooks": Same(entries)}``: each container's entries (a dict's
    ``(key, value)`` pairs flattened, so a hook added, removed or replaced changes it)."""
    out = {}
    for label, table in containers.items():
        try:
            if isinstance(table, dict):
                items = [x for pair in list(table.items()) for x in pair]
            else:
                items = list(table)
        except Exception:  # noqa: BLE001 - mutated while read
            continue
        out[label] = Same(items)
    return out
