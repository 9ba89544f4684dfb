"""Red team 17b: the worker's Landlock confinement and the quiescence (SIGSTOP of the worker's process group),
attacked from native code (a C++ kernel built through the wrapper's own ``async_compile.cpp_pybinding``).

Each test is a hole found by running a cheating candidate through a real Gate in CPU test mode with the static scan
off (``scan_off=True``), so only the runtime defences stand. The signal, the escaped process and the offloaded work
are closed by the worker's confinement (Landlock's signal scope; a seccomp filter refusing ``setsid``/``setpgid``,
so every process the worker starts stays in its session and group: ``tilesmith/gate/worker/confine.py``); the two
cache attacks by its Landlock write rules (writes only beneath the worker's own folder), the precompiled headers
shared by symbolic link instead of hard link, and the cache template's digests checked at every copy.
"""

from __future__ import annotations

import os
from pathlib import Path
import signal
import time

import pytest

from tests import gate_support as gs
from tests.cheats.common import linear_ln_native, module_code, with_kernel
from tilesmith.records import Candidate

#: mode 1: ``kill(getppid(), SIGUSR1)`` (the worker's parent is the host: the user's process).
#: mode 2: fork a child that calls ``setsid()`` (out of the worker's process group: no SIGSTOP/SIGKILL of the group
#: reaches it) and forks again (reparented to init); the grandchild writes its pid to ``MARKER`` every 100 ms for
#: ``arg`` seconds, after the worker and the gate are gone.
KERNEL = r'''
cpp_rt17b = async_compile.cpp_pybinding(['int64_t', 'int64_t'], r"""
#include <unistd.h>
#include <signal.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <sys/wait.h>
extern "C" void kernel(int64_t mode, int64_t arg) {
    if (mode == 1) { kill(getppid(), SIGUSR1); return; }
    if (mode == 2) {
        pid_t p = fork();
        if (p != 0) { if (p > 0) waitpid(p, 0, 0); return; }
        setsid();
        if (fork() != 0) _exit(0);
        struct timespec ts = {0, 100000000};
        for (int64_t i = 0; i < arg * 10; ++i) {
            int fd = open("@MARKER@", O_WRONLY | O_CREAT | O_TRUNC, 0600);
            if (fd >= 0) { char b[32]; int n = snprintf(b, sizeof b, "%d", (int)getpid()); write(fd, b, n); close(fd); }
            nanosleep(&ts, 0);
        }
        _exit(0);
    }
}
""")
'''


def _with_kernel(src: str, call: str, marker: str = "") -> str:
    return module_code(with_kernel(src, KERNEL.replace("@MARKER@", marker)), call)


@pytest.fixture(scope="module")
def ln(tmp_path_factory):
    yield from gs.linear_ln_gate(tmp_path_factory.mktemp("redteam17b-ln"), "rt17b (0_inference)", scan_off=True)


def test_a_candidate_cannot_signal_the_host(ln):
    gate, cap, _ = ln
    got: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
    try:
        verdict = gate.evaluate(Candidate(source=_with_kernel(cap.source, "cpp_rt17b(1, 0)"), proposer="redteam17b",
                                          note="signal the host"))
        time.sleep(0.5)
    finally:
        signal.signal(signal.SIGUSR1, old)
    print(verdict.status, verdict.reasons)
    assert not got, f"the host received {len(got)} SIGUSR1 from candidate code (verdict {verdict.status})"


def test_no_candidate_process_outlives_the_gate(tmp_path):
    marker = tmp_path / "escaped.pid"
    gen = gs.linear_ln_gate(tmp_path / "gate", "rt17b-escape (0_inference)", scan_off=True)
    gate, cap, _ = next(gen)
    try:
        verdict = gate.evaluate(Candidate(source=_with_kernel(cap.source, "cpp_rt17b(2, 30)", str(marker)),
                                          proposer="redteam17b", note="escape the process group"))
        print(verdict.status, verdict.reasons)
    finally:
        gen.close()  # gate.close(): every worker ended
    time.sleep(1.0)
    alive = None
    if marker.exists():
        pid = int(marker.read_text() or 0)
        before = marker.stat().st_mtime
        time.sleep(0.5)
        try:
            os.kill(pid, 0)
            alive = pid if marker.stat().st_mtime > before else None
        except ProcessLookupError:
            alive = None
        if alive:
            os.kill(pid, signal.SIGKILL)  # the test's own escapee
    assert alive is None, f"candidate process {alive} still running after the gate closed (verdict {verdict.status})"


