"""The gate with its fork server on (``TILESMITH_GATE_FORKSERVER=1``, CPU test mode): workers forked from a zygote
decide like started ones (an identical candidate is not accepted, a truly faster one is, a thread started at
import is caught), get no secret and their own caches, cannot reach the zygote, and the zygote's death only makes
workers start with ``subprocess`` again."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from tests import gate_support as gs
from tests.cheats.common import module_code
from tilesmith.records import Candidate

SECRET = "sk-fork-test-0123456789abcdef0123456789"

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open") or not Path("/proc/self/fd").exists(),
                                reason="needs Linux pidfds and /proc")


@pytest.fixture(scope="module")
def env():
    from tilesmith.gate.host import forkserver

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TILESMITH_ALLOW_CPU", "1")
        mp.setenv("TILESMITH_GATE_FORKSERVER", "1")
        mp.setenv("OPENAI_API_KEY", SECRET)
        mp.setenv("MY_SERVICE_TOKEN", "tok-" + SECRET)
        assert forkserver.prepare("cpu", timeout_s=600)
        yield mp


@pytest.fixture(scope="module")
def chain(env) -> gs.Captured:
    torch.manual_seed(2)
    return gs.capture(gs.Chain(), torch.randn(512, 768))[0]


@pytest.fixture(scope="module")
def gate(chain, env, tmp_path_factory):
    yield from gs.chain_gate(chain, tmp_path_factory.mktemp("fork-gate"), "f0c4e700 (0_inference)")


def _zygote():
    from tilesmith.gate.host import forkserver

    return forkserver._servers["cpu"]


def _sockets(pid: int) -> set[str]:
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found.add(target)
    return found


def test_the_gates_workers_are_forked_and_a_truly_faster_candidate_is_accepted(gate, chain):
    from tilesmith.gate.host.forkserver import ForkedProcess

    assert all(isinstance(w.proc, ForkedProcess) for w in gate._workers), [type(w.proc) for w in gate._workers]
    assert gate._trusted.ready_info.get("forked") is True
    verdict = gate.evaluate(Candidate(source=gs.reassociate_chain(chain.source), proposer="scripted", note="fast"))
    assert verdict.status == "accepted", verdict.reasons


def test_an_identical_candidate_is_not_accepted(gate, chain):
    verdict = gate.evaluate(Candidate(source=chain.source, proposer="scripted", note="identical"))
    assert verdict.status != "accepted", verdict.reasons


def test_a_thread_started_at_import_is_rejected(gate, chain):
    source = module_code(gs.reassociate_chain(chain.source),
                         '_Thread = getattr(torch.cuda, "thre" + "ading").Thread\n'
                         '_t = _Thread(target=torch._inductor.utils.time.sleep, args=(60,), daemon=True)\n'
                         '_t.start()')
    verdict = gate.evaluate(Candidate(source=source, proposer="scripted", note="thread"))
    assert verdict.status != "accepted"
    assert "thread" in " ".join(verdict.reasons).lower(), verdict.reasons


def test_a_forked_workers_environment_has_no_secret_and_its_own_caches(gate, chain, monkeypatch):
    monkeypatch.setattr("tilesmith.gate.host.gate.scan", lambda source: [])  # the probe reads os.environ
    probe = ('_os = torch.os\n_e, _d = _os.environ, _os.getcwd()\n'
             'raise RuntimeError("SECRETS=%d CACHE=%s TMP=%s ZYGOTE=%s" % (sum(1 for v in _e.values() if "sk-fork" in v), '
             '_e["TORCHINDUCTOR_CACHE_DIR"] == _d + "/inductor", _e["TMPDIR"] == _d + "/tmp", "zygote" in _d))')
    verdict = gate.evaluate(Candidate(source=module_code(chain.source, probe), proposer="scripted", note="env"))
    text = " ".join(verdict.reasons)
    assert verdict.status != "accepted" and "SECRETS=0 CACHE=True TMP=True ZYGOTE=False" in text, text
    assert SECRET.encode() not in Path(f"/proc/{_zygote().proc.pid}/environ").read_bytes()
    for worker in [w for w in gate._workers if w.alive()]:
        assert SECRET.encode() not in Path(f"/proc/{worker.pid}/environ").read_bytes()
        assert SECRET not in str(worker.environ)


def test_a_forked_worker_cannot_reach_the_zygotes_control_socket(gate):
    zygote = _zygote()
    theirs = _sockets(zygote.proc.pid)
    assert theirs  # the zygote's end of the control channel
    worker = gate._take_worker()
    try:
        worker.wait_ready(120)
        assert worker.ready_info.get("forked") is True
        assert not (_sockets(worker.pid) & theirs)
        assert not _sockets(worker.pid)
        assert os.getsid(worker.pid) == worker.pid != os.getsid(zygote.proc.pid)
        assert os.readlink(f"/proc/{worker.pid}/cwd") == str(worker.dir)
        assert worker.os_counts() == gate._trusted.os_counts() or worker.os_counts()[0] <= gate._trusted_counts[0]
    finally:
        worker.kill()
    assert worker.proc.returncode == -signal.SIGKILL and not worker.alive()


def test_the_zygotes_death_falls_back_to_subprocess(gate, chain, tmp_path):
    from tilesmith.gate.host.forkserver import UNKNOWN_EXIT, ForkedProcess
    from tilesmith.gate.host.process import WorkerProcess

    forked = WorkerProcess(tmp_path, label="before the zygote died", device_type="cpu")
    assert isinstance(forked.proc, ForkedProcess)
    zygote = _zygote()
    os.killpg(zygote.proc.pid, signal.SIGKILL)  # its whole group: a forked worker has its own session
    zygote.proc.wait(timeout=30)
    try:
        assert forked.wait_ready(120)["forked"] is True  # a worker forked earlier goes on
        assert forked.alive()
    finally:
        forked.kill()
    assert forked.proc.returncode == UNKNOWN_EXIT and not forked.alive()
    fallback = WorkerProcess(tmp_path, label="after the zygote died", device_type="cpu")
    try:
        assert isinstance(fallback.proc, subprocess.Popen)
        assert "forked" not in fallback.wait_ready(300)
    finally:
        fallback.kill()


_FAKE_LIBCUDA = r"""
static int initialised = 0;
int cuInit(unsigned int flags) { (void)flags; initialised = 1; return 0; }
int cuCtxGetCurrent(void **context) { if (!initialised) return 3; *context = 0; return 0; }
"""

_PROBE = """
import ctypes, importlib.util, sys
spec = importlib.util.spec_from_file_location("zygote", sys.argv[1])  # the file alone: standard library only
zygote = importlib.util.module_from_spec(spec)
spec.loader.exec_module(zygote)
seen = [zygote.cuda_driver_initialised()]
lib = ctypes.CDLL(sys.argv[2])
seen.append(zygote.cuda_driver_initialised())
seen.append(zygote._refusal())
lib.cuInit(0)
seen.append(zygote.cuda_driver_initialised())
seen.append(zygote._refusal())
print(repr(seen))
"""


def test_zygote_refuses_after_cuinit_not_after_loading_libcuda(tmp_path):
    """``import torch`` maps ``libcuda`` on a GPU machine without initialising CUDA, and a fork is fine then; only
    a ``cuInit`` in the zygote makes it refuse. Checked with a stand-in ``libcuda.so.1`` (its soname, its two
    entry points' documented answers), so it runs without a GPU."""
    import shutil
    import sys

    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    source = tmp_path / "fake_cuda.c"
    source.write_text(_FAKE_LIBCUDA)
    lib = tmp_path / "libcuda.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(lib), str(source)], check=True)
    zygote = Path(__file__).resolve().parents[1] / "tilesmith" / "gate" / "worker" / "zygote.py"
    out = subprocess.run([sys.executable, "-c", _PROBE, str(zygote), str(lib)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    not_loaded, loaded, refusal_loaded, initialised, refusal_initialised = eval(out.stdout)  # noqa: S307 - our repr
    assert (not_loaded, loaded, refusal_loaded) == (False, False, None)
    assert initialised is True and "cuInit" in refusal_initialised


def test_rebase_moves_module_paths_and_module_objects_paths(tmp_path):
    """A forked worker's copies of paths computed at import under the zygote's folder (module globals, and
    attributes of module-level objects such as Dynamo's cache object) point into the worker's folder; other values,
    and paths that only share a prefix string, are left alone."""
    import importlib.util
    import sys
    import types

    spec = importlib.util.spec_from_file_location(
        "zygote_file", Path(__file__).resolve().parents[1] / "tilesmith" / "gate" / "worker" / "zygote.py")
    zygote = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zygote)
    old, new = str(tmp_path / "zyg"), str(tmp_path / "w1")
    holder = types.SimpleNamespace(prefix=old + "/inductor/dynamo", other=3, near=old + "x/inductor")
    module = types.ModuleType("tilesmith_rebase_probe")
    module.HEADER = old + "/tmp/headers"
    module.ROOT = Path(old)
    module.SIBLING = old + "-other/tmp"
    module.cache = holder
    sys.modules[module.__name__] = module
    try:
        assert zygote._rebase_globals(old, new) == 3
    finally:
        del sys.modules[module.__name__]
    assert module.HEADER == new + "/tmp/headers" and module.ROOT == Path(new)
    assert module.SIBLING == old + "-other/tmp"
    assert holder.prefix == new + "/inductor/dynamo" and holder.other == 3 and holder.near == old + "x/inductor"


def test_a_cuda_zygote_starts_without_threads_where_torch_would_start_an_openmp_pool():
    """``import torch`` without ``OMP_NUM_THREADS`` starts one OpenMP thread per core; the CUDA zygote (whose
    workers' environment does not pin threads, unlike CPU test mode's) must still have one thread, or it refuses
    every fork. Runs on the CPU: a CUDA zygote imports, it never touches a device. Needs ≥ 2 cores to mean
    anything."""
    from tilesmith.gate.host import forkserver

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: torch starts no OpenMP threads anyway")
    environ = {k: v for k, v in os.environ.items() if k not in forkserver.ZYGOTE_THREAD_ENV}
    environ.pop("OMP_THREAD_LIMIT", None)
    try:
        assert forkserver.prepare("cuda", environ=environ, timeout_s=600), forkserver._servers["cuda"].info
        assert forkserver._servers["cuda"].info.get("refusal") is None
        # ... and asks NVML, not cuInit, whether CUDA is there (on a GPU machine cuInit's thread refuses every fork)
        environ_of_zygote = Path(f"/proc/{forkserver._servers['cuda'].proc.pid}/environ").read_bytes().split(b"\0")
        assert b"PYTORCH_NVML_BASED_CUDA_CHECK=1" in environ_of_zygote
    finally:
        forkserver.shutdown()
