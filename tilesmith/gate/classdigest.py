"""Every torch and Triton class's attribute dictionary, so a replaced method is seen however it was reached.

Shared (standard library only). Red team, 2026-12-05 ("R3"): a candidate replaced ``torch.nn.Linear.forward``
through ``_id(torch.nn).Linear.forward = f`` (a store through a function call, which the static scan does not
follow); only a handful of classes were in the worker's identity snapshot
(:data:`tilesmith.gate.torchstate._WATCHED_CLASSES`). :class:`ClassDigest` now records, at its baseline, every class
bound at module level in every loaded ``torch``/``triton`` module (:func:`scan`), plus every class bound in the extra
namespaces it is given (the wrapper's namespaces: :class:`tilesmith.gate.sidefx.SideEffects`), and for each the
keys and values of its ``__dict__``. :meth:`ClassDigest.changes` reports an attribute whose object is no longer
the same (``"torch.nn.modules.linear.Linear.forward (replaced)"``) or that disappeared (``(removed)``), however it
was written (``setattr``, ``type.__setattr__``, ``vars(cls)``-free stores through ``__dict__`` descriptors, a
module reached through ``sys.modules``, ``importlib`` or a function's return value: the digest reads the class, not
the path).

Not a change (:func:`_same`): a scalar rebound to another of its type (class-level counters and flags), a plain
container rebound to a new one of its type (a class-level cache reset), ``None`` replaced by a non-callable value
(lazy initialisation of a class-level cache), attributes *added* to a class (Python caches ``__slotnames__``; torch adds
lazily), and classes or modules that appear after the baseline (lazy imports; their classes are not watched).

The digest holds the classes and the values themselves, so no id can be recycled behind it. Types whose attributes
cannot be set (static builtin types such as ``object``, ``Py_TPFLAGS_IMMUTABLETYPE``) are left out. Cost on the
project's 2-core CPU CI with Inductor's CPU modules and Dynamo loaded (about 4,300 classes, 49,000 attributes), idle:
about 38 ms for a baseline and 4–5 ms for a comparison, three times that under a load of 4 (``bench/snapshot_cost.py``;
values compared in C, ``map(operator.is_, ...)``; a class whose values differ is then compared key by key).
docs/gate.md ("Side effects by structure") and docs/verification.md ("Cost").
"""

from __future__ import annotations

import collections
import operator
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

_PREFIXES = ("torch.", "triton.")
_ROOTS = ("torch", "triton")
#: Module-level containers whose name holds one of these (lower case) are hook tables
#: (:mod:`tilesmith.gate.hooktables`).
_HOOK_WORDS = ("hook", "callback", "handler")
_CONTAINERS = (dict, list, set, collections.OrderedDict, collections.deque, collections.defaultdict)
_SCALARS = (bool, int, float, complex, str, bytes, type(None))
_IMMUTABLE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE (CPython 3.10+)
_PLAIN = (dict, list, set, frozenset, tuple, collections.OrderedDict, collections.defaultdict)


@dataclass
class Scan:
    """What one pass over the loaded torch/Triton modules found."""

    classes: dict[int, tuple[str, type]] = field(default_factory=dict)
    """``{id(cls): (label, cls)}`` (the class is held: its id cannot be reused while the scan lives)."""
    containers: dict[str, Any] = field(default_factory=dict)
    """``{"module.name": container}`` of the hook tables."""


def _is_class(value: Any) -> bool:
    # issubclass(type(v), type), not isinstance: isinstance reads a lazy object's __class__ (deprecation warnings)
    return issubclass(type(value), type)


def _label(cls: type, where: str, attr: str) -> str:
    module, name = getattr(cls, "__module__", None), getattr(cls, "__qualname__", None)
    if isinstance(module, str) and isinstance(name, str):
        return f"{module}.{name}"
    return f"{where}.{attr}"


def scan(extra: Iterable[tuple[str, dict[str, Any]]] = ()) -> Scan:
    """Every class bound at module level in a loaded ``torch``/``triton`` module or in an ``extra`` namespace, and the
    hook-table containers of the torch/Triton modules. Nothing is imported."""
    found = Scan()
    for name, module in list(sys.modules.items()):
        if module is None or not (name in _ROOTS or name.startswith(_PREFIXES)):
            continue
        try:
            items = list(vars(module).items())
        except TypeError:
            continue
        for attr, value in items:
            if _is_class(value):
                if id(value) not in found.classes:
                    found.classes[id(value)] = (_label(value, name, attr), value)
            elif type(value) in _CONTAINERS and any(w in attr.lower() for w in _HOOK_WORDS):
                found.containers[f"{name}.{attr}"] = value
    for where, namespace in extra:
        for attr, value in list(namespace.items()):
            if _is_class(value) and id(value) not in found.classes:
                found.classes[id(value)] = (_label(value, where, attr), value)
    return found


def _same(before: Any, now: Any) -> bool:
    """Not a patch: the same object; a scalar rebound to a scalar of its type (class-level counters and flags:
    Dynamo's ``GenerationTracker.generation``, ``FakeTensorMode.cache_hits``, ``RemovableHandle.next_id``); a plain
    container rebound to a new one of its type (a class-level cache reset: ``CompiledTritonKernels._cache``);
    ``None`` replaced by a non-callable value (lazy initialisation)."""
    if now is before:
        return True
    kind = type(before)
    if kind is type(now) and (kind in _SCALARS or kind in _PLAIN):
        return True
    return before is None and not callable(now)


class ClassDigest:
    """Baseline of every class's ``__dict__`` (:func:`scan`); :meth:`changes` lists what was replaced or removed."""

    #: ``(class label, attribute)`` pairs torch rebinds under honest code (none known in torch 2.11).
    ignored: frozenset[tuple[str, str]] = frozenset()

    def __init__(self) -> None:
        self.entries: list[tuple[str, type, tuple[Any, ...], tuple[Any, ...]]] = []
        self.containers: dict[str, Any] = {}

    def baseline(self, extra: Iterable[tuple[str, dict[str, Any]]] = ()) -> None:
        found = scan(extra)
        self.containers = found.containers
        self.entries = []
        for label, cls in found.classes.values():
            if getattr(cls, "__flags__", 0) & _IMMUTABLE:
                continue  # a static builtin type (object, int, dict found in a torch namespace): no attribute can be set
            try:
                space = cls.__dict__
                self.entries.append((label, cls, tuple(space), tuple(space.values())))
            except Exception:  # noqa: BLE001 - an exotic metaclass
                continue

    def changes(self) -> list[str]:
        """``"torch.nn.modules.linear.Linear.forward (replaced)"``-style lines, sorted."""
        out: list[str] = []
        is_ = operator.is_
        for label, cls, keys, values in self.entries:
            space = cls.__dict__
            if len(space) == len(keys) and all(map(is_, values, space.values())) and all(map(is_, keys, space)):
                continue
            now = dict(space)
            for key, value in zip(keys, values):
                if (label, key) in self.ignored:
                    continue
                current = now.get(key, _MISSING)
                if current is _MISSING:
                    out.append(f"{label}.{key} (removed)")
                elif not _same(value, current):
                    out.append(f"{label}.{key} (replaced)")
        return sorted(out)


_MISSING = object()
