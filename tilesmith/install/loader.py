"""Load an accepted wrapper the way Inductor loads its own, and swap it in.

Loading follows ``GraphLowering._compile_to_module_lines`` (``torch/_inductor/graph.py``, torch 2.11):
``PyCodeCache.write(source)`` then ``PyCodeCache.load_by_key_path(key, path, linemap, attrs)`` with the
graph's constants as module attributes. ``attrs`` is always passed (even ``{}``), which forces a fresh
``exec`` instead of PyCodeCache's memoised module, so two graphs with identical text never share a
``Runner``. On GPU the callable is wrapped in ``align_inputs_from_check_idxs`` exactly as Inductor's
``post_compile`` does, so misaligned inputs are copied before Triton kernels (which assume 16-byte
alignment) see them.

Swapping assigns ``CompiledFxGraph.current_callable``: AOTAutograd keeps the ``CompiledFxGraph`` and calls
``current_callable`` on every call, so later calls go straight to the installed module with no per-call
work added by Tilesmith.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from tilesmith.capture.source import mark_installed


def load_wrapper(source: str, constants: dict[str, Any], linemap: Sequence[Any] | None = None) -> ModuleType:
    """Load wrapper ``source`` as an Inductor module with ``constants`` as attributes.

    Raises whatever the module's import raises (syntax errors, kernel compile errors): callers load only
    sources the gate already loaded and accepted in a worker.
    """
    from torch._inductor.codecache import PyCodeCache

    key, path = PyCodeCache.write(mark_installed(source))
    return PyCodeCache.load_by_key_path(key, path, list(linemap or []), dict(constants))


def entry_point(module: ModuleType, inputs_to_check: Sequence[int], mutated_input_idxs: Sequence[int]
                ) -> Callable[[list[Any]], Any]:
    """The boxed callable to install: ``module.call``, alignment-checked like Inductor's own."""
    call = module.call
    if not inputs_to_check:
        return call
    from torch._inductor.utils import align_inputs_from_check_idxs

    try:
        from torch.utils._ordered_set import OrderedSet

        mutated: Any = OrderedSet(mutated_input_idxs)
    except ImportError:  # older torch took a plain set
        mutated = set(mutated_input_idxs)
    return align_inputs_from_check_idxs(call, list(inputs_to_check), mutated)


def swap(compiled: Any, fn: Callable[[list[Any]], Any]) -> None:
    """Make ``compiled`` (a ``CompiledFxGraph``) call ``fn`` from its next call on."""
    compiled.current_callable = fn
