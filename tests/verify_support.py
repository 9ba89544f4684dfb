"""Support for the production-verification tests: an accepting stand-in gate and candidate edits that turn an
Inductor wrapper into a time bomb, a thread starter or an RNG thief *in the process that imports it*.

The stand-in gate accepts every candidate at once (the real gate cannot see these bombs by construction: they are
honest for longer than any finite test); what is under test is what happens after install, in the user's process.
Every edit rebinds the module's ``call`` after Inductor's ``call = runner.call`` line, so the candidate keeps the
boxed-call ABI (it receives the argument list and Inductor's ``call`` clears it).
"""

from __future__ import annotations

import os
import textwrap

import pytest
import torch

_ANCHOR = "recursively_apply_fns = runner.recursively_apply_fns\n"


@pytest.fixture
def stand_in_gate(cpu_test_mode, monkeypatch):
    """CPU test mode with :class:`AcceptingGate` standing in for the gate (import it into a test module to use it)."""
    import tilesmith.gate

    monkeypatch.setattr(tilesmith.gate, "Gate", AcceptingGate)
    return cpu_test_mode


def tanh_matmul(x, w):
    """The function the verification tests compile: ``tanh(x @ w) + 1`` (x 32×64, w 64×16, fp32)."""
    return torch.tanh(x @ w) + 1.0


def tanh_matmul_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(32, 64, generator=g), torch.randn(64, 16, generator=g)


class AcceptingGate:
    """Stands in for :class:`tilesmith.gate.Gate`: every candidate accepted at a 2× host-clock speedup."""

    def __init__(self, problem, **_):
        self.problem = problem
        self.evaluated = []

    def _verdict(self, candidate):
        from tilesmith.records import Timing, Verdict

        timing = Timing(method="host_clock", calls_per_sample=1, baseline_ms=(2.0,) * 5, candidate_ms=(1.0,) * 5,
                        speedup=2.0, ci_low=1.9, ci_high=2.1)
        self.evaluated.append(candidate)
        return Verdict(accepted=True, status="accepted", reasons=("stand-in gate",), timing=timing,
                       confirmation=timing, evaluation_id=f"e{len(self.evaluated):04d}")

    def evaluate(self, candidate, incumbent=None):
        return self._verdict(candidate)

    def recheck(self, candidate):
        return self._verdict(candidate)

    def close(self):
        pass


def rebind_call(body: str, prelude: str = ""):
    """An edit that wraps Inductor's ``call``: ``body`` is the new ``call(args)``'s body, where ``_inner(args)``
    is Inductor's call; ``prelude`` is module-level code placed before it."""
    code = textwrap.dedent(prelude) + "\n_inner = call\n\ndef call(args):\n" + textwrap.indent(
        textwrap.dedent(body), "    ") + "\n"

    def edit(text: str) -> str:
        assert _ANCHOR in text, "no 'recursively_apply_fns = runner...' line in the wrapper"
        return text.replace(_ANCHOR, _ANCHOR + code, 1)

    return edit


def honest():
    """A harmless rebinding (changes the text, not the results)."""
    return rebind_call("return _inner(args)")


def count_bomb_closure(limit: int):
    """Honest for ``limit`` calls after import (a counter in a closure), then every output is ``0.5·x + 1``."""
    return rebind_call("return _tick(args)", prelude=f"""
        def _make(inner_of):
            n = 0
            def tick(args):
                nonlocal n
                n += 1
                out = inner_of()(args)
                if n > {limit}:
                    out = tuple(t * 0.5 + 1.0 for t in out)
                return out
            return tick
        _tick = _make(lambda: _inner)
        """)


def count_bomb_itertools(limit: int):
    """The same bomb, counting with ``itertools.count`` at module level and corrupting one element in place."""
    return rebind_call(f"""
        out = _inner(args)
        if next(_calls) >= {limit}:
            out[0].view(-1)[0].add_(1000.0)
        return out
        """, prelude="import itertools\n_calls = itertools.count()\n")


def time_bomb_monotonic(seconds: float, fuse_at: int = 3):
    """Honest until ``seconds`` (``time.monotonic``) after its call ``fuse_at`` since import, then the outputs are
    scaled by 3. The fuse is lit on a call, not at import, so a slow machine between import and the first checked
    calls cannot set the bomb off early (fresh-clone CI once saw a 0.3 s fuse lit at import go off on call 2)."""
    return rebind_call(f"""
        _n[0] += 1
        if _n[0] == {fuse_at}:
            _born[0] = time.monotonic()
        out = _inner(args)
        if _born[0] is not None and time.monotonic() - _born[0] > {seconds}:
            for t in out:
                t.mul_(3.0)
        return out
        """, prelude="import time\n_n = [0]\n_born = [None]\n")


