"""GraphSession: stop rule, duplicates, host rejections, incumbents — with a stub gate (no workers)."""

from __future__ import annotations

import json

import pytest

from tilesmith.agent.protocol import Session, StopOptimization
from tilesmith.records import CapturedGraph, Timing, Verdict
from tilesmith.session import GraphSession
from tilesmith.track.run import RunFolder, Track

WRAPPER = "def call(args):\n    return (args[0] * 2,)\n"


class StubGate:
    """Accepts sources containing ACCEPT; everything else is rejected as slower."""

    def __init__(self):
        self.seen = []

    def evaluate(self, candidate, incumbent=None):
        self.seen.append((candidate, incumbent))
        eid = f"e{len(self.seen):04d}"
        if "ACCEPT" in candidate.source:
            t = Timing("host_clock", 1, (2.0,), (1.0,), 2.0, 1.8, 2.2)
            return Verdict(True, "accepted", (), timing=t, confirmation=t, evaluation_id=eid)
        return Verdict(False, "rejected_slower", ("not faster",), evaluation_id=eid)


def make_session(tmp_path, *, loops=1, max_turns=5, time_limit_s=100.0):
    graph = CapturedGraph(name="0_inference", kind="inference", source=WRAPPER, canonical_source=WRAPPER,
                          fx_program="graph():\n    return x", inputs=(), output_strides=(), mutated_input_idxs=(),
                          inputs_to_check=(), device="cpu", inductor_key=None)
    run = RunFolder(tmp_path, "run-1", {})
    track = Track(run, graph, "ab" * 32, loops)
    track.create()
    gate = StubGate()
    notes = []
    session = GraphSession(track, gate, agency="medium", loops=loops, on_diagnostic=notes.append,
                           max_turns=max_turns, time_limit_s=time_limit_s)
    return session, gate, track, notes


def test_session_satisfies_the_protocol(tmp_path):
    session, *_ = make_session(tmp_path)
    assert isinstance(session, Session)


def test_duplicate_and_original_sources_are_rejected_without_the_gate(tmp_path):
    session, gate, track, _ = make_session(tmp_path)
    session.new_turn()
    assert session.evaluate(proposer="t").status == "rejected_duplicate"  # unchanged copy of the original
    session.new_turn()
    session.current_attempt().write_text(session.current_attempt().read_text() + "# change\n")
    assert session.evaluate(proposer="t").status == "rejected_slower"
    session.new_turn()
    assert session.evaluate(proposer="t").status == "rejected_duplicate"  # same text as the last evaluation
    assert len(gate.seen) == 1
    assert [e["status"] for e in json.loads((track.folder / "track.json").read_text())["evaluations"]] == [
        "rejected_duplicate", "rejected_slower", "rejected_duplicate"]


def test_accepted_candidate_becomes_incumbent_and_next_loop_is_timed_against_it(tmp_path):
    session, gate, _, _ = make_session(tmp_path, loops=2)
    session.new_turn()
    v = session.evaluate(WRAPPER + "# ACCEPT 1\n", proposer="t")
    assert v.accepted and session.accepted_loops == 1 and session.stop_reason() is None
    assert "# ACCEPT 1" in session.incumbent_source()
    path = session.new_turn()
    assert "# ACCEPT 1" in path.read_text()  # the new turn starts from the most recently evaluated source
    session.evaluate(WRAPPER + "# ACCEPT 2\n", proposer="t")
    assert gate.seen[-1][1].source.endswith("# ACCEPT 1\n")  # incumbent passed to the gate
    assert session.stop_reason().startswith("loops_done")
    with pytest.raises(StopOptimization):
        session.new_turn()


def test_turn_limit_and_time_limit_stop_the_loop(tmp_path):
    session, *_ = make_session(tmp_path, max_turns=2)
    session.new_turn()
    session.new_turn()
    assert session.stop_reason().startswith("turn_limit")
    with pytest.raises(StopOptimization):
        session.new_turn()
    timed, *_ = make_session(tmp_path / "t", time_limit_s=1e-9)
    assert timed.stop_reason().startswith("time_limit") and timed.time_left_s() == 0.0


def test_host_rejection_is_recorded_with_a_report(tmp_path):
    session, gate, track, _ = make_session(tmp_path)
    session.new_turn()
    v = session.reject(WRAPPER + "# x\n", proposer="llm:m", reasons=("kernel launch order changed",))
    assert v.status == "rejected_policy" and not gate.seen
    report = json.loads((track.profiles / f"{v.evaluation_id}.json").read_text())
    assert report["verdict"]["reasons"] == ["kernel launch order changed"]
    state = json.loads((track.folder / "track.json").read_text())
    assert state["evaluations"][-1]["status"] == "rejected_policy"
    assert "# x" in session.new_turn().read_text()


def test_note_names_the_graph_and_reaches_the_run(tmp_path):
    session, _, track, notes = make_session(tmp_path)
    d = session.note("budget_exhausted", "70 of 70 model calls used")
    assert notes == [d] and d.graph_key == track.key and track.key[:8] in d.message
