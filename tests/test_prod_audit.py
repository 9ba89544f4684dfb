"""The gate worker's audit rules, the compile-pool look and the leak rule in the user's process (CPU test mode).

The red team of 2026-12-05 installed wrappers that behaved under the gate and, in the user's process only, ran
``sh`` through ``torch._inductor.cpp_builder.run_compile_cmd``, wrote a file through ``logging.FileHandler``, left a
task in Inductor's compile pool, and kept a slice of every input alive (docs/gate.md, "Threat model"). Most tests
install through the stand-in gate of tests/verify_support.py (every candidate accepted): the subject is what
happens after install. One test goes through the real gate, which must not see the sniffing candidate's action.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time

import pytest
import torch

import tilesmith
from tests import verify_support as vs
from tests.models import MulSum, has_mulsum_loop, mm_instead_of_loop
from tests.scripted import ScriptedFactory, comment
from tilesmith.install import audit, leaks, verify


stand_in_gate = vs.stand_in_gate
_fn = vs.tanh_matmul
_inputs = vs.tanh_matmul_inputs


def _compile(edit, setting, monkeypatch):
    monkeypatch.setenv("TILESMITH_VERIFY", setting)
    return tilesmith.compile(_fn, example_inputs=_inputs(0), agent_model=ScriptedFactory(edits=[edit]))


def _drive(compiled, calls):
    """Call ``compiled`` and plain ``_fn`` ``calls`` times on fresh inputs; the max error of every call."""
    errors = []
    for i in range(calls):
        x, w = _inputs(i + 1)
        errors.append(float((compiled(x, w) - _fn(x, w)).abs().max()))
    return errors


def _handle(compiled):
    (handle,) = tilesmith.api._run_of(compiled).handles
    return handle


def _failure(compiled):
    (diag,) = [d for d in tilesmith.diagnostics(compiled) if d.kind == "verification_failed"]
    return diag


def _quarantined(root):
    from tilesmith.cache import ArtifactStore

    return ArtifactStore(root).quarantined()


# -- events refused on production calls --------------------------------------------------------------------------
def test_shell_command_through_inductors_compiler_runner_is_blocked_and_uninstalls(stand_in_gate, monkeypatch,
                                                                                  tmp_path):
    marker = tmp_path / "ran"
    compiled = _compile(vs.outside_gate(vs.compile_cmd(str(marker))), "first=8,every=off,interval=off", monkeypatch)
    errors = _drive(compiled, 1 + 3)
    assert max(errors) < 1e-5, errors  # the caught call returned the original's outputs
    assert not marker.exists(), "the command ran in the user's process"
    handle = _handle(compiled)
    assert handle.state == "uninstalled" and handle.compiled.current_callable is handle.original
    message = _failure(compiled).message
    assert handle.key[:8] in message and "call 1 since install" in message
    assert "audit_process: subprocess.Popen of 'sh'" in message and "quarantined" in message, message
    assert [r.key for r in _quarantined(stand_in_gate)] == [handle.key]


@pytest.mark.parametrize("how", ["file_handler", "open"])
def test_file_written_on_a_checked_call_is_blocked_and_uninstalls(stand_in_gate, monkeypatch, tmp_path, how):
    path = tmp_path / "exfil.log"
    code = vs.file_handler(str(path)) if how == "file_handler" else f"open({str(path)!r}, 'w').write('x')\n"
    compiled = _compile(vs.outside_gate(code, 2), "first=8,every=off,interval=off", monkeypatch)
    errors = _drive(compiled, 1 + 4)
    assert max(errors) < 1e-5 and not path.exists()
    message = _failure(compiled).message
    assert "call 2 since install" in message and f"audit_file_write: open for writing '{path}'" in message, message


def test_os_system_on_an_unchecked_call_is_blocked_and_the_original_serves_it(stand_in_gate, monkeypatch, tmp_path):
    marker = tmp_path / "ran"
    compiled = _compile(vs.outside_gate(f"_os.system('touch {marker}')\n", 3), "first=1,every=off,interval=off",
                        monkeypatch)
    errors = _drive(compiled, 1 + 5)
    handle = _handle(compiled)
    assert max(errors) < 1e-5 and not marker.exists() and handle.state == "uninstalled"
    message = _failure(compiled).message
    assert "call 3 since install" in message and f"audit_process: os.system of 'touch {marker}'" in message, message
    assert verify.verifier_of(handle) is None


def test_a_wrapper_that_swallows_the_refusal_on_an_unchecked_call_is_still_uninstalled(stand_in_gate, monkeypatch,
                                                                                       tmp_path):
    marker = tmp_path / "ran"
    edit = vs.outside_gate(vs.compile_cmd(str(marker)), 2, after=True, swallow=True)
    compiled = _compile(edit, "first=1,every=off,interval=off", monkeypatch)
    errors = _drive(compiled, 1 + 4)
    assert max(errors) < 1e-5 and not marker.exists()
    assert "call 2 since install" in _failure(compiled).message and _handle(compiled).state == "uninstalled"


def test_refused_event_at_import_keeps_inductor_and_quarantines(stand_in_gate, monkeypatch, tmp_path):
    marker = tmp_path / "ran"
    compiled = _compile(vs.outside_gate_at_import(vs.compile_cmd(str(marker))), "first=8,every=off,interval=off",
                        monkeypatch)
    errors = _drive(compiled, 3)
    handle = _handle(compiled)
    assert max(errors) < 1e-5 and not marker.exists()
    assert handle.state != "installed" and verify.verifier_of(handle) is None
    assert tilesmith.benchmarks(compiled) == ()
    message = _failure(compiled).message
    assert "importing the accepted wrapper" in message and "subprocess.Popen of 'sh'" in message, message
    assert [r.key for r in _quarantined(stand_in_gate)] == [handle.key]


def test_module_loaded_through_inductors_code_cache_is_candidate_code(stand_in_gate, monkeypatch):
    """``ctypes`` is refused only *directly* from candidate code (torch loads libraries on a wrapper's behalf); a
    module the wrapper loads through ``PyCodeCache`` (as its Triton kernels are) counts as candidate code."""
    code = ("from torch._inductor.codecache import PyCodeCache as _P\n"
            "_P.load('import ctypes\\n_lib = ctypes.CDLL(None)\\n# ' + repr(_os.getpid()))\n")
    compiled = _compile(vs.outside_gate(code, 1), "first=8,every=off,interval=off", monkeypatch)
    assert max(_drive(compiled, 1 + 2)) < 1e-5
    message = _failure(compiled).message
    assert "audit_native: ctypes.dlopen" in message, message


def test_honest_wrapper_beside_a_thread_doing_file_io_is_not_blamed(stand_in_gate, monkeypatch, tmp_path):
    """A data loader's file I/O in another thread while the wrapper runs is not judged (per-thread arming)."""
    compiled = _compile(vs.honest(), "first=30,every=off,interval=off", monkeypatch)
    _drive(compiled, 1)
    stop, written = threading.Event(), [0]

    def loader():
        while not stop.is_set():
            (tmp_path / f"batch{written[0] % 4}.bin").write_bytes(b"x" * 4096)
            os.system("true")
            written[0] += 1

    thread = threading.Thread(target=loader, daemon=True)
    thread.start()
    try:
        errors = _drive(compiled, 40)
    finally:
        stop.set()
        thread.join()
    v = verify.verifier_of(_handle(compiled))
    assert max(errors) < 1e-5 and written[0] > 0
    assert v is not None and not v.failed and v.checks == 30, tilesmith.diagnostics(compiled)
    assert v.watch is not None and v.watch.records == []


def test_audit_off_leaves_the_wrapper_unwatched(stand_in_gate, monkeypatch, tmp_path):
    path = tmp_path / "written"
    compiled = _compile(vs.outside_gate(f"open({str(path)!r}, 'w').write('x')\n", 1),
                        "first=4,every=off,interval=off,audit=off", monkeypatch)
    _drive(compiled, 1 + 2)
    assert path.exists() and verify.verifier_of(_handle(compiled)).watch is None


# -- the hook itself -----------------------------------------------------------------------------------------
def _candidate_module(tmp_path, name, source):
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    audit.add_wrapper_file(str(path))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _library_write(path, text="x"):
    with open(path, "w") as handle:  # this test file is a library frame for the hook
        handle.write(text)


def _library_makedirs(path):
    os.makedirs(path, exist_ok=True)  # as cpp_builder._create_if_dir_not_exist does (a library frame)


def test_hook_rules_for_writes_into_the_compiler_caches(tmp_path, monkeypatch):
    cache = tmp_path / "inductor"
    cache.mkdir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    existing = cache / "original_wrapper.py"
    existing.write_text("ORIGINAL = 1\n")
    module = _candidate_module(tmp_path, "cand_writes", "def direct(path):\n    open(path, 'w').write('x')\n\n"
                                                        "def via(fn, *a):\n    return fn(*a)\n")
    watch = audit.Watch("test")
    outcomes = {}
    with audit.watching(watch):
        for name, call in {"direct_into_cache": lambda: module.direct(cache / "new.py"),
                           "library_new_file": lambda: module.via(_library_write, cache / "kernel.cpp"),
                           "library_over_existing": lambda: module.via(_library_write, existing),
                           "library_lock_file": lambda: module.via(_library_write, cache / "x.lock"),
                           "library_outside": lambda: module.via(_library_write, tmp_path / "outside.txt"),
                           # Inductor's C++ build calls makedirs(exist_ok=True) on its output folder, which can be
                           # the working directory: a no-op on an existing folder, a write on a new one.
                           "library_makedirs_existing": lambda: module.via(_library_makedirs, tmp_path),
                           "library_makedirs_new": lambda: module.via(_library_makedirs, tmp_path / "new_dir")}.items():
            try:
                call()
                outcomes[name] = "ok"
            except PermissionError:
                outcomes[name] = "refused"
        _library_write(tmp_path / "no_candidate_frame.txt")  # no wrapper frame on the stack: not judged
    assert outcomes == {"direct_into_cache": "refused", "library_new_file": "ok", "library_over_existing": "refused",
                        "library_lock_file": "ok", "library_outside": "refused", "library_makedirs_existing": "ok",
                        "library_makedirs_new": "refused"}, outcomes
    assert existing.read_text() == "ORIGINAL = 1\n" and not (tmp_path / "outside.txt").exists()
    assert not (tmp_path / "new_dir").exists()
    assert {r["check"] for r in watch.records} == {"audit_file_write"} and len(watch.records) == 4, [r["detail"] for r in watch.records]


def test_hook_judges_candidate_code_on_any_thread_and_library_code_only_on_the_armed_one(tmp_path):
    """Code of an installed wrapper is judged wherever it runs (R6: another thread, R5/R7: outside its calls); code
    that is not the wrapper's (this test file is a library here) is judged only while a wrapper runs on its thread
    with wrapper code on the stack."""
    watch = audit.Watch("test")
    path = tmp_path / "cand_threads.py"
    path.write_text("def write(path):\n    open(path, 'w').write('x')\n")
    audit.add_wrapper_file(str(path), watch)
    spec = importlib.util.spec_from_file_location("cand_threads", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    refused = []

    def other():
        try:
            module.write(tmp_path / "other.txt")
        except PermissionError:
            refused.append("other")

    thread = threading.Thread(target=other)
    with audit.watching(watch):
        thread.start()
        thread.join()
        with pytest.raises(PermissionError):
            module.write(tmp_path / "armed.txt")
    with pytest.raises(PermissionError):
        module.write(tmp_path / "disarmed.txt")
    _library_write(tmp_path / "library.txt")  # no wrapper frame: never judged
    assert refused == ["other"] and (tmp_path / "library.txt").exists()
    assert not any((tmp_path / n).exists() for n in ("other.txt", "armed.txt", "disarmed.txt"))
    assert len(watch.records) == 3, watch.records


# -- Inductor's compile pool -------------------------------------------------------------------------------------
def _warm_pool():
    from torch._inductor import config
    from torch._inductor.async_compile import AsyncCompile

    if (config.compile_threads or config.decide_compile_threads()) <= 1:
        pytest.skip("Inductor compiles in the calling thread here (compile_threads=1): no pool")
    AsyncCompile.pool().submit(abs, 1).result()  # its thread exists and is idle: a later submit starts none


def test_task_left_in_the_compile_pool_on_a_call_uninstalls(stand_in_gate, monkeypatch):
    compiled = _compile(vs.pool_task(2.0), "first=8,every=off,interval=off", monkeypatch)
    _warm_pool()
    assert max(_drive(compiled, 1 + 2)) < 1e-5
    message = _failure(compiled).message
    assert "call 1 since install" in message and "compile_pool" in message and "time.sleep" in message, message


def test_task_left_in_the_compile_pool_at_import_keeps_inductor(stand_in_gate, monkeypatch):
    _warm_pool()
    compiled = _compile(vs.pool_task(2.0, at_import=True), "first=8,every=off,interval=off", monkeypatch)
    assert max(_drive(compiled, 2)) < 1e-5
    message = _failure(compiled).message
    assert "importing the accepted wrapper" in message and "compile_pool" in message, message


def test_inductors_own_compile_tasks_are_not_foreign():
    from tilesmith.gate import pools

    _warm_pool()
    from torch._inductor.async_compile import AsyncCompile

    started = threading.Event()

    def mine():  # defined in this file: not torch's code
        started.set()
        time.sleep(0.5)

    future = AsyncCompile.pool().submit(mine)
    started.wait(5)
    assert any("mine" in v for v in pools.foreign_work().values())
    future.result()
    assert pools.callable_file(torch._inductor.codecache.CppCodeCache.load) is not None
    assert pools.foreign_work() == {}


# -- memory kept across calls --------------------------------------------------------------------------------------
def test_wrapper_keeping_memory_every_call_is_uninstalled_within_bounded_checks(stand_in_gate, monkeypatch):
    monkeypatch.setattr(leaks, "BASE_BOUND", 8 * 2**20)
    compiled = _compile(vs.keep_input_slices(1), "first=30,every=off,interval=off,retime=off", monkeypatch)
    errors = _drive(compiled, 1 + 14)
    assert max(errors) < 1e-5
    message = _failure(compiled).message
    n = int(message.split("failed on call ")[1].split()[0])
    assert leaks.WARMUP + leaks.STREAK <= n <= 12, message  # 1 MiB a call: 9 MiB > 8 MiB + 2 × ~12 KiB by call 9
    assert "memory_leak" in message and "memory=off" in message


def test_cuda_graph_like_allocation_at_the_first_calls_is_not_a_leak(stand_in_gate, monkeypatch):
    monkeypatch.setattr(leaks, "BASE_BOUND", 8 * 2**20)
    compiled = _compile(vs.allocates_at_first_calls(5, 4), "first=30,every=off,interval=off", monkeypatch)
    assert max(_drive(compiled, 1 + 25)) < 1e-5
    v = verify.verifier_of(_handle(compiled))
    assert v is not None and not v.failed and v.checks == 25, tilesmith.diagnostics(compiled)
    assert v.leaks is not None and v.leaks.judged == 25  # every check measured what the wrapper kept


def test_cpu_figure_counts_a_tensor_to_within_its_bookkeeping():
    before = leaks.allocated_bytes(torch.device("cpu"))
    kept = torch.empty(1 << 18)
    grown = leaks.allocated_bytes(torch.device("cpu")) - before
    assert kept.untyped_storage().nbytes() <= grown <= kept.untyped_storage().nbytes() + 64 * 1024


# -- through the real gate -----------------------------------------------------------------------------------
def test_sniffing_candidate_passes_the_gate_and_is_caught_at_its_first_production_call(cpu_test_mode, monkeypatch,
                                                                                        tmp_path):
    """The gate worker never sees the command (the candidate detects it); production verification blocks it."""
    marker = tmp_path / "ran"
    sniff = vs.outside_gate(vs.compile_cmd(str(marker)), 1)
    monkeypatch.setenv("TILESMITH_VERIFY", "first=8,every=off,interval=off")
    torch.manual_seed(0)
    model = MulSum()
    factory = ScriptedFactory(edits=[lambda t: sniff(mm_instead_of_loop(t)) if has_mulsum_loop(t)
                                     else comment("noop")(t)])
    x = torch.randn(64, 512)
    compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=factory, loops=1)
    with torch.no_grad():
        compiled(x)  # the first call optimizes: the gate accepts the sniffing candidate
        assert [v.status for v in factory.verdicts] == ["accepted"], [(v.reasons, v.failures) for v in factory.verdicts]
        assert not marker.exists()
        out = compiled(x)  # its first production call
        torch.testing.assert_close(out, torch.tanh(x @ model.w), rtol=1e-4, atol=1e-4)
    assert not marker.exists()
    message = _failure(compiled).message
    assert "call 1 since install" in message and "subprocess.Popen of 'sh'" in message, message


@pytest.mark.parametrize("threads", [1, 2], ids=["in-the-importing-thread", "in-inductors-pool"])
def test_honest_wrapper_compiling_a_new_cpp_kernel_at_import_is_not_refused(stand_in_gate, monkeypatch, threads):
    """Compilers, lock files and new files in Inductor's cache are what an honest import does; with one compile
    thread they happen on the armed thread itself."""
    import uuid

    from torch._inductor import config

    with config.patch(compile_threads=threads):
        compiled = _compile(vs.fresh_cpp_kernel(uuid.uuid4().hex), "first=4,every=off,interval=off", monkeypatch)
        errors = _drive(compiled, 1 + 4)
    v = verify.verifier_of(_handle(compiled))
    assert max(errors) < 1e-5
    assert v is not None and not v.failed and v.checks == 4, tilesmith.diagnostics(compiled)
    assert v.watch is not None and v.watch.records == []


# -- red team round 2: compilers that run programs (R2); code that runs outside the wrapper's calls (R5-R7) ---------
@pytest.mark.parametrize("kind", ["wrapper", "prefix", "named", "exact"])
def test_compiler_command_that_runs_another_program_is_refused(stand_in_gate, monkeypatch, tmp_path, kind):
    """R2: ``run_compile_cmd("g++ -wrapper /bin/sh,-c,...")`` ran ``sh`` as g++'s child; ``-B<folder>`` makes g++ run
    a ``cc1plus`` from there; ``evil-g++`` and an executable named ``g++`` in a temporary folder are not compilers."""
    marker, tools = tmp_path / "ran", tmp_path / "tools"
    tools.mkdir()
    vs.fake_tools(str(tools), str(marker))
    code = vs.run_compiler(vs.compiler_cmd_line(kind, str(marker), str(tools)))
    compiled = _compile(vs.outside_gate(code, 1), "first=8,every=off,interval=off", monkeypatch)
    errors = _drive(compiled, 1 + 2)
    assert max(errors) < 1e-5 and not marker.exists(), "the compiler ran another program"
    message = _failure(compiled).message
    assert "call 1 since install" in message and "audit_process: subprocess.Popen" in message, message
    assert "started by a library" in message and _handle(compiled).state == "uninstalled"


def test_compiler_arguments_allow_what_inductor_runs():
    """Every command torch 2.11's cpp_builder ran on this machine (kernels, cpp_wrapper, the precompiled-header step)
    passes; the dangerous spellings do not."""
    from tilesmith.gate import toolargs

    torch_inc = os.path.join(os.path.dirname(torch.__file__), "include")
    kernel = (f"g++ /c/x.cpp -D TORCH_INDUCTOR_CPP_WRAPPER -D STANDALONE_TORCH_HEADER -D CPU_CAPABILITY_AVX512 -O3 "
              f"-DNDEBUG -fno-trapping-math -funsafe-math-optimizations -ffp-contract=off -fexcess-precision=fast "
              f"-fno-tree-loop-vectorize -march=native -shared -fPIC -Wall -std=c++17 -Wno-unused-variable -pedantic "
              f"-fopenmp -include /c/precompiled_headers/h.h -I{torch_inc} -mavx512f -mamx-tile -o /c/x.so -ltorch "
              f"-lgomp -L/usr/lib")
    ok = [kernel, "g++ --version", "g++ -v", "openssl sha512 /tmp/h.i", "g++ /t/header.hpp -O3 -fPIC -E -P -o /t/h.i",
          "gcc -Wl,-t -o /tmp/x -lc", "cc main.c -O3 -shared -fPIC -Wno-psabi -o /c/l.so -lcuda -L/usr/lib -I/usr/include",
          "g++ -x c++-header h.h -o h.gch", "g++-12 -c x.cpp", "/sbin/ldconfig -p"]
    bad = ["g++ -wrapper /bin/sh,-c,id x.cpp", "g++ -B/tmp/t x.cpp", "g++ -fplugin=/tmp/p.so x.cpp",
           "g++ -specs=/tmp/s x.cpp", "g++ @/tmp/args", "g++ -fuse-ld=/tmp/ld x.cpp", "g++ -Wl,-plugin,/tmp/p.so x.o",
           "g++ -Xlinker --plugin -Xlinker /tmp/p.so x.o", "g++ --sysroot=/tmp x.cpp", "g++ -Wp,-x x.c",
           "x-g++ -c x.cpp", "sh -c id", "openssl enc -in x", "ldconfig -C /tmp/c"]
    import shlex

    try:  # Triton's bundled ptxas (CUDA kernels), through the virtual environment's site-packages
        import triton

        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
        if os.path.exists(ptxas):
            ok.append(f"{ptxas} -lineinfo -v --gpu-name=sm_90a /t/k.ptx -o /t/k.cubin")
    except ImportError:
        pass
    refused = {c: toolargs.problem(shlex.split(c))[0] for c in ok + bad}
    assert [c for c in ok if refused[c] is not None] == [], {c: refused[c] for c in ok}
    assert [c for c in bad if refused[c] is None] == []
    assert toolargs.problem(["g++", "-c", "x.cpp"], {**os.environ, "LD_PRELOAD": "/tmp/x.so"},
                            {k: os.environ.get(k) for k in toolargs.RISKY_ENV})[0] is not None


@pytest.mark.parametrize("how", ["executor", "event", "inductor_pool"])
def test_wrapper_code_on_another_thread_is_judged(stand_in_gate, monkeypatch, tmp_path, how):
    """R6: the wrapper's code wrote from a pool thread and waited for it within its call; the thread was not armed."""
    from torch._inductor import config

    marker = tmp_path / "written"
    with config.patch(compile_threads=2):
        if how == "inductor_pool":
            from torch._inductor.async_compile import AsyncCompile

            AsyncCompile.pool().submit(abs, 1).result()  # the pool's thread exists: the wrapper starts none
        compiled = _compile(vs.other_thread(how, str(marker)), "first=8,every=off,interval=off", monkeypatch)
        errors = _drive(compiled, 1 + 2)
    assert max(errors) < 1e-5 and not marker.exists(), "the wrapper wrote from another thread"
    message = _failure(compiled).message
    assert f"audit_file_write: open for writing '{marker}'" in message and "in _write" in message, message
    assert "call 1 since install" in message and _handle(compiled).state == "uninstalled", message


@pytest.mark.parametrize("how", ["logging", "warnings"])
def test_hook_the_wrapper_registered_is_judged_when_it_runs_later(stand_in_gate, monkeypatch, tmp_path, how):
    """R7: code the wrapper registered at import (a logging handler, a warnings hook) runs later, outside its calls,
    when the user's program logs or warns; it is refused there and the wrapper is uninstalled at its next call."""
    import logging
    import warnings

    marker = tmp_path / "written"
    handlers, show = list(logging.getLogger().handlers), warnings.showwarning
    try:
        # state=off: a replaced warnings.showwarning is also a global-state change, caught at the first check
        compiled = _compile(vs.later_hook(how, str(marker)), "first=1,every=off,interval=off,state=off", monkeypatch)
        errors = _drive(compiled, 1 + 1)
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            try:
                if how == "logging":
                    logging.getLogger("tilesmith_test_app").warning("the user's program logs")
                else:
                    warnings.warn("the user's program warns", UserWarning, stacklevel=1)
            except PermissionError:
                pass
        assert not marker.exists(), "the wrapper's hook wrote outside its calls"
        errors += _drive(compiled, 1)
    finally:
        logging.getLogger().handlers[:] = handlers
        warnings.showwarning = show
    assert max(errors) < 1e-5
    handle = _handle(compiled)
    message = _failure(compiled).message
    assert handle.state == "uninstalled" and f"audit_file_write: open for writing '{marker}'" in message, message


_EXIT_SPELLINGS = {
    "del": "class _K:\n    def __del__(self, _os=_os):\n        _os.system('touch {m}')\n_k = _K()\n",
    "finalize": "import weakref\nclass _O:\n    pass\n_o = _O()\ndef _f(_os=_os):\n    _os.system('touch {m}')\n"
                "weakref.finalize(_o, _f)\n",
    "atexit": "import atexit\natexit.register(lambda _os=_os: _os.system('touch {m}'))\n",
    "generator": "def _g(_os=_os):\n    try:\n        yield 1\n    finally:\n        _os.system('touch {m}')\n"
                 "_gen = _g()\nnext(_gen)\n",
}

_EXIT_CHILD = """
import importlib.util, sys
if sys.argv[2] == "hooked":
    from tilesmith.install import audit
    audit.add_wrapper_file(sys.argv[1], audit.Watch("exit test"))  # as the installer does after the import
spec = importlib.util.spec_from_file_location("cand_exit", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules["cand_exit"] = module
spec.loader.exec_module(module)
"""


@pytest.fixture(scope="module")
def exit_markers(tmp_path_factory):
    """R5: one wrapper module with every spelling of code that runs at interpreter exit, run in a child interpreter
    with production's hook (the module an installed wrapper's file) and, as a control, without it."""
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("exit")
    out = {}
    for mode in ("hooked", "control"):
        folder = root / mode
        folder.mkdir()
        source = "import os as _os\n" + "".join(s.format(m=folder / name) for name, s in _EXIT_SPELLINGS.items())
        (folder / "cand_exit.py").write_text(source)
        env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        proc = subprocess.run([sys.executable, "-c", _EXIT_CHILD, str(folder / "cand_exit.py"), mode], env=env,
                              capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr[-2000:]
        out[mode] = {name: (folder / name).exists() for name in _EXIT_SPELLINGS}
    return out


@pytest.mark.parametrize("how", list(_EXIT_SPELLINGS))
def test_wrapper_code_at_interpreter_exit_is_refused(exit_markers, how):
    """``__del__`` (run after CPython 3.11 clears the audit hooks), ``weakref.finalize``, ``atexit`` and a suspended
    generator's ``finally``: each runs ``touch`` without the hook (control) and is refused with it."""
    assert exit_markers["control"][how], "the spelling does not run at exit"
    assert not exit_markers["hooked"][how], "the wrapper's code ran a program at interpreter exit"


def test_slow_path_unchecked_call_also_stops_a_wrapper_refused_between_calls(stand_in_gate, monkeypatch, tmp_path):
    """The verifier's slow path (a call whose check was skipped, or made while another thread checks) looks at the
    audit's refusals first, as the fast path does: a wrapper whose hook was refused outside its calls is not run
    again there either, and the original serves the call."""
    import logging

    from tilesmith.install import verify

    marker = tmp_path / "written"
    handlers = list(logging.getLogger().handlers)
    try:
        compiled = _compile(vs.later_hook("logging", str(marker)), "first=1,every=off,interval=off,state=off",
                            monkeypatch)
        _drive(compiled, 1 + 1)
        try:
            logging.getLogger("tilesmith_test_app").warning("the user's program logs")
        except PermissionError:
            pass
        handle = _handle(compiled)
        verifier = verify.verifier_of(handle)
        assert verifier is not None and handle.state != "uninstalled" and verifier.watch.records
        ran = []
        monkeypatch.setattr(verifier, "fn", lambda args: ran.append(1))
        x, w = _inputs(5)
        out = verifier.unchecked([x, w])
    finally:
        logging.getLogger().handlers[:] = handlers
    assert not ran, "the refused wrapper ran again on the slow path"
    assert handle.state == "uninstalled" and out is not None
    assert "audit_file_write" in _failure(compiled).message