# -- CPU time of a helper process is nobody's sample ---------------------------------------------------------------
#: The wrapper's whole computation (LinearLN: addmm, relu, residual, LayerNorm, +0.5) done by a helper process the
#: kernel forks on its first call, out of the worker's session (``setsid``: the session's process count, the
#: group's SIGSTOP and the final ``killpg`` miss it). Per call the worker copies the inputs into a shared mapping,
#: bumps a counter and *sleeps* (``nanosleep``, 8 ms: the helper's naive loops need ~5) until the helper is done,
#: then copies the output out. CPU test mode times ``CLOCK_PROCESS_CPUTIME_ID`` of the worker: the helper's CPU and
#: the sleep are not in it, so the candidate times ~0.1 ms of CPU per call while each call takes ≥ 8 ms of wall
#: time (the original: 0.44 ms). The host's consistency check bounds samples from above only.
OFFLOAD = r'''
cpp_offload = async_compile.cpp_pybinding(['const float*', 'const float*', 'const float*', 'const float*', 'const float*', 'float*'], r"""
#include <unistd.h>
#include <string.h>
#include <math.h>
#include <time.h>
#include <sched.h>
#include <sys/mman.h>
static float *shm = 0;
#define D @D@
#define M @M@
enum { W = 0, B = D*D, X = B + D, G = X + M*D, BE = G + D, OUT = BE + D, WT = OUT + M*D, SEQ = WT + D*D, DONE = SEQ + 16, TOTAL = DONE + 16 };
static volatile long *seq() { return (volatile long*)(shm + SEQ); }
static volatile long *done() { return (volatile long*)(shm + DONE); }
static void helper(int parent) {
    cpu_set_t set; CPU_ZERO(&set); CPU_SET(0, &set); sched_setaffinity(0, sizeof set, &set);
    long seen = 0; long idle = 0;
    for (;;) {
        long s = __atomic_load_n(seq(), __ATOMIC_ACQUIRE);
        if (s == seen) {
            if (++idle % 100000 == 0 && getppid() != parent) _exit(0);
            continue;  /* spin: this process's CPU time is nobody's sample */
        }
        const float *w = shm + W, *b = shm + B, *x = shm + X, *g = shm + G, *be = shm + BE;
        float *o = shm + OUT;
        float *wt = shm + WT;
        for (int j = 0; j < D; ++j) for (int k = 0; k < D; ++k) wt[k * D + j] = w[j * D + k];
        for (int i = 0; i < M; ++i) {
            float acc[D];
            for (int j = 0; j < D; ++j) acc[j] = b[j];
            for (int k = 0; k < D; ++k) { float xa = x[i * D + k]; const float *r = wt + k * D; for (int j = 0; j < D; ++j) acc[j] += xa * r[j]; }
@LN_ROW@
        }
        seen = s;
        __atomic_store_n(done(), s, __ATOMIC_RELEASE);
    }
}
extern "C" void kernel(const float *w, const float *b, const float *x, const float *g, const float *be, float *out) {
    if (!shm) {
        shm = (float*)mmap(0, TOTAL * 4, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        int parent = getpid();
        if (fork() == 0) { setsid(); helper(parent); _exit(0); }
    }
    memcpy(shm + W, w, D * D * 4); memcpy(shm + B, b, D * 4); memcpy(shm + X, x, M * D * 4);
    memcpy(shm + G, g, D * 4); memcpy(shm + BE, be, D * 4);
    long s = *seq() + 1;
    __atomic_store_n(seq(), s, __ATOMIC_RELEASE);
    struct timespec nap = {0, @NAP@};
    while (__atomic_load_n(done(), __ATOMIC_ACQUIRE) != s) { nanosleep(&nap, 0); nap.tv_nsec = 1000000; }  /* asleep: no CPU time */
    memcpy(out, shm + OUT, M * D * 4);
}
""")
'''




def _offload_source(src: str, d: int, m: int, nap_ns: int = 8_000_000) -> str:
    return linear_ln_native(src, OFFLOAD, "cpp_offload", d, m, NAP=str(nap_ns))


