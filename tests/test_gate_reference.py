"""The reference comes from the gate's trusted worker (the original wrapper alone in its own process): the
user's own callable is never called by the gate, so invented integer/boolean inputs (varied masks, positions,
indices; tilesmith.gate.inputs) never run in the user's process, where an out-of-range index would be a
device-side assert that poisons the user's CUDA context (CPU, real Gate; the fall-back rule with a fake).
"""

from __future__ import annotations

import json

import torch

from tests import gate_support as gs
from tilesmith.errors import WorkerError
from tilesmith.gate.host.phase import PhaseInputs, Variants, derive_seed
from tilesmith.gate.host.reference import ReferenceRejected, RefResult
from tilesmith.records import Candidate


class Gather(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = torch.nn.Parameter(torch.randn(64, 16))

    def forward(self, x, idx):
        return (self.table[idx] * x).relu()


def test_the_users_callable_is_never_called_and_varied_indices_run_in_the_trusted_worker(tmp_path, monkeypatch):
    from tilesmith.gate import Gate

    monkeypatch.setenv("TILESMITH_ALLOW_CPU", "1")
    monkeypatch.setenv("TILESMITH_GATE_RUN_TIMEOUT_S", "60")
    idx = torch.randint(0, 64, (32,))
    cap = gs.capture(Gather(), torch.randn(32, 16), idx)[0]
    seen: list[int] = []

    def host_ref(args):
        seen.append(len(args))
        return cap.ref_fn(args)

    problem = gs.make_problem(cap, tmp_path / "snapshot", label=f"c0ffee00 ({cap.graph.name})")
    with Gate(problem, reference=host_ref, profiles_dir=tmp_path / "profiles", timing_pairs=6) as gate:
        verdict = gate.evaluate(Candidate(source=cap.source, proposer="unchanged"))
    assert verdict.failures == (), verdict.reasons
    assert seen == []  # the user's process did no reference run at all
    report = json.loads(open(verdict.report_path).read())
    assert report["reference"]["source"] == "trusted worker" and report["reference"]["runs"] > 10
    assert report["reference"]["trusted_pid"] not in {p["worker_pid"] for p in report["phases"]}


class _Picky:
    """Stands in for the trusted reference of an original that bounds-checks its index input: every varied
    recipe is rejected (as a device-side assert or Inductor's CPU index check would), conservative ones run."""

    def __init__(self) -> None:
        self.asked: list[dict] = []

    def submit(self, runs):
        self.asked += runs
        return runs

    def collect(self, runs, what=""):
        out = []
        for run in runs:
            spec = run["inputs"]
            if spec["vary"] and spec["variant"] != "normal":
                out.append(ReferenceRejected("RuntimeError: index out of bounds: 0 <= tmp0 < 64"))
            else:
                out.append(RefResult([torch.zeros(2)], [{"kind": "tensor"}], rng="r", nonfinite=0))
        return out


def test_invented_values_the_original_rejects_fall_back_to_captured_ones():
    picky = _Picky()
    seeds = {k: derive_seed("t", k) for k in ("normal", "random", "random_b", "random_c", "random_d", "random_e",
                                               "random_f", "zero", "high_magnitude", "pool")}
    phase = PhaseInputs(picky, Variants([64.0, 8.0], duplicates=False), seeds)
    phase.submit()
    phase.collect()
    assert phase.recipes["normal"]["variant"] == "normal"
    for key in ("random", "random_b", "zero", "pool"):
        assert phase.recipes[key]["vary"] is False, key  # the conservative recipe replaced the varied one
    assert all("used permuted captured values" in note for note in phase.notes.values()) and phase.notes
    assert "high_magnitude" not in phase.recipes  # every varied high-magnitude rung was rejected
    assert phase.pool == [phase.recipes["normal"], phase.recipes["pool"]]


def test_the_original_failing_on_the_captured_inputs_is_a_gate_error():
    class Broken(_Picky):
        def collect(self, runs, what=""):
            return [ReferenceRejected("RuntimeError: broken original") for _ in runs]

    seeds = {k: 1 for k in ("normal", "random", "random_b", "random_c", "random_d", "random_e", "random_f", "zero",
                            "high_magnitude", "pool")}
    phase = PhaseInputs(Broken(), Variants([], duplicates=False), seeds)
    phase.submit()
    try:
        phase.collect()
    except WorkerError as exc:
        assert "broken original" in str(exc)
    else:
        raise AssertionError("a failing original must stop the gate")
