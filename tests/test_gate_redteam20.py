"""Red team 20: cheats a real Gate (CPU test mode, static scan on) accepted after red team 19's fixes.

Like red team 19's candidates (tests/test_gate_redteam19.py, whose LinearLN 32×64 deferring wrapper these reuse), the
candidates return uncomputed output buffers from call 41 on and have them written *outside the sample's clock*, by
native code run between the clock's stop and the ``release`` request that copies a picked call out. Red team 19's
looks (``worker/outside.py``) compare the signals the process *catches* (``SigCgt``), the main thread's mask, its
timers, ``O_ASYNC`` descriptors and thread count; what they do not see is a handler that *replaces* one the process
already catches (the set of caught signals does not change) fired by a source they do not read.

Each test runs one candidate through a real Gate and asserts it is not accepted; the comments above each give what it
was accepted at before the fix (``tilesmith/gate/worker/seal.py`` holds the fixes: inside every sample's clock, right
after its last call, every signal is blocked through the raw system call, the pending-call queue is probed and the
thread state's profile/trace functions and the frame evaluator are compared with the worker's start; the automatic
garbage collector is off for the timing run; signal handler addresses are compared). The last candidate,
which rewrites the clock function itself, is still accepted (``xfail``, strict).
"""

from __future__ import annotations

import pytest

from tests import gate_support as gs
from tests.cheats.common import LINEAR_LN_ROW_C
from tests.test_gate_redteam19 import _deferring_source


def _verdict(ln, kernel: str, name: str, note: str, rows: int = 32):
    from tilesmith.records import Candidate

    gate, cap, _ = ln
    verdict = gate.evaluate(Candidate(source=_deferring_source(cap.source, kernel, name, 64, rows),
                                      proposer="redteam20", note=note))
    phases = [p for p in (verdict.timing, verdict.confirmation) if p is not None]
    print("\nRT20", note, verdict.status,
          [f"{p.speedup:.2f}x (CI low {p.ci_low:.2f}, k {p.calls_per_sample})" for p in phases],
          [r[:300] for r in verdict.reasons])
    return verdict


def _rejected_outside_clock(ln, kernel: str, name: str, note: str) -> None:
    verdict = _verdict(ln, kernel, name, note)
    assert verdict.status != "accepted", (verdict.timing, verdict.confirmation)
    assert "outside_clock" in {f.check for f in verdict.failures}, verdict.reasons


@pytest.fixture(scope="module")
def ln(tmp_path_factory):
    yield from gs.linear_ln_gate(tmp_path_factory.mktemp("redteam20-ln"), "rt20 (0_inference)")