@pytest.mark.parametrize("control", [False, True])
def test_work_offloaded_to_a_helper_process_is_not_a_speedup(tmp_path, control):
    d, m = 256, 256
    verdict = gs.evaluate_once(tmp_path, "rt17b-offload (0_inference)", lambda src: _offload_source(src, d, m),
                               "offload to a helper process", scan_off=True, rows=m, width=d, control=control)
    assert verdict.status != "accepted", (verdict.timing, verdict.confirmation)


# -- the hard-linked precompiled headers -----------------------------------------------------------------------------
#: Appends a line to every file of ``$TMPDIR/@REL@`` (the worker's *own* private temporary folder: where the host's
#: precompiled headers were hard-linked before, :func:`tilesmith.gate.host.caches.share_precompiled_headers` now puts
#: symbolic links). A hard link is the same inode: the write landed in the host's ``codecache._HEADER_DIR``, which the
#: user's process and every later worker (the trusted one included) compile against. Through a symbolic link Landlock
#: checks the target's path, outside the worker's folder: refused.
HEADER_KERNEL = r'''
cpp_hdr = async_compile.cpp_pybinding(['int64_t'], r"""
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
extern "C" void kernel(int64_t unused) {
    const char *tmp = getenv("TMPDIR");
    if (!tmp) return;
    char dir[4096], path[4096 + 256];
    snprintf(dir, sizeof dir, "%s/@REL@", tmp);
    DIR *d = opendir(dir);
    if (!d) return;
    for (struct dirent *e; (e = readdir(d));) {
        size_t n = strlen(e->d_name);
        if (n < 2 || strcmp(e->d_name + n - 2, ".h") != 0) continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        int fd = open(path, O_WRONLY | O_APPEND);
        if (fd >= 0) { const char s[] = "\n/* rt17b: this line came from candidate code */\n"; write(fd, s, sizeof s - 1); close(fd); }
    }
    closedir(d);
}
""")
'''


def test_a_candidate_cannot_change_the_hosts_precompiled_headers(tmp_path):
    import tempfile

    from torch._inductor import codecache

    headers = Path(tempfile.mkdtemp(prefix="rt17b-headers-", dir=tempfile.gettempdir())) / "precompiled_headers"
    headers.mkdir()
    clean = '#include "/nonexistent/cpp_prefix.h"\n'
    (headers / "crt17b.h").write_text(clean)
    (headers / "crt17b.h.gch").write_bytes(b"not a real gch")
    rel = os.path.relpath(headers, tempfile.gettempdir())
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(codecache, "_HEADER_DIR", str(headers))  # a private stand-in for the user's header folder
        gen = gs.linear_ln_gate(tmp_path / "gate", "rt17b-header (0_inference)", scan_off=True)
        gate, cap, _ = next(gen)
        try:
            src = with_kernel(cap.source, HEADER_KERNEL.replace("@REL@", rel))
            verdict = gate.evaluate(Candidate(source=module_code(src, "cpp_hdr(0)"), proposer="redteam17b",
                                              note="append to the linked headers"))
        finally:
            gen.close()
    after = (headers / "crt17b.h").read_text()
    import shutil

    shutil.rmtree(headers.parent, ignore_errors=True)
    assert after == clean, f"host header changed (verdict {verdict.status}): {after!r}"


# -- the gate's cache template ---------------------------------------------------------------------------------------
#: The template (``<gate dir>/cache-template``, :func:`tilesmith.gate.host.caches.make_cache_template`) is a sibling
#: of every worker's private folder (``TORCHINDUCTOR_CACHE_DIR`` is ``<gate dir>/<worker>/inductor``). The candidate
#: builds a copy of the original's fused C++ kernel that also writes 12345 into element [0, 0] (another source, so
#: another cache key), and a native kernel copies that ``.so`` over the template's ``.so`` of the original kernel
#: (same relative path as in its own cache: its cache was seeded from the template). Every worker seeded later gets
#: the altered library under the original's key, and Inductor loads it without rebuilding.
TEMPLATE_COPY = r'''
cpp_copy = async_compile.cpp_pybinding(['const char*', 'const char*'], r"""
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <libgen.h>
extern "C" void kernel(const char *src, const char *orig) {
    const char *cache = getenv("TORCHINDUCTOR_CACHE_DIR");
    if (!cache || strncmp(orig, cache, strlen(cache)) != 0) return;
    char base[4096], dst[8192];
    snprintf(base, sizeof base, "%s", cache);
    char *gate = dirname(dirname(base));
    snprintf(dst, sizeof dst, "%s/cache-template/inductor%s", gate, orig + strlen(cache));
    int in = open(src, O_RDONLY);
    if (in < 0) return;
    off_t n = lseek(in, 0, SEEK_END); lseek(in, 0, SEEK_SET);
    char *buf = (char*)malloc(n);
    if (read(in, buf, n) != n) { close(in); return; }
    close(in);
    int out = open(dst, O_WRONLY | O_TRUNC);
    if (out >= 0) { write(out, buf, n); close(out); }
    free(buf);
}
""")
'''