def time_bomb_perf_counter(seconds: float, fuse_at: int = 3):
    """The same bomb keyed on ``time.perf_counter`` with the fuse time stored on a function attribute and the
    outputs replaced by zeros of the same layout."""
    return rebind_call(f"""
        _perf.calls += 1
        if _perf.calls == {fuse_at}:
            _perf.born = _perf()
        out = _inner(args)
        if _perf.born is not None and _perf() - _perf.born > {seconds}:
            out = tuple(torch.zeros_like(t) for t in out)
        return out
        """, prelude="from time import perf_counter as _perf_impl\n\ndef _perf():\n    return _perf_impl()\n\n"
                     "_perf.calls = 0\n_perf.born = None\n")


def thread_starter_threading(at_call: int, seconds: float = 4.0):
    """Results always right; at call ``at_call`` after import it starts a ``threading`` thread that just sleeps."""
    return rebind_call(f"""
        _n[0] += 1
        if _n[0] == {at_call}:
            threading.Thread(target=time.sleep, args=({seconds},), daemon=True).start()
        return _inner(args)
        """, prelude="import threading, time\n_n = [0]\n")


def thread_starter_low_level(at_call: int, seconds: float = 4.0):
    """The same through ``_thread.start_new_thread`` (invisible to ``threading.enumerate``)."""
    return rebind_call(f"""
        _n[0] += 1
        if _n[0] == {at_call}:
            _thread.start_new_thread(time.sleep, ({seconds},))
        return _inner(args)
        """, prelude="import _thread, time\n_n = [0]\n")


def rng_thief(at_call: int):
    """Results always right; from call ``at_call`` on it also draws one random number from the CPU generator
    after computing them (so only the generator's state, and every later random number of the user, differ)."""
    return rebind_call(f"""
        _n[0] += 1
        out = _inner(args)
        if _n[0] >= {at_call}:
            torch.rand(1)
        return out
        """, prelude="_n = [0]\n")


def raises_after(limit: int):
    """Raises ``RuntimeError`` on every call after ``limit`` calls (after taking its arguments)."""
    return rebind_call(f"""
        _n[0] += 1
        if _n[0] > {limit}:
            args.clear()
            raise RuntimeError("kernel launch failed (injected)")
        return _inner(args)
        """, prelude="_n = [0]\n")


def precision_bomb(limit: int):
    """Honest for ``limit`` calls, then every output rounded through bfloat16 (a silent precision downgrade)."""
    return rebind_call(f"""
        _n[0] += 1
        out = _inner(args)
        if _n[0] > {limit}:
            for t in out:
                t.copy_(t.bfloat16().float())
        return out
        """, prelude="_n = [0]\n")


def extern_kernel_patcher(at_call: int):
    """Results always right; at call ``at_call`` it replaces ``extern_kernels.mm`` (the matmul the original
    wrapper calls) by a pass-through, through the namespace's ``__dict__`` (issue 15: a slower library function
    for every later graph of the user). :func:`restore_process_state` undoes it."""
    return rebind_call(f"""
        _n[0] += 1
        if _n[0] == {at_call}:
            _space = vars(extern_kernels)
            _real = _space['m' + 'm']
            _space['m' + 'm'] = lambda *a, **k: _real(*a, **k)
        return _inner(args)
        """, prelude="_n = [0]\n")


def backend_flag_flipper(at_call: int):
    """Results always right; at call ``at_call`` it switches oneDNN off for the rest of the process
    (``torch.backends.mkldnn.enabled``, a property)."""
    return rebind_call(f"""
        _n[0] += 1
        if _n[0] == {at_call}:
            setattr(torch.backends.mkldnn, 'en' + 'abled', False)
        return _inner(args)
        """, prelude="_n = [0]\n")


def flush_denormal_flipper(at_call: int):
    """Results right on these inputs; at call ``at_call`` it turns flush-to-zero on (no getter: the probe)."""
    return rebind_call(f"""
        _n[0] += 1
        if _n[0] == {at_call}:
            torch.set_flush_denormal(True)
        return _inner(args)
        """, prelude="_n = [0]\n")


def random_reseeder(at_call: int):
    """Results always right; from call ``at_call`` on it reseeds Python's global ``random`` on every call (the
    user's ``random.random()`` then repeats one value)."""
    return rebind_call(f"""
        _n[0] += 1
        if _n[0] >= {at_call}:
            _r.seed(1234)
        return _inner(args)
        """, prelude="import random as _r\n_n = [0]\n")


def random_drawer(at_call: int):
    """Results always right; at call ``at_call`` it draws from Python's global ``random`` (the user's stream
    moves on)."""
    return rebind_call(f"""
        _n[0] += 1
        if _n[0] == {at_call}:
            getattr(__import__('ran' + 'dom'), 'getrandbits')(64)
        return _inner(args)
        """, prelude="_n = [0]\n")


