"""Cheat suite (CPU, CI): cheating candidates derived from real Inductor wrappers are each rejected by the
gate for the right reason (the asserted check id), and the unedited wrappers pass every check."""

from __future__ import annotations

import pytest
import torch

from tests import gate_support as gs
from tests.cheats.cpu import CHEATS, SABOTAGE
from tilesmith.records import Candidate


@pytest.fixture(scope="module")
def graphs() -> dict[str, gs.Captured]:
    torch.manual_seed(0)
    ln = gs.capture(gs.LinearLN(), torch.randn(32, 64))[0]
    train = [c for c in gs.capture(gs.LinearLN(), torch.randn(32, 64, requires_grad=True), grad=True)
             if c.graph.kind == "forward"][0]
    log = gs.capture(gs.LogScale(), torch.rand(32, 64) + 0.1)[0]
    return {"ln": ln, "train": train, "log": log}


class _Gates:
    def __init__(self, graphs: dict[str, gs.Captured], root) -> None:
        self.graphs, self.root, self.open = graphs, root, {}

    def get(self, name: str):
        from tilesmith.gate import Gate

        if name not in self.open:
            cap = self.graphs[name]
            problem = gs.make_problem(cap, self.root / name / "snapshot", label=f"c0ffee00 ({cap.graph.name})")
            self.open[name] = Gate(problem, reference=cap.ref_fn, profiles_dir=self.root / name / "profiles",
                                   timing_pairs=8)
        return self.open[name]

    def close(self) -> None:
        for gate in self.open.values():
            gate.close()


@pytest.fixture(scope="module")
def gates(graphs, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TILESMITH_ALLOW_CPU", "1")
        mp.setenv("TILESMITH_GATE_RUN_TIMEOUT_S", "60")
        holder = _Gates(graphs, tmp_path_factory.mktemp("cheat-gates"))
        yield holder
        holder.close()


@pytest.mark.parametrize("graph", ["ln", "train", "log"])
def test_unedited_wrapper_passes_every_check(graph, gates, graphs):
    verdict = gates.get(graph).evaluate(Candidate(source=graphs[graph].source, proposer="control"))
    assert verdict.failures == (), verdict.reasons
    assert verdict.timing is not None
    assert verdict.status in {"accepted", "rejected_marginal", "rejected_slower", "rejected_unconfirmed"}


@pytest.mark.parametrize("cheat", CHEATS, ids=lambda c: c.name)
def test_cheat_is_rejected_for_its_reason(cheat, gates, graphs, monkeypatch):
    if cheat.status != "rejected_static":  # obfuscated on purpose: the runtime check must catch it by itself
        gs.runtime_checks_only(monkeypatch)
    source = cheat.make(graphs[cheat.graph].source)
    assert source != graphs[cheat.graph].source
    verdict = gates.get(cheat.graph).evaluate(Candidate(source=source, proposer=f"cheat:{cheat.name}",
                                                        note=cheat.what))
    checks = [f.check for f in verdict.failures]
    assert not verdict.accepted
    assert set(cheat.check.split("|")) & set(checks), (cheat.name, verdict.status, verdict.reasons)
    assert verdict.status == cheat.status, (cheat.name, verdict.reasons)
    assert verdict.reasons and all(r.startswith("c0ffee00 (") for r in verdict.reasons)


def test_cheat_suite_covers_twenty_distinct_cheats():
    assert len({c.name for c in CHEATS}) >= 20
    assert len({c.check for c in CHEATS}) >= 15


def test_reference_sabotage_finds_no_original_to_slow(gates, graphs, monkeypatch):
    """Issue 15 (reference sabotage): the cheat looks for the original's kernels in its own process and slows
    them. The original runs only in the trusted worker, so the cheat can only slow itself: never accepted, and
    the trusted worker still answers with the original's outputs (the next unedited candidate passes)."""
    gs.runtime_checks_only(monkeypatch)
    gate = gates.get("ln")
    verdict = gate.evaluate(Candidate(source=SABOTAGE(graphs["ln"].source), proposer="cheat:sabotage"))
    assert not verdict.accepted and verdict.status != "accepted"
    again = gate.evaluate(Candidate(source=graphs["ln"].source, proposer="control"))
    assert again.failures == (), again.reasons