def _poison_template_source(src: str) -> str:
    name = "cpp_fused_add_native_layer_norm_relu_0"
    i = src.index(name + " = async_compile.cpp_pybinding(")
    j = src.index("''')\n", i) + len("''')\n")
    block = src[i:j]
    k = block.rindex("}\n'''")
    evil = block[:k] + "    in_out_ptr0[0] = 12345.0f;\n" + block[k:]
    evil = evil.replace(name, "cpp_evil", 1)
    src = with_kernel(src, evil + "\n" + TEMPLATE_COPY)
    return module_code(src, "_b = lambda s: torch.tensor(list(s.encode()) + [0], dtype=torch.uint8)\n"
                            f"cpp_copy(_b(cpp_evil.__self__.__file__), _b({name}.__self__.__file__))")


def test_a_candidate_cannot_change_what_later_workers_load(tmp_path):
    gen = gs.linear_ln_gate(tmp_path / "gate", "rt17b-template (0_inference)", scan_off=True)
    gate, cap, _ = next(gen)
    try:
        template = {p: p.read_bytes() for p in gate._template.rglob("*") if p.is_file()} if gate._template else {}
        first = gate.evaluate(Candidate(source=_poison_template_source(cap.source), proposer="redteam17b",
                                        note="poison the cache template"))
        changed = [str(p) for p, data in template.items() if not p.is_file() or p.read_bytes() != data]
        later = []
        for i in range(3):  # the first may run in a spare seeded before the poisoning
            honest = gate.evaluate(Candidate(source=cap.source + f"\n# honest {i}\n", proposer="redteam17b",
                                             note="the original itself"))
            later.append((honest.status, " ".join(honest.reasons)[:200]))
    finally:
        gen.close()
    assert first.status != "accepted"
    assert template
    assert not changed, f"the candidate changed the gate's cache template: {changed[:3]}"
    assert not any("12345" in reasons for _, reasons in later), later


# -- the write rules themselves, from Python ---------------------------------------------------------------------------
_WRITE_PROBE = """
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("confine", sys.argv[1])  # the file alone: ctypes and os only
confine = importlib.util.module_from_spec(spec)
spec.loader.exec_module(confine)
folder, outside = sys.argv[2], sys.argv[3]
os.chdir(folder)
print("confinement:", confine.confine() if sys.argv[4] == "confined" else "not confined")
def attempt(what, action):
    try:
        action()
        print(what, "ok")
    except OSError as exc:
        print(what, "refused", exc.errno)
attempt("inside", lambda: open(os.path.join(folder, "f"), "w").close())
attempt("inside-rename", lambda: os.rename(os.path.join(folder, "f"), os.path.join(folder, "tmp", "g")))
attempt("devnull", lambda: open(os.devnull, "w").close())
attempt("append", lambda: open(outside, "a").close())
attempt("truncate", lambda: os.truncate(outside, 0))
attempt("create", lambda: open(outside + ".new", "w").close())
attempt("unlink", lambda: os.unlink(outside + ".keep"))
attempt("hardlink-in", lambda: os.link(outside, os.path.join(folder, "h")))
attempt("rename-in", lambda: os.rename(outside + ".move", os.path.join(folder, "r")))
attempt("through-symlink", lambda: open(os.path.join(folder, "tmp", "s"), "a").close())
attempt("read", lambda: open(outside).read())
"""