def precision_setter(at_call: int):
    """Results right on these inputs; at call ``at_call`` it sets the float32 matmul precision to "medium" (a
    setter whose getter the user may use too: only a change while the wrapper runs is blamed on it)."""
    return rebind_call(f"""
        _n[0] += 1
        if _n[0] == {at_call}:
            torch.set_float32_matmul_precision('med' + 'ium')
        return _inner(args)
        """, prelude="_n = [0]\n")


def import_time_state(prelude: str):
    """Honest results; ``prelude`` (module-level code, run once at import) changes process-global state."""
    return rebind_call("return _inner(args)", prelude=prelude)


def restore_process_state():
    """Undo what the three state changers above leave in the test process (a context manager)."""
    import contextlib

    import torch
    from torch._inductor.select_algorithm import extern_kernels

    @contextlib.contextmanager
    def manager():
        space, mm, mkldnn = vars(extern_kernels), extern_kernels.mm, torch.backends.mkldnn.enabled
        try:
            yield
        finally:
            space["mm"] = mm
            torch.backends.mkldnn.enabled = mkldnn
            torch.set_flush_denormal(False)

    return manager()


# -- production audit (tests/test_prod_audit.py): wrappers that act only outside the gate -----------------------
#: How the 2026-12-05 red team told the gate from the user's process: the candidate's ``__file__`` (and the gate
#: worker's working directory) contain ``tilesmith-gate-``; reading it raises no audit event, and the static scan
#: does not refuse ``__file__``.
SNIFF = "import os as _os\n_IN_GATE = 'tilesmith-gate-' in __file__\n_n = [0]\n"


def outside_gate(code: str, at_call: int = 1, *, after: bool = False, swallow: bool = False):
    """Honest results; on call ``at_call`` after import, and only outside the gate, it runs ``code`` (before
    Inductor's call, or after it with ``after``; inside ``try/except Exception: pass`` with ``swallow``)."""
    action = textwrap.dedent(code).strip("\n")
    if swallow:
        action = "try:\n" + textwrap.indent(action, "    ") + "\nexcept Exception:\n    pass"
    guarded = f"if not _IN_GATE and _n[0] == {at_call}:\n" + textwrap.indent(action, "    ")
    body = "_n[0] += 1\n" + ("out = _inner(args)\n" + guarded + "\nreturn out" if after else
                             guarded + "\nreturn _inner(args)")
    return rebind_call(body, prelude=SNIFF)


def outside_gate_at_import(code: str):
    """Honest results; ``code`` runs at import, only outside the gate."""
    return rebind_call("return _inner(args)", prelude=SNIFF + "if not _IN_GATE:\n" +
                       textwrap.indent(textwrap.dedent(code).strip("\n"), "    ") + "\n")


def compile_cmd(marker: str) -> str:
    """The red team's A7: a shell command through Inductor's own compiler runner (``sh`` is not a compiler)."""
    return (f"from torch._inductor.cpp_builder import run_compile_cmd\n"
            f"run_compile_cmd(\"sh -c 'touch {marker}'\", None)\n")


def file_handler(path: str) -> str:
    """The red team's A7: a file written through ``logging.FileHandler`` (opened at construction)."""
    return (f"import logging as _lg\n_h = _lg.FileHandler({path!r})\n"
            f"_h.emit(_lg.makeLogRecord({{'msg': 'x'}}))\n")


def keep_input_slices(mib: int):
    """Results always right; every call keeps a fresh ``mib`` MiB buffer and a slice of its first input alive (the
    red team's A1 keeps ``x[:16].clone()``, larger inputs)."""
    return rebind_call(f"""
        _keep.append((args[0][:16].clone(), torch.empty({mib} << 18).fill_(1.0)))
        return _inner(args)
        """, prelude="_keep = []\n")


def allocates_at_first_calls(calls: int, mib: int):
    """Honest, like a CUDA-graph wrapper: its first ``calls`` calls each keep one ``mib`` MiB static buffer (its
    pool growing during the first captures), later calls keep nothing."""
    return rebind_call(f"""
        if len(_static) < {calls}:
            _static.append(torch.empty({mib} << 18).fill_(0.0))
        return _inner(args)
        """, prelude="_static = []\n")


def pool_task(seconds: float, at_import: bool = False):
    """Results always right; submits ``time.sleep(seconds)`` to Inductor's compile thread pool, at import or on its
    first call after import, only outside the gate (the red team's A8b used a never-ending task)."""
    code = ("import time as _t\nfrom torch._inductor.async_compile import AsyncCompile as _AC\n"
            f"_AC.pool().submit(_t.sleep, {seconds})\n")
    return outside_gate_at_import(code) if at_import else outside_gate(code, 1)


