"""The gate never runs invented integer/boolean inputs in the user's process (CPU, real Gate).

The gate varies masks, positions and indices (tilesmith.gate.inputs). An index the original reads out of bounds
is a device-side assert on CUDA, which poisons the user's CUDA context, so such input lists must run in a
trusted worker (tilesmith.gate.host.reference.ScreenedReference); the user's own callable sees only the first real
call's integer values.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests import gate_support as gs
from tilesmith.gate.host.reference import invents_values
from tilesmith.records import Candidate


class Gather(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = torch.nn.Parameter(torch.randn(64, 16))

    def forward(self, x, idx):
        return (self.table[idx] * x).relu()


def test_invents_values_sees_changed_integers_and_ignores_floats():
    base = [torch.randn(4), torch.tensor([3, 1, 2]), torch.tensor([True, False])]
    floats_only = [torch.randn(4), base[1].clone(), base[2].clone()]
    assert not invents_values(floats_only, base)
    assert invents_values([base[0], torch.tensor([1, 1, 2]), base[2]], base)
    assert invents_values([base[0], base[1], torch.tensor([True, True])], base)


def test_varied_indices_run_in_a_trusted_worker_not_in_the_host(tmp_path, monkeypatch):
    from tilesmith.gate import Gate

    monkeypatch.setenv("TILESMITH_ALLOW_CPU", "1")
    monkeypatch.setenv("TILESMITH_GATE_RUN_TIMEOUT_S", "60")
    idx = torch.randint(0, 64, (32,))
    cap = gs.capture(Gather(), torch.randn(32, 16), idx)[0]
    seen: list[list[torch.Tensor]] = []

    def host_ref(args):
        seen.append([a.clone() for a in args if isinstance(a, torch.Tensor) and not a.is_floating_point()])
        return cap.ref_fn(args)

    problem = gs.make_problem(cap, tmp_path / "snapshot", label=f"c0ffee00 ({cap.graph.name})")
    with Gate(problem, reference=host_ref, profiles_dir=tmp_path / "profiles", timing_pairs=6) as gate:
        verdict = gate.evaluate(Candidate(source=cap.source, proposer="unchanged"))
    assert verdict.failures == (), verdict.reasons
    captured_ints = [a for a in cap.inputs if isinstance(a, torch.Tensor) and not a.is_floating_point()]
    assert seen and captured_ints
    for ints in seen:  # the host callable only ever saw the first call's index values
        assert all(torch.equal(a, b) for a, b in zip(ints, captured_ints, strict=True))
    report = json.loads(open(verdict.report_path).read())
    assert report["reference"]["source"] == "host callable"
    assert report["reference"]["runs_in_trusted_worker"] > 0


def test_invented_values_the_original_rejects_fall_back_to_captured_ones(tmp_path, monkeypatch):
    from tilesmith.gate.host.phase import HighScale, checked_variant
    from tilesmith.gate.host.reference import HostReference, ScreenedReference
    from tilesmith.errors import WorkerError

    base = [torch.randn(8), torch.tensor([5])]

    class Failing:
        def __init__(self) -> None:
            self.worker = type("W", (), {"alive": staticmethod(lambda: True), "kill": staticmethod(lambda: None)})()

        def run(self, values, seed, repeat=1):
            raise WorkerError("device-side assert triggered (simulated)")

    host_calls = []

    def ref_fn(args):
        host_calls.append(int(args[1]))
        return (args[0] * 2,)

    screened = ScreenedReference(HostReference(ref_fn, torch.device("cpu"), ()), base, lambda: None, tmp_path, 5.0)
    screened._trusted = Failing()  # the trusted worker "crashes" on every invented value
    fallbacks = 0
    for seed in range(8):
        notes: dict[str, str] = {}
        values, ref, varied = checked_variant(base, "random", 1234 + seed, screened, HighScale(base, ""), notes)
        if not varied:
            fallbacks += 1
            assert "used permuted captured values" in next(iter(notes.values()))
        assert torch.equal(ref.outputs[0], values[0] * 2)
    assert fallbacks > 0  # a one-element position is varied often enough to hit the failing worker
    assert host_calls and all(v == 5 for v in host_calls)  # the host never ran an invented position
