"""Red team 19: cheats a real Gate (CPU test mode) accepted, found after red team 18.

CPU test mode times the worker's CPU time between the first and the last call of a sample (``worker/timing.py:
_timed``). Red teams 17b and 18 closed work done by *other processes* during the calls; these candidates do the
calls' work in the worker itself, but *outside the clock*: the calls return uncomputed output buffers, and the
outputs are written after the clock stopped and before the worker copies a picked call out (the ``release``
request), by code that the gate's looks (after the import, the checks and the whole timing run) never saw running.
Each test runs one candidate through a real Gate and asserts it is not accepted; the docstrings give what it was
accepted at before the fix.
"""

from __future__ import annotations

import pytest

from tests import gate_support as gs
from tests.cheats.common import LINEAR_LN_ROW_C, replace_body, with_kernel

#: The graph's work for one call (``LinearLN``, ``M``×``D``) from raw pointers, in C: the deferred computations below.
WORK_C = r"""
#define D @D@
#define M @M@
static void work(const float *w, const float *b, const float *x, const float *g, const float *be, float *o) {
    for (int i = 0; i < M; ++i) {
        double acc[D];
        for (int j = 0; j < D; ++j) { double s = b[j]; for (int k = 0; k < D; ++k) s += (double)x[i * D + k] * w[j * D + k]; acc[j] = s; }
@LN_ROW@
    }
}
"""


def _fill(kernel: str, d: int, m: int) -> str:
    for key, value in {"WORK": WORK_C, "D": str(d), "M": str(m), "LN_ROW": LINEAR_LN_ROW_C}.items():
        kernel = kernel.replace(f"@{key}@", value)
    return kernel


def _deferring_source(src: str, kernel: str, name: str, d: int, m: int, honest_calls: int = 40) -> str:
    """The LinearLN wrapper whose call is ``name(w, b, x, g, be, out, defer)``: computed at once for the first
    ``honest_calls`` calls (the correctness checks make 22), deferred after; the outputs of deferred calls are kept
    referenced by the module (a timed call's output is freed right after the warm-up's calls) until long done."""
    body = [f"buf4 = empty_strided_cpu(({m}, {d}), ({d}, 1), torch.float32)",
            "_n[0] += 1",
            f"later = _n[0] > {honest_calls}",
            f"{name}(arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, buf4, 1 if later else 0)",
            "if later:",
            "    _keep.append(buf4)",
            "    if len(_keep) > 8192:",
            "        del _keep[:4096]",
            "return (buf4, )"]
    source = replace_body(with_kernel(src, _fill(kernel, d, m)), body)
    i = source.index("class Runner")
    return source[:i] + "_n = [0]\n_keep = []\n\n\n" + source[i:]


# -- 1. a timer's signal handler computes the outputs after the sample's clock --------------------------------------
#: From call 41 on, a call only records its pointers and (re)arms a POSIX timer that sends the worker's main thread a
#: signal 0.2 ms later; a native ``sigaction`` handler then computes every recorded call. Within a sample the calls
#: come microseconds apart, so the timer fires only after the last one, while the worker builds its answer: the
#: handler interrupts the main thread there (its CPU time is not in the sample) and has finished before the
#: ``release`` request copies a picked call out. No thread, no process, no audit event; Python's own view of the
#: signal handlers (``signal.getsignal``, which the worker compares) does not change. The static scan stays on: the
#: kernel spells the calls its native patterns name by token pasting.
SIGNAL = r'''
cpp_defer = async_compile.cpp_pybinding(['const float*', 'const float*', 'const float*', 'const float*', 'const float*', 'float*', 'int64_t'], r"""
#include <signal.h>
#include <time.h>
#include <unistd.h>
#include <string.h>
#include <math.h>
#define CAT(a, b) a##b
@WORK@
struct Job { const float *w, *b, *x, *g, *be; float *o; };
static Job jobs[16384];
static volatile int njobs = 0;
static int armed = 0;
static timer_t timer;
static void on_signal(int) {
    int n = njobs;
    for (int i = 0; i < n; ++i) work(jobs[i].w, jobs[i].b, jobs[i].x, jobs[i].g, jobs[i].be, jobs[i].o);
    njobs = 0;
}
extern "C" void kernel(const float *w, const float *b, const float *x, const float *g, const float *be, float *out,
                       int64_t defer) {
    if (!defer) { work(w, b, x, g, be, out); return; }
    if (!armed) {
        struct sigaction sa; memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_signal; sa.sa_flags = SA_RESTART;
        CAT(sigact, ion)(14, &sa, 0);
        struct sigevent ev; memset(&ev, 0, sizeof ev);
        ev.sigev_notify = 4;  /* SIGEV_THREAD_ID: the calling (main) thread */
        ev.sigev_signo = 14;
        ev._sigev_un._tid = gettid();
        CAT(timer_cr, eate)(CLOCK_MONOTONIC, &ev, &timer);
        armed = 1;
    }
    sigset_t one, old; sigemptyset(&one); sigaddset(&one, 14);
    pthread_sigmask(SIG_BLOCK, &one, &old);
    if (njobs >= 16384) { work(w, b, x, g, be, out); }
    else { Job j = {w, b, x, g, be, out}; jobs[njobs] = j; njobs = njobs + 1; }
    struct itimerspec its; memset(&its, 0, sizeof its); its.it_value.tv_nsec = 200000;
    timer_settime(timer, 0, &its, 0);
    pthread_sigmask(SIG_SETMASK, &old, 0);
}
""")
'''


