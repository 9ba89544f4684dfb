"""Red team of 2026-12-05, R3/R4/R7, in production verification (tilesmith/install/verify.py): an installed wrapper
that later pushes a dispatch mode (R4, a time bomb after N calls: the original's shadow ran under the same mode,
so the comparison passed), replaces a torch class's method (R3) or an interpreter hook (R7). Two spellings each;
the stand-in gate accepts every candidate (tests/verify_support.py). Gate side: tests/test_gate_hooks.py.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

from tests import verify_support as vs
from tests.test_verify import _compile, _drive, _failure, _verifier

stand_in_gate = vs.stand_in_gate

_MODE = """
import sys as _sys
_pd = _sys.modules['torch.utils._python_' + 'dispatch']
class _Mode(_pd.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))
_n = [0]
"""


def dispatch_mode_bomb(at_call: int):
    """Honest results; at call ``at_call`` it enters a dispatch mode after Inductor's call and never leaves it."""
    return vs.rebind_call(f"""
        _n[0] += 1
        out = _inner(args)
        if _n[0] == {at_call}:
            _Mode().__enter__()
        return out
        """, prelude=_MODE)


def function_mode_bomb(at_call: int):
    """The same with a torch-function mode pushed through the C stack's push function, before Inductor's call."""
    return vs.rebind_call(f"""
        _n[0] += 1
        if _n[0] == {at_call}:
            getattr(torch._C, '_push_on_torch_' + 'function_stack')(_F())
        return _inner(args)
        """, prelude="import torch.overrides as _ov\nclass _F(_ov.TorchFunctionMode):\n"
                     "    def __torch_function__(self, func, types, args=(), kwargs=None):\n"
                     "        return func(*args, **(kwargs or {}))\n_n = [0]\n")


def linear_patcher(at_call: int, how: str):
    """Honest results; at call ``at_call`` it replaces a torch class's method (R3)."""
    store = {"call": "(lambda m: m)(torch.nn).Linear.forward = lambda self, x: x",
             "type_setattr": "type.__setattr__(__import__('sys').modules['torch.nn.modules.' + 'module'].Module, "
                             "'__call__', lambda self, *a, **k: None)"}[how]
    return vs.rebind_call(f"""
        _n[0] += 1
        if _n[0] == {at_call}:
            {store}
        return _inner(args)
        """, prelude="_n = [0]\n")


def hook_replacer(at_call: int, how: str):
    """Honest results; at call ``at_call`` it replaces an interpreter hook (R7)."""
    store = {"showwarning": "setattr(__import__('sys').modules['warn' + 'ings'], 'show' + 'warning', "
                            "lambda *a, **k: None)",
             "excepthook": "vars(__import__('sys'))['except' + 'hook'] = lambda *a: None"}[how]
    return vs.rebind_call(f"""
        _n[0] += 1
        if _n[0] == {at_call}:
            {store}
        return _inner(args)
        """, prelude="_n = [0]\n")


def _depths():
    """The thread's (dispatch, function) mode-stack depths, read without tilesmith (the tests then run, and fail,
    with the production change reverted)."""
    return torch._C._len_torch_dispatch_stack(), torch._C._len_torch_function_stack()


def _pop_to(depths):
    while torch._C._len_torch_dispatch_stack() > depths[0]:
        torch._C._pop_torch_dispatch_stack(None)
    while torch._C._len_torch_function_stack() > depths[1]:
        torch._C._pop_torch_function_stack()


@pytest.fixture
def restored():
    """Undo what the wrappers above leave in the test process."""
    forward, call = torch.nn.Linear.forward, torch.nn.Module.__call__
    show, hook = warnings.showwarning, sys.excepthook
    depths = _depths()
    yield depths
    torch.nn.Linear.forward, torch.nn.Module.__call__ = forward, call
    warnings.showwarning, sys.excepthook = show, hook
    _pop_to(depths)


def _uninstalled(compiled, *keys: str):
    handle, _ = _verifier(compiled)
    assert handle.state == "uninstalled"
    diag = _failure(compiled)
    for key in keys:
        assert key in diag.message, diag.message
    assert "quarantined" in diag.message and handle.key[:8] in diag.message
    return diag


@pytest.mark.parametrize("bomb, key", [(dispatch_mode_bomb, "modes.dispatch"), (function_mode_bomb, "modes.function")],
                         ids=["dispatch-mode", "function-mode"])
def test_r4_mode_pushed_on_a_checked_call_fails_and_is_popped(stand_in_gate, monkeypatch, restored, bomb, key):
    compiled, _ = _compile(bomb(3), "first=10,every=off,interval=off,threads=off", monkeypatch)
    errors = _drive(compiled, 1 + 5)
    assert max(errors) < 1e-5
    _uninstalled(compiled, "call 3 since install", "global_state", key)
    assert _depths() == restored  # what the wrapper pushed is gone


@pytest.mark.parametrize("bomb", [dispatch_mode_bomb, function_mode_bomb], ids=["dispatch-mode", "function-mode"])
def test_r4_time_bomb_on_an_unchecked_call_fails_at_once_and_is_popped(stand_in_gate, monkeypatch, restored, bomb):
    compiled, _ = _compile(bomb(4), "first=1,every=off,interval=off,threads=off", monkeypatch)
    errors = _drive(compiled, 1 + 6)
    assert max(errors) < 1e-5
    diag = _uninstalled(compiled, "unchecked call 4", "mode")
    assert "popped" in diag.message
    assert _depths() == restored


def test_r4_mode_check_is_off_with_the_state_policy(stand_in_gate, monkeypatch, restored):
    compiled, _ = _compile(dispatch_mode_bomb(2), "first=1,every=off,interval=off,state=off", monkeypatch)
    _drive(compiled, 1 + 3)
    assert _verifier(compiled)[0].state != "uninstalled"


@pytest.mark.parametrize("how, key", [("call", "torch.nn.modules.linear.Linear.forward"),
                                      ("type_setattr", "torch.nn.modules.module.Module.__call__")])
def test_r3_torch_class_patched_on_an_unchecked_call_is_caught_at_the_next_check(stand_in_gate, monkeypatch,
                                                                                  restored, how, key):
    compiled, _ = _compile(linear_patcher(2, how), "first=1,every=off,interval=1.0,threads=off", monkeypatch)
    _drive(compiled, 1 + 3, pause_before=1 + 2, pause_s=1.5)  # the class digest is compared at most once a second
    _uninstalled(compiled, "call 3 since install", key)


@pytest.mark.parametrize("how, key", [("showwarning", "warnings.showwarning"), ("excepthook", "sys.excepthook")])
def test_r7_hook_replaced_on_a_checked_call_fails_and_is_put_back(stand_in_gate, monkeypatch, restored, how, key):
    show, hook = warnings.showwarning, sys.excepthook
    compiled, _ = _compile(hook_replacer(2, how), "first=10,every=off,interval=off,threads=off", monkeypatch)
    _drive(compiled, 1 + 3)
    _uninstalled(compiled, "call 2 since install", key)
    assert warnings.showwarning is show and sys.excepthook is hook


@pytest.mark.parametrize("how, key", [("showwarning", "warnings.showwarning"), ("excepthook", "sys.excepthook")])
def test_r7_hook_replaced_on_an_unchecked_call_is_caught_at_the_next_check(stand_in_gate, monkeypatch, restored,
                                                                           how, key):
    compiled, _ = _compile(hook_replacer(2, how), "first=1,every=off,interval=1.0,threads=off", monkeypatch)
    _drive(compiled, 1 + 3, pause_before=1 + 2, pause_s=1.5)
    _uninstalled(compiled, "call 3 since install", key)
