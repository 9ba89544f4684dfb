"""Fault suite (CPU, CI): crashing, hanging and resource-abusing candidates cost only the candidate.

Each fault must be rejected with its status and check id, the host process (and the user's tensors)
must be untouched, and the same Gate must evaluate the next candidate normally afterwards.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests import gate_support as gs
from tests.cheats.common import module_code
from tests.cheats.faults import FAULTS
from tilesmith.records import Candidate


@pytest.fixture(scope="module")
def cap() -> gs.Captured:
    torch.manual_seed(1)
    return gs.capture(gs.LinearLN(), torch.randn(32, 64))[0]


@pytest.fixture(scope="module")
def user_tensors(cap):
    """The user's view: inputs and the outputs the original produced before any candidate ran."""
    args = [a.clone() for a in cap.inputs]
    out = cap.ref_fn(list(args))[0].clone()
    return args, out


@pytest.fixture(scope="module")
def gate(cap, user_tensors, tmp_path_factory):
    from tilesmith.gate import Gate

    root = tmp_path_factory.mktemp("fault-gate")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TILESMITH_ALLOW_CPU", "1")
        mp.setenv("TILESMITH_GATE_RUN_TIMEOUT_S", "8")
        mp.setenv("TILESMITH_WORKER_TIMEOUT_S", "20")
        g = Gate(gs.make_problem(cap, root / "snapshot", label="fa11fa11 (0_inference)"), reference=cap.ref_fn,
                 profiles_dir=root / "profiles", timing_pairs=6)
        yield g
        g.close()


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.name)
def test_fault_costs_only_the_candidate(fault, gate, cap, user_tensors, monkeypatch):
    gs.runtime_checks_only(monkeypatch)  # faults reach the worker even where the static scan would refuse them
    verdict = gate.evaluate(Candidate(source=fault.make(cap.source), proposer=f"fault:{fault.name}"))
    assert verdict.status == fault.status, verdict.reasons
    assert fault.check in [f.check for f in verdict.failures], verdict.reasons
    assert verdict.report_path and os.path.isfile(verdict.report_path)
    # The host is alive and the user's tensors and results are what they were.
    args, out = user_tensors
    again = cap.ref_fn([a.clone() for a in args])[0]
    assert torch.equal(again, out)


def test_crash_reason_names_the_signal(gate, cap, monkeypatch):
    gs.runtime_checks_only(monkeypatch)
    verdict = gate.evaluate(Candidate(source=FAULTS[0].make(cap.source), proposer="fault:segfault"))
    assert "SIGSEGV" in " ".join(verdict.reasons)


def test_printing_to_stdout_does_not_disturb_the_protocol(gate, cap):
    noisy = module_code(cap.source, 'print("{\\"id\\": 2, \\"ok\\": true}\\n" * 20000)')
    verdict = gate.evaluate(Candidate(source=noisy, proposer="noisy"))
    assert verdict.failures == (), verdict.reasons
    assert verdict.timing is not None


def test_gate_evaluates_normally_after_every_fault(gate, cap):
    verdict = gate.evaluate(Candidate(source=cap.source, proposer="control"))
    assert verdict.failures == (), verdict.reasons
    assert verdict.timing is not None and len(verdict.timing.candidate_ms) == 6


def test_close_kills_every_worker(cap, tmp_path, monkeypatch):
    from tilesmith.gate import Gate

    monkeypatch.setenv("TILESMITH_ALLOW_CPU", "1")
    g = Gate(gs.make_problem(cap, tmp_path / "snapshot"), reference=cap.ref_fn, timing_pairs=4)
    pids = [w.pid for w in g._workers]
    assert pids
    g.close()
    g.close()  # idempotent
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not os.path.exists(g.dir)
