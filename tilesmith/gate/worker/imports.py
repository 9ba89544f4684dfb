"""Import restriction (issue 15): a candidate imports only what the original wrapper imports, plus :data:`ALLOWED`.

Runs only inside ``python -m tilesmith.gate.worker``. :class:`ImportGuard` replaces ``builtins.__import__`` in
every worker (trusted and candidate alike, before any baseline, so both arms pay the same few microseconds per
``import`` statement) and looks at every import *requested by a subject frame*: the first frame outward from the
request that is not the standard library (the audit hook's *direct* rule, :meth:`.audit._State.attribute`).

- In the **trusted** worker, while the original is imported and warmed up (two calls), the subject is the
  original and its kernel modules (files of the private directory): every module it imports (``import x``,
  ``import x.y as z``), every name it imports from a module (``from ctypes import c_void_p`` grants the name
  ``c_void_p`` of ``ctypes``, not ``ctypes`` itself), every module such a name turns out to be, and every module
  object bound in its globals afterwards are the **grants** (:meth:`ImportGuard.grants`), sent to the host in
  the ``init`` answer (``original_imports``). An import that library code makes while the original runs (a
  lazily imported torch submodule) is never a request of the original's frames, so it is neither granted nor,
  in a candidate worker, blamed.
- In a **candidate** worker (from the candidate's import on; the host sends the grants as ``allowed_imports``)
  a request by a candidate frame that neither the grants nor :data:`ALLOWED` cover is **refused**: the import
  raises ``ImportError`` and the refusal is reported (``imports_refused``; the host fails the candidate with
  ``import_not_allowed``, status ``rejected_global_state``). Spellings covered: ``import`` statements and
  ``from`` imports (also of modules already in ``sys.modules``), ``__import__(...)`` called directly, names
  that turn out to be modules (``from torch import sys``), and, through a finder first on ``sys.meta_path``
  (:class:`_Finder`, in place before the baselines), modules a candidate frame loads by other routes
  (``importlib.import_module``, ``importlib.__import__``) when they were not loaded yet. Imports that the body of
  a module being imported makes are that module's own (the walk stops at the import machinery's frames). After the import and every call, module objects bound in the candidate module's globals
  are checked too (``m = torch.sys.modules["ctypes"]`` at module level: :meth:`ImportGuard.scan`).

Not covered: a module object reached without an import inside a function (``torch.sys.modules["ctypes"]``,
an attribute of an allowed module) and ``importlib.import_module`` of a module that is already loaded, reached
through such an attribute. Those are the same objects the original's code could reach; what is *done* with them
is judged by the audit hook and the side-effect checks, and the static scan refuses those spellings.
"""

from __future__ import annotations

import builtins
import sys
import types
from collections.abc import Callable
from typing import Any

#: Modules every candidate may import beyond the original's own imports (``"x.*"``: ``x`` and its submodules),
#: with the reason each is there (docs/gate.md, "Imports"). Everything else a candidate needs, it can take
#: from what the original imports.
ALLOWED: dict[str, str] = {
    "torch": "the package every wrapper imports",
    "torch._inductor.*": "every import line Inductor's code generation writes into a wrapper or a kernel module "
                         "(runtime, async_compile, select_algorithm, codecache for cpp_wrapper, hooks, utils, "
                         "memory_planning, wrapper_benchmark, kernel templates): config variants and candidates "
                         "that add Triton kernels need them even where the original has none",
    "torch._C.*": "raw stream getters and the guards' assert_size_stride/_reinterpret_tensor",
    "torch._dynamo.testing": "rand_strided of the benchmark harness at the end of every wrapper",
    "torch.profiler": "record_function, written by Inductor into profiled wrapper calls",
    "torch.cuda.*": "nvtx, written by Inductor into annotated launches; CUDA graphs and streams",
    "triton.*": "Triton and its language: any CUDA candidate may add Triton kernels",
    "math": "pure functions and constants (Inductor writes math.inf, math.sqrt)",
    "cmath": "nanj, imported by every Inductor wrapper",
}

