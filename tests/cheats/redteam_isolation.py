"""Red-team candidates against the worker's isolation (copied from the red team's reproductions, findings
1, 3, 4 and 10, plus one candidate per audit check id). Each takes a real Inductor CPU wrapper's source and
returns an edited source. Several spell their forbidden calls so that the static scan of the time did
not see them; the audit tests bypass the static scan anyway, to test the audit hook on its own.
"""

from __future__ import annotations

import re

from tests.cheats.common import after_clear, module_code

#: ``sys`` reached as an attribute of torch and not bound as a global (the import guard refuses a module global
#: that the original does not import: docs/gate.md, "Imports"; these candidates exercise the checks behind it).
_SYS = 'getattr(torch, "s" + "ys")'


def tamper_original_in_cache(src: str, sleep_s: float = 0.0005) -> str:
    """Finding 1 (t10_cache_poison): at import, overwrite the Inductor cache file of the ORIGINAL wrapper
    (found with ``PyCodeCache.write(original)``) with a slowed-down copy, using only codecache helpers."""
    tampered = src + (f"\n\nimport time as _tt\n_real_call = call\n\ndef call(args):\n"
                      f"    _tt.sleep({sleep_s})\n    return _real_call(args)\n\nTAMPERED_BY_CANDIDATE = True\n")
    code = (f"_ORIG = {src!r}\n_TAMPERED = {tampered!r}\n"
            "_key, _path = torch._inductor.codecache.PyCodeCache.write(_ORIG)\n"
            "torch._inductor.codecache.write_atomic(_path, _TAMPERED)")
    return module_code(src, code)


def write_into_shared_cache(src: str, cache_dir: str) -> str:
    """Finding 1, second route: write a file straight into a shared Inductor cache folder (the user's)."""
    return module_code(src, f"torch._inductor.codecache.write_atomic({cache_dir!r} + '/zz/poison.py', 'x = 1')")


def spot_aware(src: str) -> str:
    """Finding 3 (t3_introspection spot): walk the frames (``sys._getframe`` reached through
    ``getattr(torch, "s"+"ys")``) up to the worker's timing loop and skip the work when nothing will be
    checked. Here it skips the work whenever a frame of a timing function is on the stack."""
    src = module_code(src, '''
def _in_timing():
    f = getattr(''' + _SYS + ''', "_get" + "frame")(1)
    while f is not None:
        if "tim" in getattr(f, "f_co" + "de").co_name:
            return True
        f = getattr(f, "f_ba" + "ck")
    return False''')
    m = re.search(r"^\s*(buf\d+) = (empty_strided_cpu\(.*\))\s*$", src.split("args.clear()", 1)[1], re.M)
    assert m is not None
    return after_clear(src, ["if _in_timing():", f"    return ({m.group(2)}, )"])


def traceback_frame_walk(src: str) -> str:
    """Finding 3 without ``sys``: get a frame from an exception's traceback (``tb_frame``) and walk it."""
    return after_clear(src, ["try:", "    raise KeyError(0)", "except KeyError as _e:",
                             "    _f = _e.__traceback__.tb_frame.f_back",
                             "    _names = [_f.f_code.co_name]"])


def gate_detect(src: str) -> str:
    """Finding 4 (t3_introspection detect): True inside the gate worker (its harness module is imported).
    Reading ``sys.modules`` raises no audit event: only the static scan can see this spelling."""
    return module_code(src, '_IN_GATE = "tilesmith.gate.worker.core" in ' + _SYS + '.modules')


def read_file_into_verdict(src: str, path: str) -> str:
    """Finding 10 (t11_file_read): read a text file with numpy under an alias and raise its contents, so
    they would come back in the verdict's reasons (which the LLM agent reads)."""
    # numpy reached as an attribute of torch.storage: the import guard refuses ``import numpy`` (docs/gate.md,
    # "Imports"), and this candidate exercises the audit hook behind it.
    return module_code(src, f"_loadtxt = torch.storage.np.loadtxt\nraise ValueError('leak: ' + ' '.join(_loadtxt("
                            f"{path!r}, dtype=str, ndmin=1).tolist()))")


def raise_long_text(src: str, text: str) -> str:
    """An exception message with control characters and a long body (redaction, truncation)."""
    return module_code(src, f"raise ValueError({text!r})")


# -- one candidate per audit check (at import time; the static scan is bypassed in those tests) --------
def gc_walk(src: str) -> str:
    return module_code(src, "import gc as _g\n_objs = len(_g.get_objects())")


def spawn_process(src: str) -> str:
    return module_code(src, "import subprocess as _sp\n_sp.run(['true'], check=False)")


def open_socket(src: str) -> str:
    return module_code(src, "import socket as _so\n_so.socket().close()")


def ctypes_call(src: str) -> str:
    return module_code(src, "import ctypes as _ct\n_ct.CDLL(None).getpid()")


def set_trace(src: str) -> str:
    return module_code(src, "import sys as _s\n_s.settrace(lambda *a: None)\n_s.settrace(None)")


def dynamic_code(src: str) -> str:
    return module_code(src, "_ns = {}\nexec('def f():\\n    return 1', _ns)")
