"""The gate's acceptance path in CPU test mode: a truly faster honest candidate is accepted after a fresh
confirmation; incumbents, cache re-checks, the worker-side reference and the reports behave as documented."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests import gate_support as gs
from tests.cheats.common import replace_body
from tilesmith.records import Candidate

SECRET = "sk-gate-test-0123456789abcdef0123456789"


@pytest.fixture(scope="module")
def chain() -> gs.Captured:
    torch.manual_seed(2)
    return gs.capture(gs.Chain(), torch.randn(512, 768))[0]


@pytest.fixture(scope="module")
def env():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TILESMITH_ALLOW_CPU", "1")
        mp.setenv("OPENAI_API_KEY", SECRET)
        mp.setenv("TILESMITH_API_KEY", SECRET + "-x")
        mp.setenv("MY_SERVICE_TOKEN", "tok-" + SECRET)
        yield mp


@pytest.fixture(scope="module")
def gate(chain, env, tmp_path_factory):
    yield from gs.chain_gate(chain, tmp_path_factory.mktemp("accept-gate"), "acce9700 (0_inference)")


@pytest.fixture(scope="module")
def accepted(gate, chain):
    return gate.evaluate(Candidate(source=gs.reassociate_chain(chain.source), proposer="scripted", note="reassociate"))


def test_the_gates_other_workers_start_alongside_the_trusted_worker_and_get_the_originals_kernels(gate):
    """Issue 19: the second trusted worker and the spare candidate workers are started before the trusted worker's
    init is answered (their interpreter starts overlap it), yet each is seeded with the cache template (the
    original's compiled kernels) before its own init."""
    trusted, second = gate._trusted, gate._second
    assert second is not None and second.alive()
    assert second.started < trusted.init_done_at, (second.started, trusted.init_done_at)
    assert second.templated and second.init_rid is not None
    assert all(w.templated for w in gate._workers if w is not trusted)
    assert trusted.ready_info["prewarm"]["device_type"] == "cpu"


def test_faster_honest_candidate_is_accepted_after_confirmation(accepted):
    assert accepted.status == "accepted", accepted.reasons
    assert accepted.accepted and accepted.failures == ()
    assert accepted.timing is not None and accepted.confirmation is not None
    for t in (accepted.timing, accepted.confirmation):
        assert t.method == "process_cpu_time" and t.baseline_label == "inductor"
        assert len(t.baseline_ms) == len(t.candidate_ms) == 10
        assert t.speedup >= 1.3 and t.ci_low > 1.0


@pytest.fixture()
def controlled(gate):
    gate.control = True  # the in-process control arm (docs/gate.md; on by default for CUDA, off in CPU test mode)
    yield gate
    gate.control = False


def test_with_the_control_arm_the_rule_decides_on_the_baselines_code_in_the_candidates_process(controlled, chain):
    verdict = controlled.evaluate(Candidate(source=gs.reassociate_chain(chain.source), proposer="scripted"))
    assert verdict.status == "accepted", verdict.reasons
    for t in (verdict.timing, verdict.confirmation):
        assert t.control_ms is not None and len(t.control_ms) == len(t.candidate_ms)
        assert t.speedup_vs_control >= 1.3 and t.speedup_vs_control_ci[0] > 1.0
    report = json.loads(open(verdict.report_path).read())
    for phase in report["phases"]:
        assert phase["control_load_s"] >= 0 and phase["timing"]["speedup_vs_control"] >= 1.3
    assert "in-process control" in open(verdict.report_path[:-5] + ".txt").read()


def test_the_control_is_the_incumbents_code_when_there_is_one(controlled, chain):
    incumbent = Candidate(source=gs.reassociate_chain(chain.source), proposer="scripted")
    same_again = gs.reassociate_chain(chain.source) + "\n# same code as the incumbent\n"
    verdict = controlled.evaluate(Candidate(source=same_again, proposer="scripted"), incumbent=incumbent)
    assert verdict.failures == () and not verdict.accepted, verdict.reasons  # A/A against the incumbent
    t = verdict.timing
    assert t.control_ms is not None and abs(t.speedup_vs_control - 1.0) < 0.15  # ctl: the incumbent, not the original
    assert t.speedup_vs_original > 1.3


def test_without_the_control_arm_no_control_samples_are_taken(accepted):
    """CPU test mode's default: no control arm (its per-process allowance covers process factors)."""
    assert accepted.timing.control_ms is None and accepted.confirmation.speedup_vs_control is None


def test_confirmation_runs_in_a_different_fresh_worker(accepted):
    report = json.loads(open(accepted.report_path).read())
    first, second = report["phases"]
    assert (first["name"], second["name"]) == ("measurement", "confirmation")
    assert first["worker_pid"] != second["worker_pid"]
    assert first["seeds"] != second["seeds"]


def test_report_holds_every_sample_and_the_environment(accepted):
    report = json.loads(open(accepted.report_path).read())
    assert report["evaluation_id"] == accepted.evaluation_id
    assert report["verdict"]["status"] == "accepted"
    samples = report["phases"][1]["timing"]
    assert samples["candidate_ms"] == list(accepted.confirmation.candidate_ms)
    assert report["environment"]["torch"] == torch.__version__
    assert "float32" in report["tolerances"]
    text = open(accepted.report_path[:-5] + ".txt").read()
    assert "ACCEPTED" in text and "confirmation" in text


def test_incumbent_is_the_baseline_and_original_is_timed_as_third_arm(gate, chain, accepted):
    incumbent = Candidate(source=gs.reassociate_chain(chain.source), proposer="scripted")
    same_again = gs.reassociate_chain(chain.source) + "\n# same again\n"
    verdict = gate.evaluate(Candidate(source=same_again, proposer="scripted"), incumbent=incumbent)
    assert verdict.failures == (), verdict.reasons
    t = verdict.timing
    assert t.baseline_label == "incumbent"
    assert t.original_ms is not None and len(t.original_ms) == len(t.candidate_ms)
    assert t.speedup_vs_original is not None and t.speedup_vs_original > 1.3


def test_recheck_of_a_cached_candidate_checks_and_times_once(gate, chain):
    verdict = gate.recheck(Candidate(source=gs.reassociate_chain(chain.source), proposer="cache"))
    assert verdict.status == "accepted", verdict.reasons
    assert verdict.timing is not None and verdict.confirmation is None
    report = json.loads(open(verdict.report_path).read())
    assert report["kind"] == "recheck" and len(report["phases"]) == 1


def test_recheck_rejects_a_cached_candidate_that_is_now_wrong(gate, chain):
    wrong = gs.reassociate_chain(chain.source).replace("out=buf_out)", "out=buf_out); buf_out.mul_(1.5)")
    assert wrong != gs.reassociate_chain(chain.source)
    verdict = gate.recheck(Candidate(source=wrong, proposer="cache"))
    assert verdict.status == "rejected_incorrect"
    assert "value_mismatch" in [f.check for f in verdict.failures]


def test_no_secret_reaches_the_worker_or_the_reports(gate, chain, accepted, monkeypatch):
    gs.runtime_checks_only(monkeypatch)  # the static scan refuses os.environ; the worker must hold no secret anyway
    leak = replace_body(chain.source, [
        '_env = getattr(os, "envi" + "ron")',
        # TILESMITH_KERNEL_DIR is the one Tilesmith variable a worker gets: the native-kernel folder it reads
        '_names = sorted(k for k in _env if any(p in k for p in ("KEY", "TOKEN", "SECRET", "TILESMITH"))'
        '                and k != "TILESMITH_KERNEL_DIR")',
        '_values = [k for k, v in _env.items() if "0123456789abcdef" in v]',
        'raise RuntimeError(f"LEAK names={_names} values={_values} home={\'HOME\' in _env}")'])
    verdict = gate.evaluate(Candidate(source=leak, proposer="leak"))
    assert verdict.status == "rejected_crash"
    text = " ".join(verdict.reasons)
    assert "LEAK names=[] values=[] home=True" in text, text  # the worker saw an environment, without secrets
    folder = os.path.dirname(accepted.report_path)
    for name in os.listdir(folder):
        assert SECRET not in open(os.path.join(folder, name), encoding="utf-8").read()


def test_evaluation_ids_increase_and_name_report_files(gate, chain):
    v1 = gate.evaluate(Candidate(source="def call(args):\n    import threading\n", proposer="x"))
    v2 = gate.evaluate(Candidate(source="def call(args):\n    import threading\n", proposer="x"))
    assert v1.status == v2.status == "rejected_static"
    assert int(v2.evaluation_id[1:]) == int(v1.evaluation_id[1:]) + 1
    assert os.path.basename(v2.report_path) == f"{v2.evaluation_id}.json"


def test_reference_from_a_trusted_worker_when_there_is_no_callable(env, tmp_path):
    from tilesmith.gate import Gate

    torch.manual_seed(3)
    cap = gs.capture(gs.LinearLN(), torch.randn(32, 64))[0]
    with Gate(gs.make_problem(cap, tmp_path / "snapshot"), reference=None, profiles_dir=tmp_path / "p",
              timing_pairs=4) as g:
        same = g.evaluate(Candidate(source=cap.source, proposer="control"))
        assert same.failures == (), same.reasons
        bad = g.evaluate(Candidate(source=cap.source.replace("return (buf4, )", "return (buf4 * 1.001, )"),
                                   proposer="wrong"))
        assert "value_mismatch" in [f.check for f in bad.failures], bad.reasons
        report = json.loads(open(bad.report_path).read())
        assert report["reference"]["source"] == "trusted worker"


def test_cpu_graph_needs_test_mode(chain, tmp_path, monkeypatch):
    from tilesmith.gate import Gate

    monkeypatch.setenv("TILESMITH_ALLOW_CPU", "0")
    with pytest.raises(ValueError, match="TILESMITH_ALLOW_CPU"):
        Gate(gs.make_problem(chain, tmp_path / "s"), reference=chain.ref_fn)


def test_inputs_that_do_not_match_the_graph_are_named(chain, tmp_path, monkeypatch):
    from tilesmith.gate import Gate

    monkeypatch.setenv("TILESMITH_ALLOW_CPU", "1")
    problem = gs.make_problem(chain, tmp_path / "s")
    values = torch.load(problem.inputs_path, weights_only=True)
    values[1] = values[1].t().contiguous()
    torch.save(values, problem.inputs_path)
    with pytest.raises(ValueError, match="input 1"):
        Gate(problem, reference=chain.ref_fn)
