"""Red-team candidates of 2026-12-05 that the gate installed (R3, R4, R7), each in two or more spellings.

- R3: a method of a torch class replaced through a path the static scan does not follow (a store through a function
  call's return value, ``sys.modules``, ``type.__setattr__``), and a module-level hook table of torch filled;
- R7: a hook table of the interpreter replaced (``warnings.showwarning``, ``sys.excepthook``, exit callbacks, logging
  handlers, warning filters);
- R4: a ``TorchDispatchMode`` / ``TorchFunctionMode`` pushed and never popped, or saved-tensors default hooks pushed.

Each takes a real Inductor CPU wrapper's source and returns an edited source (at import: before ``class Runner``;
in a call: once, at the first call, right after ``args.clear()``). Nothing is a literal name the static scan knows;
the tests switch the scan off anyway (``gate_support.runtime_checks_only``).
"""

from __future__ import annotations

from tests.cheats.common import module_code
from tests.cheats.redteam_sidefx import _in_call

_SYS = "_sys = getattr(os, 's' + 'ys')\n"
_PASS = "def _f(self, *a, **k):\n    return a[0] if a else None\n"


# -- R3: a torch class's attribute, a torch hook table -----------------------------------------------------------
def linear_forward_through_call(src: str) -> str:
    """The red team's spelling: ``_id(torch.nn).Linear.forward = f`` (a store through a call's return value)."""
    return module_code(src, "def _id(m):\n    return m\n\n" + _PASS + "\n_id(torch.nn).Linear.forward = _f")


def module_call_type_setattr_in_call(src: str) -> str:
    """``torch.nn.Module.__call__`` replaced with ``type.__setattr__`` on a class found through ``sys.modules``."""
    return _in_call(src, _SYS + "_cls = _sys.modules['torch.nn.modules.' + 'module'].__dict__['Mod' + 'ule']\n"
                               "_real = _cls.__call__\n"
                               "type.__setattr__(_cls, '__ca' + 'll__', lambda self, *a, **k: _real(self, *a, **k))")


def global_forward_hook_table(src: str) -> str:
    """A global module forward hook put straight into torch's hook dict (reached through ``sys.modules``)."""
    return module_code(src, _SYS + "_tab = vars(_sys.modules['torch.nn.modules.' + 'module'])\n"
                                   "_tab['_global_forward_' + 'hooks'][987654] = lambda m, i, o: None")


def global_forward_hook_registered_in_call(src: str) -> str:
    """The same table filled through torch's own registration function, at the first call."""
    return _in_call(src, "_reg = getattr(torch.nn.modules.module, 'register_module_' + 'forward_hook')\n"
                         "_reg(lambda m, i, o: None)")


# -- R7: the interpreter's hook tables -----------------------------------------------------------------------------
def showwarning_at_import(src: str) -> str:
    """The red team's R7: ``warnings.showwarning`` replaced (through ``sys.modules``)."""
    return module_code(src, _SYS + "_w = _sys.modules['warn' + 'ings']\n_old = _w.showwarning\n"
                                   "setattr(_w, 'show' + 'warning', lambda *a, **k: _old(*a, **k))")


def excepthook_in_call(src: str) -> str:
    return _in_call(src, _SYS + "setattr(_sys, 'except' + 'hook', lambda *a: None)")


def atexit_callback_at_import(src: str) -> str:
    return module_code(src, _SYS + "_sys.modules['at' + 'exit'].register(lambda: None)")


def logging_handler_in_call(src: str) -> str:
    return _in_call(src, _SYS + "_lg = _sys.modules['log' + 'ging']\n"
                               "_lg.getLogger('torch').addHandler(_lg.NullHandler())")


def warning_filter_at_import(src: str) -> str:
    return module_code(src, _SYS + "_sys.modules['warn' + 'ings'].simplefilter('ignore')")


def threading_excepthook_in_call(src: str) -> str:
    return _in_call(src, _SYS + "vars(_sys.modules['thread' + 'ing'])['except' + 'hook'] = lambda a: None")


# -- R4: interposition left on the thread's stacks ---------------------------------------------------------------
_MODE = ("_pd = getattr(os, 's' + 'ys').modules['torch.utils._python_' + 'dispatch']\n"
         "class _Mode(_pd.TorchDispatchMode):\n"
         "    def __torch_dispatch__(self, func, types, args=(), kwargs=None):\n"
         "        return func(*args, **(kwargs or {}))\n")


def dispatch_mode_in_call(src: str) -> str:
    """A dispatch mode entered at the first call and never left (the red team's R4, at call 1 instead of 3000)."""
    return _in_call(src, _MODE + "_Mode().__enter__()")


def function_mode_at_import(src: str) -> str:
    """A torch-function mode pushed at import through the C stack's own push function."""
    return module_code(src, "_ov = getattr(torch, 'over' + 'rides')\n"
                            "class _FMode(_ov.TorchFunctionMode):\n"
                            "    def __torch_function__(self, func, types, args=(), kwargs=None):\n"
                            "        return func(*args, **(kwargs or {}))\n"
                            "getattr(torch._C, '_push_on_torch_' + 'function_stack')(_FMode())")


def saved_tensors_hooks_in_call(src: str) -> str:
    return _in_call(src, "getattr(torch._C._autograd, '_push_saved_tensors_' + 'default_hooks')"
                         "(lambda t: t, lambda t: t)")