def test_a_confined_worker_writes_only_beneath_its_folder(tmp_path):
    """What the native kernels above did, from Python in a process confined as workers are (Landlock ABI >= 2): inside
    its folder everything works, outside it nothing is written, created, removed, truncated, linked or moved in,
    also through a symbolic link; reading is unchanged. Unconfined, the same process does all of it."""
    import subprocess
    import sys

    from tilesmith.gate.worker import confine

    if (confine.landlock_abi() or 0) < 2:
        pytest.skip("no Landlock ABI >= 2 here: writes are not confined (the report says so)")
    path = str(Path(__file__).resolve().parents[1] / "tilesmith" / "gate" / "worker" / "confine.py")

    def run(mode: str) -> dict[str, str]:
        folder, outside = tmp_path / mode / "w", tmp_path / mode / "shared.h"
        (folder / "tmp").mkdir(parents=True)
        outside.write_text("shared\n")
        for extra in ("keep", "move"):
            (tmp_path / mode / f"shared.h.{extra}").write_text(extra)
        (folder / "tmp" / "s").symlink_to(outside)
        out = subprocess.run([sys.executable, "-c", _WRITE_PROBE, path, str(folder), str(outside), mode],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
        if mode == "confined":
            assert outside.read_text() == "shared\n" and (tmp_path / mode / "shared.h.keep").exists()
            assert (tmp_path / mode / "shared.h.move").exists() and not (tmp_path / mode / "shared.h.new").exists()
        return lines

    free = run("free")
    assert all(v == "ok" for k, v in free.items() if k != "confinement:"), free
    confined = run("confined")
    assert "writes only beneath the worker's folder" in confined["confinement:"], confined
    assert {k: v.split()[0] for k, v in confined.items() if k != "confinement:"} == {
        "inside": "ok", "inside-rename": "ok", "devnull": "ok", "read": "ok",
        **{k: "refused" for k in ("append", "truncate", "create", "unlink", "hardlink-in", "rename-in",
                                  "through-symlink")}}, confined


def test_extra_writable_folders_reach_the_worker(tmp_path, monkeypatch):
    """``TILESMITH_GATE_WRITABLE`` (for a stack that writes outside the worker's folder): the one setting the worker's
    environment keeps besides the kernel folder, resolved, and added to the folders its Landlock rules allow."""
    from tilesmith.gate.host.process import worker_environment
    from tilesmith.gate.worker import confine

    extra, missing = tmp_path / "nv-cache", tmp_path / "absent"
    extra.mkdir()
    monkeypatch.setenv("TILESMITH_GATE_WRITABLE", f"{extra}{os.pathsep}{missing}")
    env = worker_environment(device_type="cpu")
    assert env["TILESMITH_GATE_WRITABLE"].split(os.pathsep) == [os.path.realpath(extra), os.path.realpath(missing)]
    monkeypatch.setenv("TILESMITH_GATE_WRITABLE", env["TILESMITH_GATE_WRITABLE"])
    monkeypatch.chdir(tmp_path)
    assert confine.worker_folders() == (os.path.realpath(tmp_path), os.path.realpath(extra))
    monkeypatch.delenv("TILESMITH_GATE_WRITABLE")
    assert "TILESMITH_GATE_WRITABLE" not in worker_environment(device_type="cpu")


_NO_LANDLOCK_PROBE = r"""
import os, sys, importlib.util
spec = importlib.util.spec_from_file_location("confine", sys.argv[1])
confine = importlib.util.module_from_spec(spec); spec.loader.exec_module(confine)
confine.landlock_abi = lambda: None  # a kernel without Landlock
os.chdir(sys.argv[2])
print("confinement:", confine.confine())
try:
    os.setsid(); print("setsid ok")
except OSError as exc:
    print("setsid refused", exc.errno)
"""


def test_without_landlock_the_worker_still_cannot_leave_its_session(tmp_path):
    """The setsid/setpgid seccomp filter does not depend on Landlock: on a kernel without it (simulated: ``landlock_abi``
    answers ``None``) ``confine()`` takes the non-dumpable path and still installs the filter, so a forked helper
    cannot leave the process group the host stops and kills (red team 17b's helper, on such a kernel)."""
    import errno
    import subprocess
    import sys

    from tilesmith.gate.worker import confine

    if confine._SECCOMP_ABI.get(os.uname().machine) is None:
        pytest.skip("no seccomp filter for this machine type")
    path = str(Path(__file__).resolve().parents[1] / "tilesmith" / "gate" / "worker" / "confine.py")
    # The probe leads no process group, so an unfiltered setsid() succeeds: the mutant without the filter fails here.
    out = subprocess.run([sys.executable, "-c", _NO_LANDLOCK_PROBE, path, str(tmp_path)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "non-dumpable (Landlock is not available)" in out.stdout and "no new sessions (seccomp)" in out.stdout, out.stdout
    assert f"setsid refused {errno.EPERM}" in out.stdout, out.stdout