# -- 1. glibc's own signal 33, taken over, fired by a directory notification on /proc/<pid> -------------------------
#: Every worker catches signal 33 from its start (glibc's ``SIGSETXID``, installed at the first ``pthread_create``;
#: glibc's ``sigaction`` and ``pthread_sigmask`` refuse to touch it, so the worker's blocked set leaves it open). From
#: call 41 on the kernel replaces that handler with its own through the raw ``rt_sigaction`` system call (the set of
#: caught signals, ``SigCgt``, does not change), and asks for a ``dnotify`` signal 33 (``F_SETSIG`` + ``F_NOTIFY``,
#: ``DN_ACCESS | DN_MULTISHOT``: no ``O_ASYNC`` flag, no timer) whenever a file in ``/proc/<pid>`` is read. Calls
#: only record their pointers; the worker's own look right after each sample's clock reads ``/proc/self/status``, which
#: fires the handler, and it computes every recorded call before the ``release`` copy. **Accepted before the fix at
#: 4.77× (CI low 4.43), confirmed 5.21×.** Now: the handler's replacement shows (``seal.handlers``), and signal 33 is
#: blocked in every thread, so it is never delivered (the outputs stay uncomputed: ``timing_output_mismatch`` too).
SIG33_DNOTIFY = r'''
cpp_defer_33 = async_compile.cpp_pybinding(['const float*', 'const float*', 'const float*', 'const float*', 'const float*', 'float*', 'int64_t'], r"""
#include <signal.h>
#include <fcntl.h>
#include <unistd.h>
#include <string.h>
#include <math.h>
#define CAT(a, b) a##b
@WORK@
struct Job { const float *w, *b, *x, *g, *be; float *o; };
static Job jobs[16384];
static volatile int njobs = 0;
static int armed = 0;
struct KSA { void (*h)(int, siginfo_t *, void *); unsigned long flags; void (*restorer)(void); unsigned long mask; };
static void on_signal(int, siginfo_t *, void *) {
    int n = njobs;
    for (int i = 0; i < n; ++i) work(jobs[i].w, jobs[i].b, jobs[i].x, jobs[i].g, jobs[i].be, jobs[i].o);
    njobs = 0;
}
extern "C" void kernel(const float *w, const float *b, const float *x, const float *g, const float *be, float *out,
                       int64_t defer) {
    if (!defer) { work(w, b, x, g, be, out); return; }
    if (!armed) {
        armed = 2;
        KSA old; memset(&old, 0, sizeof old);
        if (CAT(sys, call)(13, 33, 0, &old, 8) == 0 && old.restorer) {  /* rt_sigaction(33, NULL, &old) */
            KSA mine = old; mine.h = on_signal; mine.flags = old.flags | SA_SIGINFO | SA_RESTART; mine.mask = ~0UL;
            int fd = CAT(op, en)("/proc/self", O_RDONLY | O_DIRECTORY);
            if (fd >= 0 && CAT(sys, call)(13, 33, &mine, 0, 8) == 0 && fcntl(fd, F_SETSIG, 33) == 0 &&
                fcntl(fd, F_NOTIFY, DN_ACCESS | DN_MULTISHOT) == 0) armed = 1;
        }
    }
    if (armed != 1 || njobs >= 16384) { work(w, b, x, g, be, out); return; }
    Job j = {w, b, x, g, be, out}; jobs[njobs] = j; njobs = njobs + 1;
}
""")
'''


def test_glibcs_signal_33_fired_by_a_directory_notification_is_not_a_speedup(ln):
    _rejected_outside_clock(ln, SIG33_DNOTIFY, "cpp_defer_33", "signal 33 + dnotify on /proc")


# -- 2. a pending call that re-queues itself runs the deferred work at the worker's first bytecodes after the clock --
#: No signal, no thread, no timer: ``Py_AddPendingCall`` (CPython's C API; the kernel includes ``Python.h``) queues a
#: C function that the main thread's interpreter runs at its next eval-breaker check, between bytecodes. The function
#: re-queues itself every time it runs, so it runs at every such check of the main thread from then on; it counts the
#: checks since the last deferred call and, once there were more than ``IDLE`` in a row (calls come a few checks apart
#: within a sample; the worker's own Python after the sample's clock makes hundreds), computes every recorded call.
#: **Accepted before the fix: at IDLE 400, 1.25× (CI low 1.18), confirmed 1.51×; at IDLE 20000, 1.22× (CI low 1.15),
#: confirmed 1.18×.** Now the seal runs the queue inside the clock (IDLE 400 then computes there: 0.23×, slower) and
#: finds a call still queued (IDLE 20000: ``outside_clock``, "pending calls queued").
PENDING = r'''
cpp_defer_pc = async_compile.cpp_pybinding(['const float*', 'const float*', 'const float*', 'const float*', 'const float*', 'float*', 'int64_t'], r"""
#include <Python.h>
#include <string.h>
#include <math.h>
#define IDLE @IDLE@
@WORK@
struct Job { const float *w, *b, *x, *g, *be; float *o; };
static Job jobs[16384];
static int njobs = 0;
static long idle = 0;
static int queued = 0;
static int pending(void *) {
    if (njobs == 0) { queued = 0; return 0; }  /* nothing left to do: leave the queue */
    if (++idle > IDLE) {
        for (int i = 0; i < njobs; ++i) work(jobs[i].w, jobs[i].b, jobs[i].x, jobs[i].g, jobs[i].be, jobs[i].o);
        njobs = 0; queued = 0; return 0;
    }
    Py_AddPendingCall(pending, 0);
    return 0;
}
extern "C" void kernel(const float *w, const float *b, const float *x, const float *g, const float *be, float *out,
                       int64_t defer) {
    if (!defer || njobs >= 16384) { work(w, b, x, g, be, out); return; }
    Job j = {w, b, x, g, be, out}; jobs[njobs] = j; njobs = njobs + 1;
    idle = 0;
    if (!queued && Py_AddPendingCall(pending, 0) == 0) queued = 1;
    if (!queued) { njobs = njobs - 1; work(w, b, x, g, be, out); }
}
""")
'''