#: Single names a candidate may import from a module it may not import whole.
ALLOWED_NAMES: dict[tuple[str, str], str] = {
    ("tilesmith.kernels.runtime", "native_module"): "the loader of Tilesmith's prebuilt native kernels (the "
                                                    "static scan admits exactly this import; docs/gate.md, "
                                                    "\"Native kernels\")",
}

#: Module objects a candidate's globals may bind besides granted and allowed ones: the extension modules
#: ``native_module`` returns (``tilesmith.kernels.runtime.module_name``).
_BOUND_PREFIXES = ("tilesmith_native_",)

_MAX_REFUSED = 24


def _allowed_module(name: str) -> bool:
    for rule in ALLOWED:
        if rule.endswith(".*"):
            base = rule[:-2]
            if name == base or name.startswith(base + "."):
                return True
        elif name == rule:
            return True
    return False


class ImportGuard:
    """The worker's ``__import__`` wrapper and its bookkeeping (one per worker process)."""

    def __init__(self) -> None:
        self.mode: str | None = None
        """``"record"`` (trusted worker, original loading), ``"enforce"`` (candidate worker) or ``None``."""
        self.modules: set[str] = set()
        self.names: set[tuple[str, str]] = set()
        self.bound: set[str] = set()
        self.refused: list[str] = []
        self._direct: Callable[[Any], Any] | None = None

    # -- set-up ----------------------------------------------------------------------------------------
    def install(self, direct: Callable[..., Any]) -> None:
        """Replace ``builtins.__import__`` and put :class:`_Finder` first on ``sys.meta_path``.
        ``direct(frame, through_imports)`` returns the subject frame a request is attributed to (or ``None``):
        :meth:`tilesmith.gate.worker.audit._State.direct_frame`."""
        self._direct = direct
        real, getframe, guard = builtins.__import__, sys._getframe, self
        sys.meta_path.insert(0, _Finder(self))
        from importlib.util import resolve_name

        def __import__(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (),  # noqa: A002
                       level: int = 0) -> Any:
            if guard.mode is None:
                return real(name, globals, locals, fromlist, level)
            where = direct(getframe(1))
            if where is None:
                return real(name, globals, locals, fromlist, level)
            full = name
            if level:
                try:
                    package = globals.get("__package__") if isinstance(globals, dict) else None
                    full = resolve_name("." * level + name, package or "")
                except (ImportError, ValueError, TypeError, AttributeError):
                    return real(name, globals, locals, fromlist, level)
            items = [str(i) for i in (fromlist or ())]
            if guard.mode == "enforce" and not guard._may_enter(full, items):
                guard._refuse(full, "import" if not items else f"from {full} import {', '.join(items)[:80]}", where)
            module = real(name, globals, locals, fromlist, level)
            target = sys.modules.get(full, module) if items else module
            for item in items:
                guard._item(full, item, target, where)
            if not items and guard.mode == "record":
                guard.modules.add(full)
            return module

        builtins.__import__ = __import__

    def grant(self, granted: dict[str, Any]) -> None:
        """Take the trusted worker's grants (:meth:`grants` of the original's worker, through the host)."""
        self.modules |= {str(m) for m in granted.get("modules", []) if isinstance(m, str)}
        self.names |= {(str(p[0]), str(p[1])) for p in granted.get("names", []) if isinstance(p, list) and len(p) == 2}
        self.bound |= {str(m) for m in granted.get("bound", []) if isinstance(m, str)}

    def grants(self, namespace: dict[str, Any] | None = None) -> dict[str, list[Any]]:
        """What the original imported (JSON): ``modules``, ``names`` (``[module, name]``) and ``bound`` (module
        objects in ``namespace``, the original module's globals)."""
        if namespace is not None:
            self.bound |= {m.__name__ for m in list(namespace.values()) if isinstance(m, types.ModuleType)
                           and isinstance(getattr(m, "__name__", None), str)}
        return {"modules": sorted(self.modules), "names": sorted([list(p) for p in self.names]),
                "bound": sorted(self.bound)}

    # -- decisions -------------------------------------------------------------------------------------
    def module_ok(self, name: str) -> bool:
        """``name`` was imported by the original (or is the parent package of one it imported), or is allowed."""
        if name in self.modules or _allowed_module(name):
            return True
        prefix = name + "."
        return any(m.startswith(prefix) for m in self.modules)

    def _may_enter(self, full: str, items: list[str]) -> bool:
        if self.module_ok(full):
            return True
        if not items or "*" in items:
            return False
        return any((full, i) in self.names or (full, i) in ALLOWED_NAMES for i in items)

    def _item(self, full: str, item: str, target: Any, where: Any) -> None:
        value = getattr(target, item, None) if item != "*" else None
        if self.mode == "record":
            if item == "*":
                self.modules.add(full)
                return
            self.names.add((full, item))
            if isinstance(value, types.ModuleType) and isinstance(getattr(value, "__name__", None), str):
                self.modules.add(value.__name__)
            return
        if item == "*":
            return  # entered only when the module itself is granted (_may_enter)
        if isinstance(value, types.ModuleType):
            module_name = getattr(value, "__name__", "?")
            if not (self.module_ok(str(module_name)) or (full, item) in self.names):
                self._refuse(str(module_name), f"from {full} import {item}", where)
        elif not (self.module_ok(full) or (full, item) in self.names or (full, item) in ALLOWED_NAMES):
            self._refuse(f"{full}.{item}", f"from {full} import {item}", where)

    def find(self, name: str, frame: Any) -> None:
        """A module about to be loaded (:class:`_Finder`): refused when a candidate frame asked for it by a route
        around ``__import__`` (``importlib.import_module``) and it is not granted."""
        if self.mode != "enforce" or self._direct is None or self.module_ok(name):
            return
        where = self._direct(frame, True)
        if where is not None:
            self._refuse(name, "importlib or another route around import statements", where)

    def scan(self, namespace: dict[str, Any]) -> None:
        """Module objects bound in a candidate module's globals that are neither granted, bound by the original,
        nor allowed (``s = torch.sys`` at module level)."""
        if self.mode != "enforce":
            return
        for attr, value in list(namespace.items()):
            if not isinstance(value, types.ModuleType):
                continue
            name = getattr(value, "__name__", None)
            name = name if isinstance(name, str) else "?"
            if name in self.bound or self.module_ok(name) or name.startswith(_BOUND_PREFIXES):
                continue
            self._note(name, f"bound as the global {attr!r}", None)

    def drain(self) -> list[str]:
        """Refusals since the last drain (one line each: module, how, candidate line)."""
        out, self.refused = self.refused, []
        return out

    def _refuse(self, name: str, how: str, where: Any) -> None:
        self._note(name, how, where)
        raise ImportError(f"tilesmith gate: the candidate may not import {name!r}: the original wrapper does not "
                          f"import it and it is not on the gate's allow-list (docs/gate.md, \"Imports\")")

    def _note(self, name: str, how: str, where: Any) -> None:
        line = f" at line {where.f_lineno}" if where is not None else ""
        text = f"{name} ({how}{line})"
        if text not in self.refused and len(self.refused) < _MAX_REFUSED:
            self.refused.append(text)


class _Finder:
    """First entry of ``sys.meta_path`` in a worker: finds nothing, refuses what :meth:`ImportGuard.find` refuses
    (``ImportError``), so that every new module load, whatever the route, passes the guard."""

    def __init__(self, guard: ImportGuard) -> None:
        self._guard = guard
        self._getframe = sys._getframe

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        self._guard.find(fullname, self._getframe(1))
        return None

    def invalidate_caches(self) -> None:
        return None

