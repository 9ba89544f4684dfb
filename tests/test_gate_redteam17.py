"""Red team 17: the in-process control arm (``Gate.control``) and the fork server (``TILESMITH_GATE_FORKSERVER=1``).

Each test is a hole a helper found by running a cheating candidate through a real Gate in CPU test mode (all three
were accepted, or changed later workers, before the fixes): the control arm's own check
(``stats.control_holds``), MKL/oneDNN verbose tripwires (``torchstate._TRIPWIRES``), and each worker's confinement
(``tilesmith/gate/worker/confine.py``).
"""

from __future__ import annotations

import pytest
import torch

from tests import gate_support as gs
from tests.cheats.common import after_clear, before_return, module_code, with_kernel
from tilesmith.records import Candidate

#: MKL's verbose mode (``torch._C._verbose.mkl_set_verbose``): process-global, no getter, not probed by
#: :mod:`tilesmith.gate.sidefx`; while on, every MKL BLAS call times itself and prints a line (5.6 → 22.9 µs for
#: a 32×64×64 addmm on the CI VM).
MKL_VERBOSE_ON = "torch._C._verbose.mkl_set_verbose(1)"
MKL_VERBOSE_OFF = "torch._C._verbose.mkl_set_verbose(0)"


@pytest.fixture(scope="module")
def ln(tmp_path_factory):
    yield from gs.linear_ln_gate(tmp_path_factory.mktemp("redteam17-ln"), "rt17 (0_inference)")


@pytest.fixture()
def controlled(ln):
    gate, cap, _ = ln
    gate.control = True  # as on CUDA; off by default in CPU test mode
    yield gate, cap
    gate.control = False


def test_a_candidate_that_slows_only_its_processs_control_is_not_accepted(controlled):
    gate, cap = controlled
    source = before_return(after_clear(cap.source, [MKL_VERBOSE_OFF]), [MKL_VERBOSE_ON])
    verdict = gate.evaluate(Candidate(source=source, proposer="redteam17", note="mkl verbose toggle"))
    assert verdict.status != "accepted", (verdict.timing, verdict.confirmation)


@pytest.mark.parametrize("spelling", [MKL_VERBOSE_ON,
                                      "torch.backends.mkl.verbose(torch.backends.mkl.VERBOSE_ON).__enter__()",
                                      "torch._C._verbose.mkldnn_set_verbose(1)"])
def test_library_verbose_mode_left_on_is_a_global_state_change(ln, spelling):
    gate, cap, _ = ln
    source = module_code(cap.source, spelling)
    verdict = gate.evaluate(Candidate(source=source, proposer="redteam17", note="verbose mode at import"))
    assert verdict.status == "rejected_global_state", verdict.reasons


def test_the_controlled_rule_rejects_a_control_slower_than_the_baseline():
    """The rule itself (no worker): a candidate as fast as the original (0.5 % faster: the guard holds) whose process
    runs the original's code 1.8× slower (the MKL toggle's numbers) passes candidate vs control but not the
    control's own check; the same
    samples with an honest control (the process bias seen on the H100, 1.01×) and a real 5 % gain pass."""
    from tilesmith.gate.host import stats

    base = [1.00, 1.01, 0.99, 1.00, 1.02, 0.98, 1.00, 1.01, 0.99, 1.00]
    slowed = [b * 1.8 for b in base]
    as_fast = [b / 1.005 for b in base]  # the guard (≥ 1 over the baseline in its own process) holds
    assert stats.decide(slowed, as_fast, 10, 0.02)[0] == "pass"  # what the control alone would say
    assert stats.guard_holds(stats.paired_speedup(base, as_fast).speedup)
    assert stats.decide_controlled(base, slowed, as_fast, 10, 0.02)[0] == "marginal"
    assert not stats.control_holds(base, slowed) and not stats.control_holds(base, slowed, allowance=0.15)
    honest = [b / 1.01 for b in base]
    faster = [b / 1.05 for b in base]
    assert stats.control_holds(base, honest)
    assert stats.decide_controlled(base, honest, faster, 10, 0.02)[0] == "pass"
    assert stats.control_holds(base, [b * 1.02 for b in base])  # within CONTROL_TOLERANCE