def _rejected_outside_clock(ln, kernel: str, name: str, note: str) -> None:
    """Evaluate the deferring candidate built from ``kernel`` (LinearLN 32×64, CPU test mode, scan on) and assert
    the gate rejects it with an ``outside_clock`` failure; prints the verdict (the speedups it was accepted at
    before the fix are in the commit message)."""
    from tilesmith.records import Candidate

    gate, cap, _ = ln
    verdict = gate.evaluate(Candidate(source=_deferring_source(cap.source, kernel, name, 64, 32),
                                      proposer="redteam19", note=note))
    phases = [p for p in (verdict.timing, verdict.confirmation) if p is not None]
    print("\nRT19", verdict.status, [f"{p.speedup:.2f}x (CI low {p.ci_low:.2f}, k {p.calls_per_sample})" for p in phases],
          [r[:300] for r in verdict.reasons])
    assert verdict.status != "accepted", (verdict.timing, verdict.confirmation)
    assert "outside_clock" in {f.check for f in verdict.failures}, verdict.reasons


@pytest.fixture(scope="module")
def ln(tmp_path_factory):
    yield from gs.linear_ln_gate(tmp_path_factory.mktemp("redteam19-ln"), "rt19 (0_inference)")


def test_outputs_computed_by_a_signal_handler_after_the_clock_are_not_a_speedup(ln):
    _rejected_outside_clock(ln, SIGNAL, "cpp_defer", "timer signal computes after the clock")


# -- 2. a thread started in a timed call computes the outputs after the sample's clock ------------------------------
#: From call 41 on, a call records its pointers and, if none is running, starts a native thread; the thread sleeps
#: while calls keep coming (it reads a counter, without the GIL) and, once they stop — the sample has ended —, takes
#: the GIL and computes every recorded call, then ends. Holding the GIL, it keeps the worker's main thread from its
#: answer and from the ``release`` copy until every output is written; its CPU time falls between the samples. One
#: thread per sample, gone before the next look (the gate counts OS threads after the import, the checks and the
#: whole timing run; the per-sample answer lists only ``threading`` threads). Scan on (token pasting).
THREAD = r'''
cpp_defer_t = async_compile.cpp_pybinding(['const float*', 'const float*', 'const float*', 'const float*', 'const float*', 'float*', 'int64_t'], r"""
#include <Python.h>
#include <pthread.h>
#include <time.h>
#include <string.h>
#include <math.h>
#define CAT(a, b) a##b
@WORK@
struct Job { const float *w, *b, *x, *g, *be; float *o; };
static Job jobs[16384];
static int njobs = 0;
static volatile long ncalls = 0;
static volatile int running = 0;
static void *helper(void *) {
    struct timespec ts = {0, 200000};
    for (;;) { long n = ncalls; nanosleep(&ts, 0); if (ncalls == n) break; }
    PyGILState_STATE st = PyGILState_Ensure();
    for (int i = 0; i < njobs; ++i) work(jobs[i].w, jobs[i].b, jobs[i].x, jobs[i].g, jobs[i].be, jobs[i].o);
    njobs = 0;
    running = 0;
    PyGILState_Release(st);
    return 0;
}
extern "C" void kernel(const float *w, const float *b, const float *x, const float *g, const float *be, float *out,
                       int64_t defer) {
    if (!defer || njobs >= 16384) { work(w, b, x, g, be, out); return; }
    Job j = {w, b, x, g, be, out}; jobs[njobs] = j; njobs = njobs + 1;  /* the GIL is held: the helper waits */
    ncalls = ncalls + 1;
    if (!running) {
        running = 1;
        pthread_t t; pthread_attr_t at; pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        if (CAT(pthread_cr, eate)(&t, &at, helper, 0) != 0) { running = 0; njobs = njobs - 1; work(w, b, x, g, be, out); }
    }
}
""")
'''