def fresh_cpp_kernel(tag: str):
    """Honest, and its C++ kernels are new to Inductor's cache (a comment ``tag`` in each kernel's source): importing
    it compiles them (``g++``, lock files, new files in the cache), as an optimized wrapper's import does."""
    anchor = "#include <torch/csrc/inductor/cpp_prefix.h>\n"

    def edit(text: str) -> str:
        assert anchor in text, "no C++ kernel in the wrapper"
        return honest()(text.replace(anchor, anchor + f"// {tag}\n"))

    return edit


# -- red team round 2 (R2, R5-R7): compilers that run programs, code that runs outside the wrapper's calls ----------
def compiler_cmd_line(kind: str, marker: str, folder: str) -> str:
    """A compiler command line for ``run_compile_cmd`` that makes the compiler (or what poses as one) create
    ``marker``: ``wrapper`` (``g++ -wrapper /bin/sh,-c,...``: the red team's R2), ``prefix`` (``-B<folder>``, where
    ``folder`` holds a ``cc1plus`` script), ``named`` (an executable ``evil-g++`` in ``folder``), ``exact`` (an
    executable named exactly ``g++`` in ``folder``). :func:`fake_tools` writes the scripts."""
    out = os.path.join(folder, "o.o")
    return {"wrapper": f"g++ -wrapper '/bin/sh,-c,touch {marker}' -x c++ -c /dev/null -o {out}",
            "prefix": f"g++ -B{folder}/ -x c++ -c /dev/null -o {out}",
            "named": f"{folder}/evil-g++ -c x.cpp",
            "exact": f"{folder}/g++ -c x.cpp"}[kind]


def fake_tools(folder: str, marker: str) -> None:
    """Scripts in ``folder`` that create ``marker`` when run: ``cc1plus`` (found by ``g++ -B``), ``evil-g++``, ``g++``."""
    for name in ("cc1plus", "evil-g++", "g++"):
        path = os.path.join(folder, name)
        with open(path, "w") as handle:
            handle.write(f"#!/bin/sh\ntouch {marker}\n")
        os.chmod(path, 0o755)


def run_compiler(cmd_line: str) -> str:
    """Module or call code: ``cmd_line`` through Inductor's own compiler runner (errors of the compiler ignored)."""
    return ("from torch._inductor.cpp_builder import run_compile_cmd as _rcc\n"
            f"try:\n    _rcc({cmd_line!r}, None)\nexcept Exception as _e:\n"
            "    if isinstance(_e, PermissionError):\n        raise\n")


def other_thread(how: str, marker: str):
    """Honest results; at its first call outside the gate it has code of its own write ``marker`` on another thread
    and waits for it within the call (the red team's R6): ``executor`` (its own ``ThreadPoolExecutor``, ``.result()``),
    ``event`` (a ``threading.Thread`` started at import, waiting on an ``Event`` the call sets), ``inductor_pool``
    (Inductor's compile pool, whose thread already exists: no thread is started)."""
    write = f"def _write():\n    open({marker!r}, 'w').write('x')\n"
    if how == "event":
        prelude = (write + "import threading as _th\n_go, _done = _th.Event(), _th.Event()\n"
                   "def _waiter():\n    _go.wait()\n    try:\n        _write()\n    finally:\n        _done.set()\n"
                   "if not _IN_GATE:\n    _th.Thread(target=_waiter, daemon=True).start()\n")
        return rebind_call("_n[0] += 1\nif not _IN_GATE and _n[0] == 1:\n    _go.set()\n    _done.wait(10)\n"
                           "return _inner(args)", prelude=SNIFF + prelude)
    submit = {"executor": "from concurrent.futures import ThreadPoolExecutor as _TPE\n"
                          "with _TPE(1) as _ex:\n    _ex.submit(_write).result()\n",
              "inductor_pool": "from torch._inductor.async_compile import AsyncCompile as _AC\n"
                               "_AC.pool().submit(_write).result()\n"}[how]
    return rebind_call(f"_n[0] += 1\nif not _IN_GATE and _n[0] == 1:\n" + textwrap.indent(submit, "    ")
                       + "return _inner(args)", prelude=SNIFF + write)


def later_hook(how: str, marker: str):
    """Honest results; at import, outside the gate, it registers code of its own that runs later, outside its calls,
    and writes ``marker`` (the red team's R7): ``logging`` (a ``logging.Handler`` subclass
    on the root logger, its ``emit`` writes), ``warnings`` (``warnings.showwarning`` replaced)."""
    code = {"logging": ("import logging as _lg\nclass _H(_lg.Handler):\n"
                        f"    def emit(self, record):\n        open({marker!r}, 'w').write(record.getMessage())\n"
                        "_lg.getLogger().addHandler(_H())\n"),
            "warnings": ("import warnings as _w\n"
                         f"def _show(*a, **k):\n    open({marker!r}, 'w').write(str(a[0]))\n"
                         "_w.showwarning = _show\n")}[how]
    return outside_gate_at_import(code)
