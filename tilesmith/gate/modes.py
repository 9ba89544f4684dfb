"""Thread-local interposition state: the mode stacks, autocast and the saved-tensors default hooks.

Shared (torch and the standard library only). A ``TorchDispatchMode`` or ``TorchFunctionMode`` pushed and never
popped intercepts every later torch call of the thread — the user's, the original Inductor wrapper's (the
production shadow) and the wrapper's own — so a comparison of the wrapper against the original run in the same
process passes while both are wrong (red team, 2026-12-05: "R4", a dispatch mode pushed at call 3000). Nothing in
an honest wrapper pushes a mode and leaves it there. What is read (:func:`mode_state`, JSON-able values):

- ``modes.dispatch`` / ``modes.function``: the Python dispatch-mode and function-mode stacks, one
  ``"module.Class@id"`` entry per mode (``torch._C._len_torch_dispatch_stack`` / ``_get_dispatch_stack_at``,
  ``torch._C._len_torch_function_stack`` / ``_get_function_stack_at``), and the infra modes (fake, proxy,
  functional: ``torch._C._get_dispatch_mode``);
- ``modes.torch_function_enabled``: ``torch._C._is_torch_function_enabled`` / ``_is_torch_function_mode_enabled``;
- ``modes.dispatch_tls``: the thread's local dispatch-key include and exclude sets (a key excluded here skips
  autograd, autocast or a backend for every later call);
- ``autocast.*``: whether autocast is on, its dtype for ``cpu`` and ``cuda``, its weight cache;
- ``autograd.saved_tensors_default_hooks``: the innermost default pack/unpack pair
  (``torch._C._autograd._top_saved_tensors_default_hooks``) and whether such hooks are enabled.

:func:`depths` is the cheap part (two C calls, about 35 ns each on the CPU of this project's CI): production
verification reads it around every *unchecked* call too, so a mode pushed on a call that is not checked is seen
at once. :func:`capture` and :func:`pop_new` put the stacks back: modes above the depth recorded before the
wrapper's call that are not the modes that were there are popped (without calling their ``__exit__``; a mode the
wrapper *removed* cannot be put back in place and is only reported).

Every torch name is read defensively (absent in another torch version: the entry is left out).
"""

from __future__ import annotations

from typing import Any

import torch

_C = torch._C
_DISPATCH_LEN = getattr(_C, "_len_torch_dispatch_stack", None)
_DISPATCH_AT = getattr(_C, "_get_dispatch_stack_at", None)
_FUNCTION_LEN = getattr(_C, "_len_torch_function_stack", None)
_FUNCTION_AT = getattr(_C, "_get_function_stack_at", None)
_NO_DEPTH = lambda: 0  # noqa: E731 - torch without the getter


def _name(obj: Any) -> str:
    kind = type(obj)
    return f"{getattr(kind, '__module__', '?')}.{getattr(kind, '__qualname__', '?')}@{id(obj):x}"


def dispatch_stack() -> list[Any]:
    """The Python dispatch modes of this thread, outermost first (the objects)."""
    if _DISPATCH_LEN is None or _DISPATCH_AT is None:
        return []
    return [_DISPATCH_AT(i) for i in range(_DISPATCH_LEN())]


def function_stack() -> list[Any]:
    """The torch-function modes of this thread, outermost first (the objects)."""
    if _FUNCTION_LEN is None or _FUNCTION_AT is None:
        return []
    return [_FUNCTION_AT(i) for i in range(_FUNCTION_LEN())]


def _infra_modes() -> list[str]:
    getter, keys = getattr(_C, "_get_dispatch_mode", None), getattr(_C, "_TorchDispatchModeKey", None)
    if getter is None or keys is None:
        return []
    out = []
    for key in getattr(keys, "__members__", {}).values():
        try:
            mode = getter(key)
        except Exception:  # noqa: BLE001
            continue
        if mode is not None:
            out.append(f"{getattr(key, 'name', key)}={_name(mode)}")
    return out


def _read(label: str, getter: Any, out: dict[str, Any]) -> None:
    try:
        value = getter()
    except Exception:  # noqa: BLE001 - absent or unreadable in this torch version
        return
    out[label] = value if isinstance(value, (bool, int, float, str, type(None))) else str(value)


def _autocast(out: dict[str, Any]) -> None:
    for device in ("cpu", "cuda"):
        _read(f"autocast.enabled({device})", lambda d=device: bool(torch.is_autocast_enabled(d)), out)
        _read(f"autocast.dtype({device})", lambda d=device: str(torch.get_autocast_dtype(d)), out)
    _read("autocast.cache_enabled", lambda: bool(torch.is_autocast_cache_enabled()), out)


