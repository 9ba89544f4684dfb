"""CPU test mode on a busy machine: samples are the worker's CPU time, so processes competing for the cores
delay the calls without lengthening them, and the verdicts do not flip (issue 19, item 4).

Two CPU burner processes (``while True: pass``, one per core of the 2-core CI machine) run beside the gate
for the whole test; the honest, clearly faster candidate must still be accepted (both phases) and the
identical one must not be.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests import gate_support as gs
from tilesmith.records import Candidate


@pytest.fixture
def burners():
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait(timeout=30)


def test_verdicts_hold_with_cpu_burners_beside_the_gate(burners, tmp_path, monkeypatch):
    from tilesmith.gate import Gate

    monkeypatch.setenv("TILESMITH_ALLOW_CPU", "1")
    torch.manual_seed(2)
    chain = gs.capture(gs.Chain(), torch.randn(512, 768))[0]
    with Gate(gs.make_problem(chain, tmp_path / "snapshot", label="b0a0b0a0 (0_inference)"), reference=chain.ref_fn,
              profiles_dir=tmp_path / "profiles", timing_pairs=10) as gate:
        assert all(p.poll() is None for p in burners)
        faster = gate.evaluate(Candidate(source=gs.reassociate_chain(chain.source), proposer="scripted"))
        same = gate.evaluate(Candidate(source=chain.source, proposer="control"))
        assert all(p.poll() is None for p in burners)  # they competed for the whole evaluation
    assert faster.status == "accepted", faster.reasons
    assert faster.timing.method == faster.confirmation.method == "process_cpu_time"
    assert same.failures == (), same.reasons
    assert not same.accepted, same.summary()
