"""Candidate code must not run unaudited at interpreter exit.

CPython 3.11 runs the ``atexit`` callbacks (``weakref.finalize`` included) with the audit hooks in place, then
clears the hooks (``_PySys_ClearAuditHooks`` in ``Py_FinalizeEx``) and only then tears the modules down: every
``__del__`` that runs during that teardown, and the ``finally`` block of a generator closed by it, runs with no hook
at all. The red team's R5 ran ``sh`` from a ``__del__`` of the wrapper module that way.

:func:`disarm` runs from production verification's last ``atexit`` callback
(:func:`tilesmith.install.audit._at_exit`), while the hook still judges:

* a class defined by candidate code (a function in its ``__dict__`` compiled from a candidate file, or its
  ``__module__`` is a candidate module) loses its ``__del__`` (replaced by a no-op: its instances are finalized
  without running candidate code);
* a suspended generator or coroutine of candidate code is closed now, so its ``finally`` runs under the hook (which
  refuses what the rules refuse, by code origin).

Not covered: a ``weakref.ref`` callback of candidate code whose referent dies during teardown (its callback cannot
be removed from Python), and a library finalizer holding a library callable with candidate-chosen arguments.
The walk (``gc.get_objects``) costs a few tens of milliseconds per million objects, once, at exit, in processes
where a wrapper was installed with the audit on.
"""

from __future__ import annotations

import gc
import sys
import types
from typing import Any

_GENERATORS = (types.GeneratorType, types.CoroutineType)


def _no_finalizer(self: Any) -> None:
    """Stands in for a candidate class's ``__del__`` at exit."""


def _code_of(value: Any) -> Any:
    value = getattr(value, "__func__", value)  # staticmethod, classmethod
    if isinstance(value, property):
        value = value.fget
    return value.__code__ if isinstance(value, types.FunctionType) else None


def _candidate_class(cls: type, files: set[str], modules: set[str]) -> bool:
    if getattr(cls, "__module__", None) in modules:
        return True
    for value in list(vars(cls).values()):
        code = _code_of(value)
        if code is not None and code.co_filename in files:
            return True
    return False


def disarm(files: set[str]) -> tuple[int, int]:
    """Remove ``__del__`` from classes defined by code of ``files`` and close their suspended generators
    and coroutines; ``(classes, generators)`` changed."""
    if not files:
        return 0, 0
    modules = {name for name, m in list(sys.modules.items())
               if isinstance(getattr(m, "__file__", None), str) and m.__file__ in files}
    classes = gens = 0
    for obj in gc.get_objects():
        kind = type(obj)
        if kind in _GENERATORS:
            code = getattr(obj, "gi_code", None) or getattr(obj, "cr_code", None)
            frame = getattr(obj, "gi_frame", None) or getattr(obj, "cr_frame", None)
            if code is not None and frame is not None and code.co_filename in files:
                try:
                    obj.close()  # its finally runs now, judged by the audit hook
                except BaseException:  # noqa: BLE001 - candidate code may raise anything
                    pass
                gens += 1
        elif issubclass(kind, type) and "__del__" in vars(obj) and _candidate_class(obj, files, modules):
            try:
                type.__setattr__(obj, "__del__", _no_finalizer)
                classes += 1
            except (TypeError, AttributeError):
                pass
    return classes, gens