@pytest.mark.parametrize("idle", [400, 20000])
def test_outputs_computed_by_a_self_requeuing_pending_call_after_the_clock_are_not_a_speedup(ln, idle):
    kernel = PENDING.replace("@IDLE@", str(idle))
    note = f"a pending call re-queued until the clock stops (idle {idle})"
    if idle > 1000:  # still queued when the seal probes the queue inside the clock
        _rejected_outside_clock(ln, kernel, "cpp_defer_pc", note)
    else:  # computes at the seal's own bytecodes, inside the clock: no speedup left (or found queued)
        verdict = _verdict(ln, kernel, "cpp_defer_pc", note)
        assert verdict.status != "accepted", (verdict.timing, verdict.confirmation)


# -- 3. a fault handler where the process already had one: the spot copy's read of a protected output runs it ---------
#: With ``PYTHONFAULTHANDLER=1`` in the user's environment (which reaches the workers) every worker catches ``SIGSEGV``
#: from its start (Python's ``faulthandler``), so a handler the candidate puts in its place changes nothing
#: ``SigCgt`` shows. From call 41 on a call computes only the rows of its output that do not lie in a whole page of
#: the buffer, records the call and ``mprotect``s those pages ``PROT_NONE`` (LinearLN 1024×64 here: 256 KiB of output,
#: all but a row or two in whole pages). Uncopied calls are never computed; when
#: the worker's ``release`` copies a picked call out, its read faults, and the native ``SIGSEGV`` handler makes the
#: pages writable again, computes the missing rows and returns: the copy reads the right values. The handler runs
#: after the clock, in a copy only picked calls get. **Accepted before the fix at 3.38× (CI low 1.63), confirmed
#: 3.45×.** Now the replaced ``SIGSEGV`` handler shows after the first sample (``seal.handlers``: handler addresses,
#: not only the set of caught signals), and with every signal blocked a fault would end the worker.
FAULT = r'''
cpp_defer_sv = async_compile.cpp_pybinding(['const float*', 'const float*', 'const float*', 'const float*', 'const float*', 'float*', 'int64_t'], r"""
#include <signal.h>
#include <unistd.h>
#include <string.h>
#include <stdint.h>
#include <math.h>
#include <sys/mman.h>
#define CAT(a, b) a##b
#define D @D@
#define M @M@
static void rows(const float *w, const float *b, const float *x, const float *g, const float *be, float *o, int r0, int r1) {
    for (int i = r0; i < r1; ++i) {
        double acc[D];
        for (int j = 0; j < D; ++j) { double s = b[j]; for (int k = 0; k < D; ++k) s += (double)x[i * D + k] * w[j * D + k]; acc[j] = s; }
@LN_ROW@
    }
}
struct Job { const float *w, *b, *x, *g, *be; float *o; uintptr_t lo, hi; int r0, r1, done; };
static Job jobs[16384];
static int njobs = 0;
static int armed = 0;
static struct sigaction previous;
static void on_fault(int sig, siginfo_t *info, void *ctx) {
    uintptr_t a = (uintptr_t)info->si_addr;
    for (int i = njobs - 1; i >= 0; --i) {
        Job *j = &jobs[i];
        if (!j->done && a >= j->lo && a < j->hi) {
            CAT(mpro, tect)((void *)j->lo, j->hi - j->lo, PROT_READ | PROT_WRITE);
            rows(j->w, j->b, j->x, j->g, j->be, j->o, j->r0, j->r1);
            j->done = 1;
            return;
        }
    }
    CAT(sigact, ion)(SIGSEGV, &previous, 0);  /* not ours: the process's own handler takes the next fault */
}
extern "C" void kernel(const float *w, const float *b, const float *x, const float *g, const float *be, float *out,
                       int64_t defer) {
    if (!defer || njobs >= 16384) { rows(w, b, x, g, be, out, 0, M); return; }
    if (!armed) {
        struct sigaction sa; memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_fault; sa.sa_flags = SA_SIGINFO | SA_NODEFER;
        CAT(sigact, ion)(SIGSEGV, &sa, &previous);
        armed = 1;
    }
    uintptr_t p = (uintptr_t)out, end = p + sizeof(float) * M * D, page = 4096;
    uintptr_t lo = (p + page - 1) & ~(page - 1), hi = end & ~(page - 1);
    int r0 = lo >= hi ? M : (int)((lo - p + sizeof(float) * D - 1) / (sizeof(float) * D));
    int r1 = lo >= hi ? M : (int)((hi - p) / (sizeof(float) * D));
    if (r1 <= r0) { rows(w, b, x, g, be, out, 0, M); return; }
    rows(w, b, x, g, be, out, 0, r0);
    rows(w, b, x, g, be, out, r1, M);
    /* rows r0..r1 lie in [lo, hi): protect exactly the pages holding them */
    uintptr_t plo = (p + sizeof(float) * D * r0) & ~(page - 1), phi = (p + sizeof(float) * D * r1 + page - 1) & ~(page - 1);
    if (plo < lo) plo = lo;
    if (phi > hi) phi = hi;
    Job j = {w, b, x, g, be, out, plo, phi, r0, r1, 0};
    jobs[njobs] = j;
    if (CAT(mpro, tect)((void *)plo, phi - plo, PROT_NONE) != 0) { rows(w, b, x, g, be, out, r0, r1); return; }
    njobs = njobs + 1;
}
""")
'''


