"""Red-team candidates for issue 15 item 3 (side effects by structure): each changes process-global state that the
worker's older, name-based checks did not watch — a non-callable or namespace-object attribute, state without a
getter, the import system. Two or more spellings per class, none of them a literal name the static scan knows; the
tests switch the static scan off anyway (``gate_support.runtime_checks_only``), so that only the worker's structural
check (:mod:`tilesmith.gate.sidefx`) can catch them. Each takes a real Inductor CPU wrapper's source and
returns an edited source; ``at="import"`` edits run when the module is imported, ``at="call"`` ones inside ``call``.
"""

from __future__ import annotations

from tests.cheats.common import after_clear, module_code

_ONCE = "_done = globals().setdefault('_tilesmith_test_once', [])\nif not _done:\n    _done.append(1)\n"


def _in_call(src: str, code: str) -> str:
    """``code`` runs once, at the first call (a time-delayed side effect: nothing at import)."""
    body = (_ONCE + "".join(f"    {line}\n" for line in code.strip("\n").splitlines())).splitlines()
    return after_clear(src, body)


# -- a. attribute identities -----------------------------------------------------------------------------------
def extern_kernel_through_vars(src: str) -> str:
    """Replace ``extern_kernels.addmm`` (a namespace object, not a module: never watched before) through ``vars``."""
    return module_code(src, "_ek = vars(extern_kernels)\n_real = _ek['add' + 'mm']\n\n"
                            "def _slow(*a, **k):\n    return _real(*a, **k)\n\n_ek['add' + 'mm'] = _slow")


def inductor_constant_in_call(src: str) -> str:
    """Rebind a non-callable module attribute of Inductor's code cache (its lock timeout) at the first call."""
    return _in_call(src, "_cc = getattr(torch._inductor, 'code' + 'cache')\n"
                         "_cc.__dict__['LOCK_' + 'TIMEOUT'] = 1")


def ops_namespace_object(src: str) -> str:
    """Rebind an attribute of the ``torch.ops.aten`` namespace object the original calls through."""
    return module_code(src, "_ns = getattr(torch.ops, 'at' + 'en')\n_ns.__dict__['m' + 'm'] = _ns.bmm")


# -- b. state without a getter, and backend values --------------------------------------------------------------
def flush_denormal_at_import(src: str) -> str:
    return module_code(src, "getattr(torch, 'set_flush' + '_denormal')(True)")


def flush_denormal_in_call(src: str) -> str:
    return _in_call(src, "_f = vars(torch)['set_' + 'flush_denormal']\n_f(1 == 1)")


def onednn_off_at_import(src: str) -> str:
    return module_code(src, "setattr(torch.backends.mkldnn, 'ena' + 'bled', False)")


def onednn_off_in_call(src: str) -> str:
    return _in_call(src, "getattr(torch._C, '_set_mkl' + 'dnn_enabled')(False)")


def inductor_config_at_import(src: str) -> str:
    return module_code(src, "setattr(getattr(torch._inductor, 'con' + 'fig'), 'max_' + 'autotune', True)")


def dynamo_config_in_call(src: str) -> str:
    # Reached as an attribute: the import guard refuses ``__import__('torch._dynamo.config')`` (docs/gate.md, "Imports").
    return _in_call(src, "_cfg = getattr(torch._dynamo, 'con' + 'fig')\n"
                         "type(_cfg).__setattr__(_cfg, 'cache_size' + '_limit', 1)")


# -- c. the import system -------------------------------------------------------------------------------------
def sys_path_at_import(src: str, folder: str) -> str:
    """Put a folder outside the workspace first on ``sys.path`` (a helper module there could be swapped later)."""
    return module_code(src, f"getattr(os, 's' + 'ys').path.insert(0, {folder!r})")


def meta_path_in_call(src: str) -> str:
    return _in_call(src, "class _Finder:\n"
                         "    def find_spec(self, *a, **k):\n"
                         "        return None\n"
                         "getattr(torch, 's' + 'ys').meta_path.append(_Finder())")


def path_hooks_at_import(src: str) -> str:
    return module_code(src, "def _hook(entry):\n    raise ImportError(entry)\n\n"
                            "getattr(os, 's' + 'ys').path_hooks.insert(0, _hook)")


# -- d. memory growth ----------------------------------------------------------------------------------------
def hoard_tensor_at_import(src: str, mib: int = 512) -> str:
    """A large buffer allocated (and touched) at import, kept for the module's life."""
    return module_code(src, f"_HOARD = getattr(torch, 'on' + 'es')({mib} << 18)")


def hoard_bytes_at_import(src: str, mib: int = 512) -> str:
    return module_code(src, f"_HOARD = [bytearray(b'\\x01') * ({mib} << 20)]")


def leak_every_call(src: str, mib: int = 16) -> str:
    """Every call keeps a fresh buffer (and its inputs) alive: the resident set grows with the call count."""
    return after_clear(src, [f"globals().setdefault('_kept', []).append((torch.ones({mib} << 18), list(args)))"])
