"""Red-team candidates for issue 15 (imports restricted to the original's plus an allow-list, docs/gate.md
"Imports"): each brings in a module the original Inductor CPU wrapper does not import, by a different spelling.
The tests switch the static scan off (``gate_support.runtime_checks_only``), so only the worker's import guard
(:mod:`tilesmith.gate.worker.imports`) can catch them. ``socket``, ``ctypes`` and ``sys`` are already loaded in
every worker (torch imports them): an ``import`` of them loads nothing new, which is why the guard judges the
request, not ``sys.modules``.
"""

from __future__ import annotations

from tests.cheats.common import after_clear, module_code


def importlib_import_module(src: str) -> str:
    """``import importlib`` at import, then ``importlib.import_module("socket")`` at the first call."""
    src = module_code(src, "import importlib")
    return after_clear(src, ["importlib.import_module('soc' + 'ket')"])


def dunder_import_in_call(src: str) -> str:
    """``__import__("ctypes")`` inside ``call`` (the original imports three names from ctypes, not ctypes)."""
    return after_clear(src, ["_c = __import__('ct' + 'ypes')"])


def module_from_sys_modules(src: str) -> str:
    """``sys`` reached as a name imported from torch (``from torch import sys``), then ``sys.modules["socket"]``."""
    return module_code(src, "from torch import sys as _s\n_sock = _s.modules['soc' + 'ket']")


def sys_modules_through_attribute(src: str) -> str:
    """No import statement at all: ``torch.sys.modules["socket"]`` bound as a module global."""
    return module_code(src, "_sock = getattr(torch, 's' + 'ys').modules['soc' + 'ket']")


def importlib_reached_as_attribute_in_call(src: str) -> str:
    """``importlib`` reached as an attribute of Inductor's code cache inside ``call``, loading a module that is
    not loaded yet (``xmlrpc.client``): no ``import`` statement of the candidate; the finder the guard puts first
    on ``sys.meta_path`` sees the load."""
    return after_clear(src, ["getattr(torch._inductor.codecache, 'import' + 'lib').import_module('xmlrpc.' + 'client')"])