def _saved_tensor_hooks() -> str:
    top = getattr(getattr(_C, "_autograd", None), "_top_saved_tensors_default_hooks", None)
    if top is None:
        return "<unreadable>"
    try:
        pair = top(True)
    except TypeError:
        pair = top()
    if pair is None:
        return "none"
    return " / ".join(f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', '?')}@{id(f):x}" for f in pair)


def mode_state() -> dict[str, Any]:
    """``{name: value}`` of everything the module docstring lists (strings, booleans and numbers only)."""
    out: dict[str, Any] = {
        "modes.dispatch": "[" + ", ".join(_name(m) for m in dispatch_stack()) + "]",
        "modes.function": "[" + ", ".join(_name(m) for m in function_stack()) + "]",
        "modes.infra": "[" + ", ".join(_infra_modes()) + "]",
    }
    _read("modes.torch_function_enabled", lambda: bool(_C._is_torch_function_enabled()), out)
    _read("modes.torch_function_mode_enabled", lambda: bool(_C._is_torch_function_mode_enabled()), out)
    _read("modes.dispatch_tls_include", lambda: str(_C._dispatch_tls_local_include_set()), out)
    _read("modes.dispatch_tls_exclude", lambda: str(_C._dispatch_tls_local_exclude_set()), out)
    _autocast(out)
    _read("autograd.saved_tensors_default_hooks", _saved_tensor_hooks, out)
    _read("autograd.saved_tensors_hooks_enabled", lambda: bool(_C._autograd._saved_tensors_hooks_is_enabled()), out)
    return out


def depths() -> tuple[int, int]:
    """``(dispatch modes, function modes)`` on this thread: the cheap check around an unchecked call."""
    return (_DISPATCH_LEN or _NO_DEPTH)(), (_FUNCTION_LEN or _NO_DEPTH)()


def no_depths() -> tuple[int, int]:
    """Stands in for :func:`depths` where the state check is off."""
    return (0, 0)


class Stacks:
    """The two mode stacks' objects at one moment (held, so that an id cannot be reused meanwhile)."""

    __slots__ = ("dispatch", "function")

    def __init__(self) -> None:
        self.dispatch = dispatch_stack()
        self.function = function_stack()


def capture() -> Stacks:
    return Stacks()


def pop_new(before: Stacks) -> list[str]:
    """Pop the modes pushed since ``before`` (innermost first, while the stack is deeper than it was or its top is
    not the mode that was there); returns what was popped, as ``"dispatch mode module.Class@id"`` lines, plus
    ``"... removed: ..."`` lines for modes that were there and are gone (those cannot be put back)."""
    done: list[str] = []
    pop_dispatch = getattr(_C, "_pop_torch_dispatch_stack", None)
    for label, stack, pop, old in (
            ("dispatch", dispatch_stack, pop_dispatch and (lambda: pop_dispatch(None)), before.dispatch),
            ("function", function_stack, getattr(_C, "_pop_torch_function_stack", None), before.function)):
        if pop is None:
            continue
        for _ in range(64):
            now = stack()
            if not now or (len(now) <= len(old) and all(a is b for a, b in zip(now, old))):
                break
            if len(now) <= len(old) and now[-1] is old[len(now) - 1]:
                break
            try:
                popped = pop()
            except Exception:  # noqa: BLE001
                break
            done.append(f"popped {label} mode {_name(popped)}")
        now = stack()
        done += [f"{label} mode {_name(m)} removed (not restored)" for m in old if not any(m is x for x in now)]
    return done


def pop_to(depths: tuple[int, int]) -> list[str]:
    """Pop modes until the stacks are no deeper than ``depths`` (from :func:`depths` before an unchecked call,
    where the mode objects themselves were not recorded); returns what was done, as :func:`pop_new` does."""
    done: list[str] = []
    pop_dispatch = getattr(_C, "_pop_torch_dispatch_stack", None)
    for label, length, pop, depth in (
            ("dispatch", _DISPATCH_LEN, pop_dispatch and (lambda: pop_dispatch(None)), depths[0]),
            ("function", _FUNCTION_LEN, getattr(_C, "_pop_torch_function_stack", None), depths[1])):
        if length is None or pop is None:
            continue
        while length() > depth:
            try:
                done.append(f"popped {label} mode {_name(pop())}")
            except Exception:  # noqa: BLE001
                break
        if length() < depth:
            done.append(f"{depth - length()} {label} mode(s) removed (not restored)")
    return done