def test_outputs_computed_by_a_thread_that_outlives_its_sample_are_not_a_speedup(ln):
    _rejected_outside_clock(ln, THREAD, "cpp_defer_t", "a thread computes after the clock")


# -- 3. a helper process forked during the timing warm-up ----------------------------------------------------------
#: Red team 18's filter refuses new processes only *after* the timing warm-up, and the gate counts the session's
#: processes at its looks (after the import, the checks and the whole timing run). So the first warm-up call past the
#: checks forks a helper sharing an anonymous ``MAP_SHARED`` page with the worker; every later call copies its inputs
#: there, wakes the helper through a pipe and sleeps until it answers (the worker's CPU time holds the two copies,
#: never the helper's work), then copies the output back. The helper leaves (a zombie, which the count skips) as soon
#: as the worker's ``finish`` creates the spot file ``spots_<pid>.pt``, before the host's last look. Scan on.
HELPER = r'''
cpp_defer_p = async_compile.cpp_pybinding(['const float*', 'const float*', 'const float*', 'const float*', 'const float*', 'float*', 'int64_t'], r"""
#include <unistd.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <math.h>
#include <sys/mman.h>
#define CAT(a, b) a##b
@WORK@
struct Shared { float w[D * D], b[D], x[M * D], g[D], be[D], o[M * D]; };
static Shared *sh = 0;
static int to_child[2], to_parent[2];
static int state = 0;  /* 0: not started, 1: helper running, 2: could not start */
static void child(pid_t parent) {
    char name[64]; snprintf(name, sizeof name, "spots_%d.pt", (int)parent);
    struct pollfd p = {to_child[0], POLLIN, 0};
    for (;;) {
        if (poll(&p, 1, 1) > 0) {
            char c; if (read(to_child[0], &c, 1) != 1) break;
            work(sh->w, sh->b, sh->x, sh->g, sh->be, sh->o);
            if (write(to_parent[1], &c, 1) != 1) break;
        } else if (access(name, F_OK) == 0 || getppid() != parent) break;
    }
    CAT(_ex, it)(0);
}
extern "C" void kernel(const float *w, const float *b, const float *x, const float *g, const float *be, float *out,
                       int64_t defer) {
    if (defer && state == 0) {
        state = 2;
        void *m = mmap(0, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (m != MAP_FAILED && pipe(to_child) == 0 && pipe(to_parent) == 0) {
            sh = (Shared *)m;
            pid_t parent = getpid();
            pid_t pid = CAT(fo, rk)();
            if (pid == 0) child(parent);
            if (pid > 0) state = 1;
        }
    }
    if (!defer || state != 1) { work(w, b, x, g, be, out); return; }
    memcpy(sh->w, w, sizeof sh->w); memcpy(sh->b, b, sizeof sh->b); memcpy(sh->x, x, sizeof sh->x);
    memcpy(sh->g, g, sizeof sh->g); memcpy(sh->be, be, sizeof sh->be);
    char c = 1;
    if (write(to_child[1], &c, 1) != 1 || read(to_parent[0], &c, 1) != 1) { state = 2; work(w, b, x, g, be, out); return; }
    memcpy(out, sh->o, sizeof sh->o);
}
""")
'''


def test_work_of_a_helper_forked_during_the_timing_warm_up_is_not_a_speedup(ln):
    _rejected_outside_clock(ln, HELPER, "cpp_defer_p", "a helper forked in the warm-up")