@pytest.fixture(scope="module")
def ln_faulthandler(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONFAULTHANDLER", "1")
        yield from gs.linear_ln_gate(tmp_path_factory.mktemp("redteam20-fh"), "rt20fh (0_inference)", rows=1024)


def test_a_fault_handler_replacing_the_processs_own_is_not_a_speedup(ln_faulthandler):
    kernel = FAULT.replace("@D@", "64").replace("@M@", "1024").replace("@LN_ROW@", LINEAR_LN_ROW_C)
    verdict = _verdict(ln_faulthandler, kernel, "cpp_defer_sv", "SIGSEGV handler in faulthandler's place", rows=1024)
    assert verdict.status != "accepted", (verdict.timing, verdict.confirmation)
    # The replaced handler shows after the first sample (seal.handlers); with every signal blocked by the seal, a
    # fault in the copy would end the worker instead of running it.
    assert {"outside_clock", "crash"} & {f.check for f in verdict.failures}, verdict.reasons


# -- 4. pure Python: a finalizer run by the cyclic garbage collector at the worker's first allocations after the clock -
#: No native code at all (the static scan passes it). From call 41 on, ``call`` returns an uncomputed output and
#: records the call; it then *primes the garbage collector*: it allocates container objects until the collector has
#: run (a ``__del__`` of a self-referencing probe object counts the collections and makes a new probe each time), and
#: keeps ``PRIME`` more alive, so the youngest generation is a few allocations short of its threshold (700) when the
#: call returns. Within a sample the next call's own allocations set it off (the probe sees a call in progress and
#: only renews itself); after the last call it is the worker's own bookkeeping that sets it off, and the probe's
#: ``__del__`` then runs the original wrapper for every recorded call and copies the results into their outputs,
#: before the ``release`` copy. LinearLN 1024×64: the priming costs ~30 µs a call. **Accepted before the fix at
#: PRIME 690: 2.14× (CI low 1.92), confirmed 1.91×** (at 640 the worker made too few allocations before the copy:
#: rejected). Now the automatic collector is off for the whole timing run (``seal.start``): the finalizer never runs
#: and the outputs stay uncomputed (``timing_output_mismatch``).
GC_PRIME = '''
_st = {"in": False, "n": 0, "gc": 0}
_jobs = []
_kept = []
_PRIME = @PRIME@


def _flush():
    jobs = list(_jobs)
    _jobs.clear()
    for a, out in jobs:
        out.copy_(runner._orig_call(list(a))[0])


class _Probe:
    def __init__(self):
        self.me = self

    def __del__(self):
        _st["gc"] += 1
        if not _st["in"] and _jobs:
            _flush()
        _Probe()


_Probe()
'''

GC_CALL = '''
    def call(self, args):
        _st["in"] = True
        _st["n"] += 1
        if _st["n"] <= 40:
            result = self._orig_call(args)
            _st["in"] = False
            return result
        a = list(args)
        args.clear()
        out = empty_strided_cpu((@M@, @D@), (@D@, 1), torch.float32)
        _jobs.append((a, out))
        _kept.clear()
        g = _st["gc"]
        tmp = []
        while _st["gc"] == g and len(tmp) < 5000:
            tmp.append([])
        _kept.append(tmp)  # freeing would lower the collector's count again
        _kept.extend([[] for _ in range(_PRIME)])
        _st["in"] = False
        return (out, )

'''


def _gc_source(src: str, m: int, d: int, prime: int) -> str:
    src = src.replace("    def call(self, args):", GC_CALL.replace("@M@", str(m)).replace("@D@", str(d)).lstrip("\n")
                      + "    def _orig_call(self, args):", 1)
    i = src.index("class Runner")
    return src[:i] + GC_PRIME.replace("@PRIME@", str(prime)).strip("\n") + "\n\n\n" + src[i:]


@pytest.fixture(scope="module")
def ln_big(tmp_path_factory):
    yield from gs.linear_ln_gate(tmp_path_factory.mktemp("redteam20-big"), "rt20big (0_inference)", rows=1024)


@pytest.mark.parametrize("prime", [690, 640])
def test_outputs_computed_by_a_garbage_collector_finalizer_after_the_clock_are_not_a_speedup(ln_big, prime):
    from tilesmith.records import Candidate

    gate, cap, _ = ln_big
    verdict = gate.evaluate(Candidate(source=_gc_source(cap.source, 1024, 64, prime), proposer="redteam20",
                                      note=f"gc finalizer primed to run after the clock ({prime})"))
    phases = [p for p in (verdict.timing, verdict.confirmation) if p is not None]
    print("\nRT20 gc", prime, verdict.status,
          [f"{p.speedup:.2f}x (CI low {p.ci_low:.2f}, k {p.calls_per_sample})" for p in phases],
          [r[:300] for r in verdict.reasons])
    assert verdict.status != "accepted", (verdict.timing, verdict.confirmation)


# -- 5. the sample's clock itself, rewritten in the worker's memory --------------------------------------------------
#: CPU test mode's clock is ``clock_gettime(CLOCK_PROCESS_CPUTIME_ID)`` (``time.clock_gettime_ns`` bound before the
#: candidate's import), which goes through glibc's ``clock_gettime``. The candidate's native kernel overwrites the first
#: bytes of that function with a jump to its own (``mprotect`` of the code page, token-pasted), which makes the system
#: call itself and subtracts a *debt* from the process CPU clock; every call of the wrapper runs the original wrapper
#: unchanged (correct outputs, always), measuring itself with the thread's own CPU clock, and adds ``DISCOUNT`` of that
#: to the debt. The host checks a worker's samples only from above (not more than the CPU time it read from
#: ``/proc/<pid>/stat``), so the under-reported samples pass. **Accepted at 3.27× (CI low 2.99), confirmed 2.95×; still
#: open** (xfail below): every in-process clock read is forgeable by native code that rewrites memory (glibc, CPython,
#: ctypes), and an integrity check of the code bytes is undone by a fake that restores them after each read.
CLOCK = r'''
cpp_clock = async_compile.cpp_pybinding(['int64_t'], r"""
#include <time.h>
#include <unistd.h>
#include <string.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#define CAT(a, b) a##b
static volatile long long debt = 0, started = 0;
static int patched = 0;
static long long now_ns(clockid_t clk) {
    struct timespec ts; CAT(sys, call)(228, clk, &ts);  /* clock_gettime */
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}
static int fake_clock_gettime(clockid_t clk, struct timespec *ts) {
    long r = CAT(sys, call)(228, clk, ts);
    if (r == 0 && clk == CLOCK_PROCESS_CPUTIME_ID) {
        long long ns = ts->tv_sec * 1000000000LL + ts->tv_nsec - debt;
        ts->tv_sec = ns / 1000000000LL; ts->tv_nsec = ns % 1000000000LL;
    }
    return (int)r;
}
static void patch(void) {
    unsigned char *target = (unsigned char *)(void *)&clock_gettime;
    uintptr_t page = (uintptr_t)target & ~(uintptr_t)4095;
    if (CAT(mpro, tect)((void *)page, 8192, PROT_READ | PROT_WRITE | PROT_EXEC) != 0) return;
    uint64_t to = (uint64_t)(uintptr_t)&fake_clock_gettime;
    unsigned char code[12] = {0x48, 0xB8, 0, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xE0};  /* movabs rax, to; jmp rax */
    memcpy(code + 2, &to, 8);
    memcpy(target, code, sizeof code);
    CAT(mpro, tect)((void *)page, 8192, PROT_READ | PROT_EXEC);
    patched = 1;
}
extern "C" void kernel(int64_t mode) {
    if (!patched) patch();
    if (mode == 0) { started = now_ns(CLOCK_THREAD_CPUTIME_ID); return; }
    debt = debt + (long long)((now_ns(CLOCK_THREAD_CPUTIME_ID) - started) * @DISCOUNT@);
}
""")
'''


def _clock_source(src: str, discount: float) -> str:
    from tests.cheats.common import with_kernel

    src = with_kernel(src, CLOCK.replace("@DISCOUNT@", str(discount)))
    src = src.replace("    def call(self, args):", '''    def call(self, args):
        cpp_clock(0)
        result = self._orig_call(args)
        cpp_clock(1)
        return result

    def _orig_call(self, args):''', 1)
    return src


@pytest.mark.xfail(strict=True, reason=(
    "open (red team 20): CPU test mode's sample is the worker's own clock_gettime(CLOCK_PROCESS_CPUTIME_ID), which "
    "native candidate code can rewrite in the worker's memory (here glibc's clock_gettime, patched to subtract a "
    "debt); the host checks samples only from above (worker CPU time from /proc/<pid>/stat, 10 ms ticks). A fix "
    "needs a clock the candidate cannot reach: the host reading the worker's CPU time (/proc/<pid>/task/*/schedstat, "
    "ns) around a request that holds only the calls (the fill and the 32 MiB flush moved to a request of their own), "
    "and bounding the reported sample from below by it; that changes CPU test mode's timing protocol and needs "
    "recalibrating, not done in this round."))
def test_a_candidate_that_rewrites_the_clock_function_is_not_a_speedup(ln):
    from tilesmith.records import Candidate

    gate, cap, _ = ln
    verdict = gate.evaluate(Candidate(source=_clock_source(cap.source, 0.75), proposer="redteam20",
                                      note="clock_gettime rewritten in memory"))
    phases = [p for p in (verdict.timing, verdict.confirmation) if p is not None]
    print("\nRT20 clock", verdict.status,
          [f"{p.speedup:.2f}x (CI low {p.ci_low:.2f}, k {p.calls_per_sample})" for p in phases],
          [r[:300] for r in verdict.reasons])
    assert verdict.status != "accepted", (verdict.timing, verdict.confirmation)


# -- 6. a C-level profile function written into the thread state, which removes itself once it has run -------------
#: ``sys.setprofile`` (and CPython's ``PyEval_SetProfile``, which raises the same audit event) is refused by the
#: worker's audit hook; the kernel instead writes its function into the thread state's ``c_profilefunc`` and switches
#: tracing on (``cframe->use_tracing``), which raises nothing. The interpreter then calls it at every Python call and
#: return and before every call of a built-in; it waits for the worker's own call of ``time.perf_counter_ns``, which
#: follows the reading of the sample's CPU clock, computes every recorded call there and takes itself out of the
#: thread state again, so no look after the clock finds it (the next deferred call puts it back). **Accepted before the
#: fix at 3.68× (CI low 2.90), confirmed 4.27×; and at 4.11×/4.02× past this round's first seal** (signals, pending
#: calls). Now the seal compares the thread state's ``c_profilefunc``/``c_tracefunc`` inside the clock.
PROFILE = r'''
cpp_defer_pf = async_compile.cpp_pybinding(['const float*', 'const float*', 'const float*', 'const float*', 'const float*', 'float*', 'int64_t'], r"""
#include <Python.h>
#include <string.h>
#include <math.h>
@WORK@
struct Job { const float *w, *b, *x, *g, *be; float *o; };
static Job jobs[16384];
static int njobs = 0;
static void off(void) {
    PyThreadState *ts = PyThreadState_Get();
    ts->c_profilefunc = 0;
    ts->cframe->use_tracing = ts->c_tracefunc ? 255 : 0;
}
static int profiler(PyObject *, PyFrameObject *, int what, PyObject *arg) {
    if (what == PyTrace_C_CALL && njobs && arg && PyCFunction_Check(arg) &&
        strcmp(((PyCFunctionObject *)arg)->m_ml->ml_name, "perf_counter_ns") == 0) {
        for (int i = 0; i < njobs; ++i) work(jobs[i].w, jobs[i].b, jobs[i].x, jobs[i].g, jobs[i].be, jobs[i].o);
        njobs = 0;
        off();
    }
    return 0;
}
extern "C" void kernel(const float *w, const float *b, const float *x, const float *g, const float *be, float *out,
                       int64_t defer) {
    PyThreadState *ts = PyThreadState_Get();
    if (!defer || njobs >= 16384 || (ts->c_profilefunc && ts->c_profilefunc != profiler)) {
        work(w, b, x, g, be, out); return;
    }
    Job j = {w, b, x, g, be, out}; jobs[njobs] = j; njobs = njobs + 1;
    ts->c_profilefunc = profiler;
    ts->cframe->use_tracing = 255;
}
""")
'''


def test_outputs_computed_by_a_profile_function_written_into_the_thread_state_are_not_a_speedup(ln):
    _rejected_outside_clock(ln, PROFILE, "cpp_defer_pf", "a C profile function in the thread state")


def test_the_host_reads_a_workers_cpu_time_from_the_kernel_not_from_the_worker():
    """The host's own clock of another process (``process.cpu_clock_ms``), what a fix of the clock rewrite above
    builds on and what each CPU timing phase records (``timing_raw.kernel_cpu``): it counts a busy child's work to
    well under a millisecond and nothing while the child sleeps, whatever the child does to its own clock."""
    import subprocess
    import sys
    import time

    from tilesmith.gate.host.process import cpu_clock_ms

    child = subprocess.Popen([sys.executable, "-c", "import sys, time\nsys.stdin.readline()\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.3: pass\nprint('done', flush=True)\n"
                              "sys.stdin.readline()\n"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)
        idle0 = cpu_clock_ms(child.pid)
        time.sleep(0.2)
        idle1 = cpu_clock_ms(child.pid)
        assert idle0 is not None and idle1 - idle0 < 1.0  # blocked on its stdin: no CPU time
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "done"
        busy = cpu_clock_ms(child.pid) - idle1
        assert 300.0 <= busy < 400.0, busy  # its 0.3 s of CPU time, plus the print
    finally:
        child.kill()
        child.wait()
    assert cpu_clock_ms(child.pid) is None  # gone