# -- the fork server ---------------------------------------------------------------------------------------------
#: A C++ kernel (compiled through the wrapper's own ``async_compile.cpp_pybinding``, as Inductor's CPU kernels are)
#: that opens its parent's memory with ``openat`` (the static scan's native patterns match ``open(`` but not
#: ``openat(``; the audit hook sees no native call) and writes ``n`` bytes at ``addr``. In a forked worker the
#: parent is the zygote, and every object the zygote made before the fork has the same address in the child, so
#: ``id(obj)`` in the candidate is the object's address in the zygote.
POKE_KERNEL = r'''
cpp_poke = async_compile.cpp_pybinding(['int64_t', 'int64_t'], r"""
#include <unistd.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
extern "C" void kernel(int64_t addr, int64_t n) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/mem", (int)getppid());
    int fd = openat(AT_FDCWD, path, O_RDWR);
    if (fd < 0) return;
    char buf[64];
    memset(buf, 'Z', sizeof buf);
    pwrite(fd, buf, (size_t)n, (off_t)addr);
    close(fd);
}
""")
'''
#: Overwrite the characters of ``torch.version.git_version`` (a compact ASCII str: its characters start 48 bytes
#: after the object on CPython 3.11, 40 on 3.12+) in the zygote; harmless, and any later forked worker shows it.
POKE_CALL = "_s = torch.version.git_version\ncpp_poke(id(_s) + 48, 8)"


@pytest.fixture(scope="module")
def forked_ln(tmp_path_factory):
    import os
    from pathlib import Path

    from tilesmith.gate.host import forkserver

    if not hasattr(os, "pidfd_open") or not Path("/proc/self/fd").exists():
        pytest.skip("needs Linux pidfds and /proc")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TILESMITH_ALLOW_CPU", "1")
        mp.setenv("TILESMITH_GATE_FORKSERVER", "1")
        assert forkserver.prepare("cpu", timeout_s=600)
        try:  # the static scan off: it now names openat/pwrite, and confinement must hold without it
            yield from gs.linear_ln_gate(tmp_path_factory.mktemp("redteam17-fork"), "rt17f (0_inference)",
                                         scan_off=True)
        finally:
            forkserver.shutdown()  # the zygote this module poked is not reused by later tests


def _confinement_can_hold() -> None:
    import os

    from tilesmith.gate.worker import confine

    if confine.landlock_abi() is None and os.geteuid() == 0:
        pytest.skip("no Landlock and running as root: a non-dumpable worker does not stop root (docs/gate.md)")


def test_a_forked_candidate_cannot_change_what_later_forked_workers_inherit(forked_ln):
    _confinement_can_hold()
    gate, cap, _ = forked_ln
    clean = torch.version.git_version
    source = module_code(with_kernel(cap.source, POKE_KERNEL), POKE_CALL)
    first = gate.evaluate(Candidate(source=source, proposer="redteam17", note="poke the zygote"))
    assert first.status != "accepted", first.reasons
    seen = []
    for i in range(5):  # the first probes may run in spare workers forked before the poke
        probe = module_code(cap.source, f'raise RuntimeError("GITVERSION=" + torch.version.git_version)  # {i}')
        text = " ".join(gate.evaluate(Candidate(source=probe, proposer="redteam17", note="probe")).reasons)
        seen.append(text[text.find("GITVERSION=") + 11:][:len(clean)])
    assert all(s == clean for s in seen), seen


_OPEN_PARENT_MEMORY = """
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("confine", sys.argv[1])  # the file alone: ctypes and os only
confine = importlib.util.module_from_spec(spec)
spec.loader.exec_module(confine)
done = confine.confine() if sys.argv[2] == "confined" else "not confined"
for flags in (os.O_RDWR, os.O_RDONLY):
    target = "/proc/%d/mem" % os.getppid()
    try:
        os.close(os.open(target, flags))
        print("opened", target, flags, "|", done)
    except OSError as exc:
        print("denied", target, flags, exc.errno, "|", done)
"""


def test_a_confined_worker_cannot_open_another_processs_memory():
    """What the red team's native kernel did with ``openat`` + ``pwrite``, done from Python in a process confined
    as workers are: opening its parent's memory, for writing or reading, is refused by the kernel; the same process
    unconfined opens it (so the test sees the difference, not a machine that refuses anyway)."""
    import subprocess
    import sys
    from pathlib import Path

    _confinement_can_hold()
    path = str(Path(__file__).resolve().parents[1] / "tilesmith" / "gate" / "worker" / "confine.py")

    def run(mode: str) -> list[str]:
        out = subprocess.run([sys.executable, "-c", _OPEN_PARENT_MEMORY, path, mode], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()

    free = run("free")
    if not all(line.startswith("opened") for line in free):
        pytest.skip(f"this machine refuses it unconfined already: {free}")
    confined = run("confined")
    assert len(confined) == 2 and all(line.startswith("denied") for line in confined), confined
