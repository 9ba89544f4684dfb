"""Tilesmith under torch.distributed (tilesmith/coord, docs/distributed.md).

Fast tests drive the store protocol with an in-memory ``HashStore``; the slow ones run real jobs of 3 gloo ranks
in CPU test mode: ``torchrun --nproc-per-node 3`` for DDP training (one optimizer session per graph key in the
job, the same installed source on every rank, the same parameters as eager DDP), and a launcher of the test's
own for killing the leader mid-optimization (torchrun's agent stops every worker as soon as one dies, so the
survivors' behaviour cannot be observed under it; like torchrun's agent, the test process hosts the store).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.fixture_paths import H200
from tilesmith.coord import devices
from tilesmith.coord.board import Board, Final, closing, decode, encode
from tilesmith.coord.rank import Coordinator, _Entry

REPO = Path(__file__).resolve().parents[1]
VERSIONS = {"torch": "2.11.0", "triton": "3.6.0", "cuda": "13.0", "gpu": "NVIDIA H200"}


# -- device-neutral wrapper text ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["gpt2_block_bf16_infer__03.wrapper.py", "conv_bf16_cl_infer__05.wrapper.py"])
def test_a_real_cuda_wrapper_is_retargeted_to_another_device_and_back(name):
    source = (H200 / name).read_text()
    assert "cuda:0" in source and "_DeviceGuard(0)" in source
    neutral = devices.neutral(source, 0)
    for form in ("cuda:0", "_DeviceGuard(0)", "set_device(0)", "get_raw_stream(0)", "index=0,"):
        assert form not in neutral, form
    on3 = devices.retarget(neutral, 3)
    assert "cuda:3" in on3 and "_DeviceGuard(3)" in on3 and "get_raw_stream(3)" in on3
    assert "index=3," in on3 and "cuda:0" not in on3
    assert devices.neutral(on3, 3) == neutral  # the hash ranks compare is the same on cuda:0 and cuda:3
    assert devices.source_sha256(devices.neutral(on3, 3)) == devices.source_sha256(neutral)
    assert devices.retarget(neutral, 0) == source


def test_cpu_sources_are_left_alone_and_a_cuda_text_refuses_a_cpu_rank():
    assert devices.neutral("x = 1  # cuda:0\n", None) == "x = 1  # cuda:0\n"
    assert devices.device_index("cpu") is None and devices.device_index("cuda:5") == 5
    assert devices.device_index("cuda") == 0
    with pytest.raises(ValueError, match="CPU"):
        devices.retarget(devices.neutral("torch.cuda.set_device(0)", 0), None)


# -- the board ----------------------------------------------------------------------------------------------

def test_values_round_trip_and_long_texts_are_compressed():
    small, big = {"a": 1}, {"source": "x = 1\n" * 5000}
    assert decode(encode(small)) == small
    raw = encode(big)
    assert raw.startswith(b"z:") and len(raw) < 2000 and decode(raw) == big


def test_the_first_final_wins_for_every_rank():
    store = dist.HashStore()
    boards = [Board(store, r, 3) for r in range(3)]
    assert boards[0].final("g/k/0") is None
    won = boards[1].propose_final("g/k/0", Final(False, "dist_timeout", "slow", 1))
    late = boards[2].propose_final("g/k/0", Final(True, "dist_installed", "all", 2, "ab"))
    assert won == late == boards[0].final("g/k/0") == Final(False, "dist_timeout", "slow", 1)


def test_a_vote_closes_on_a_veto_at_once_and_on_every_usable_answer():
    group = (0, 1, 2)
    assert closing(2, None, group, 1, "ab") is None
    done = closing(3, None, group, 1, "ab")
    assert done.install and done.sha256 == "ab" and done.kind == "dist_installed"
    vetoed = closing(1, {"rank": 2, "reason": "re-check failed"}, group, 1, "ab")
    assert not vetoed.install and vetoed.kind == "dist_recheck_failed" and "rank 2" in vetoed.reason


# -- one rank's coordinator against an in-memory store -------------------------------------------------------

class FakeRun:
    """The parts of LiveRun the coordinator uses."""

    def __init__(self):
        self.diagnostics, self.threads, self.benchmarks = [], [], []
        self.lock = threading.Lock()
        self.options = SimpleNamespace(loops=1, min_improvement=0.02)

    def diagnose(self, kind, message, graph_key=None, graph_name=None):
        d = SimpleNamespace(kind=kind, message=message, graph_key=graph_key, graph_name=graph_name)
        self.diagnostics.append(d)
        return d

    def start_background(self, thread):
        self.threads.append(thread)
        thread.start()

    def _key(self, canonical, device):
        return devices.source_sha256(canonical + device)

    @staticmethod
    def _device_of(compiled):
        return "cpu"


def _handle(name="0_inference"):
    graph = SimpleNamespace(device="cpu", canonical_source="def call(args):\n    return ()\n", name=name,
                            kind="inference", inputs_to_check=(), mutated_input_idxs=())
    return SimpleNamespace(graph=graph, key="c" * 64, label=f"cccccccc ({name})", state="optimizing",
                           constants={}, compiled=SimpleNamespace(), installed_source=None, record=None)


def _coordinator(store, rank, monkeypatch, *, liveness="0.6", timeout="30"):
    monkeypatch.setenv("TILESMITH_DIST_LIVENESS_S", liveness)
    monkeypatch.setenv("TILESMITH_DIST_TIMEOUT_S", timeout)
    coordinator = Coordinator(Board(store, rank, 3), VERSIONS)
    for r in range(3):
        Board(store, r, 3).publish_fingerprint({**VERSIONS, "rank": r})
    coordinator._refresh_fingerprints()
    return coordinator


def test_a_follower_returns_at_once_and_keeps_inductor_when_the_leader_goes_silent(monkeypatch):
    store = dist.HashStore()
    Board(store, 0, 3).beat()  # the leader beat once, then died
    follower = _coordinator(store, 1, monkeypatch)
    run, handle = FakeRun(), _handle()
    started = time.monotonic()
    assert follower.take(run, handle, [torch.randn(4)]) is True  # this rank follows: the call stays on Inductor
    assert time.monotonic() - started < 5 and handle.state == "following"
    run.threads[0].join(30)
    kinds = [d.kind for d in run.diagnostics]
    assert kinds == ["dist_following", "dist_leader_lost"], run.diagnostics
    assert "rank 0" in run.diagnostics[-1].message and "TILESMITH_DIST_LIVENESS_S" in run.diagnostics[-1].message
    assert handle.state == "kept_inductor" and run.benchmarks == []
    final = Board(store, 2, 3).final(f"g/{run._key(handle.graph.canonical_source, 'cpu')}/0")
    assert final is not None and not final.install  # every other rank reads the same decision


def test_the_leader_of_a_graph_is_the_lowest_rank_with_the_same_environment(monkeypatch):
    store = dist.HashStore()
    leader = _coordinator(store, 0, monkeypatch)
    run, handle = FakeRun(), _handle()
    assert leader.take(run, handle, [torch.randn(4)]) is False  # rank 0 optimizes inline
    assert handle.hold_install is not None and run.threads == []
    other = Coordinator(Board(store, 2, 3), {**VERSIONS, "gpu": "NVIDIA A100"})
    other._refresh_fingerprints()
    assert other._role(cuda=True) == 2 and other._role(cuda=False) == 0  # CPU graphs ignore the GPU model


def test_a_twin_graph_waits_for_its_first_graphs_job_decision(monkeypatch):
    coordinator = _coordinator(dist.HashStore(), 1, monkeypatch)
    run, first, twin = FakeRun(), _handle(), _handle("1_inference")
    first.state = "following"
    coordinator.twin(run, first, twin)
    time.sleep(0.5)
    assert twin.state == "following" and run.diagnostics == []  # nothing decided locally before the job decides
    first.state = "kept_inductor"  # the job kept Inductor for the first graph
    run.threads[0].join(10)
    assert twin.state == "kept_inductor" and [d.kind for d in run.diagnostics] == ["duplicate_graph"]


def test_a_veto_of_one_rank_keeps_inductor_on_all_of_them(monkeypatch):
    store = dist.HashStore()
    ranks = [_coordinator(store, r, monkeypatch) for r in range(3)]
    scope = "g/" + "d" * 64 + "/0"
    for c in ranks:
        c.board.beat()
    ranks[0].board.publish_decision(scope, {"leader": 0, "accepted": True, "sha256": "ab", "source": "x"})
    ranks[0].board.vote(scope, True, {"sha256": "ab"})
    ranks[1].board.vote(scope, True, {"sha256": "ab"})
    ranks[2].board.vote(scope, False, {"sha256": "ab", "reason": "its re-check on rank 2 failed: crash"})
    finals = [c._await_final(_Entry(FakeRun(), _handle(), "d" * 64, scope, None, leader=0), "ab", (0, 1, 2))
              for c in ranks]
    assert len(set(finals)) == 1 and not finals[0].install and finals[0].kind == "dist_recheck_failed"
    assert "rank 2" in finals[0].reason and "crash" in finals[0].reason


def test_every_usable_answer_installs_the_one_hash(monkeypatch):
    store = dist.HashStore()
    ranks = [_coordinator(store, r, monkeypatch) for r in range(3)]
    scope = "g/" + "e" * 64 + "/0"
    for c in ranks:
        c.board.vote(scope, True, {"sha256": "ab"})
    final = ranks[1]._await_final(_Entry(FakeRun(), _handle(), "e" * 64, scope, None, leader=0), "ab", (0, 1, 2))
    assert final.install and final.sha256 == "ab" and ranks[2].board.final(scope) == final


# -- real jobs (gloo, CPU test mode) ------------------------------------------------------------------------

def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TILESMITH_ALLOW_CPU": "1",
           "TILESMITH_CACHE_DIR": str(tmp_path / "ts"),
           "TILESMITH_PROGRESS": "off", "TILESMITH_PRESTART_WORKER": "0", "TILESMITH_GATE_PAIRS": "10",
           "OMP_NUM_THREADS": "1"}
    for name in ("TILESMITH_DISTRIBUTED", "TILESMITH_DIST_LEADER", "TILESMITH_DIST_TIMEOUT_S"):
        env.pop(name, None)
    env.update(extra)
    return env


def _reports(out: Path, ranks) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in ranks]


@pytest.mark.slow
def test_torchrun_three_ranks_optimize_each_graph_once_and_install_the_same_source(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           str(REPO / "tests" / "dist_job.py"), "train", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stderr[-6000:]
    reports = _reports(out, range(3))

    # one optimizer session per graph key in the whole job, all on the leader (rank 0)
    keys = {name: key for r in reports for name, key in r["keys"].items()}
    assert all(r["keys"] == reports[0]["keys"] for r in reports) and set(keys) == {"0_forward", "0_backward"}
    sessions = sorted(p.name.split(".")[0] for p in (out / "sessions").iterdir())
    assert sessions == sorted(keys.values()), sessions
    assert [r["sessions_here"] for r in reports] == [2, 0, 0]

    # the same decision everywhere: forward installed (the same source hash on every rank), backward on Inductor
    for r in reports:
        assert r["finished"] and r["states"] == {"0_forward": "installed", "0_backward": "kept_inductor"}, r
        assert r["gathered_installed"] == [reports[0]["installed"]] * 3
        (bench,) = r["benchmarks"]
        assert bench["graph"] == "0_forward" and bench["measured_by_rank"] == 0
        assert dict(map(tuple, bench["extras"]))["dist_source_sha256"] == r["installed"]["0_forward"]
        kinds = [k for k, _ in r["diagnostics"]]
        assert "dist_installed" in kinds and "dist_kept_inductor" in kinds
        if r["rank"]:
            assert kinds.count("dist_following") == 2
            assert dict(map(tuple, bench["extras"]))["recheck_status"] in ("accepted", "rejected_slower",
                                                                           "rejected_marginal")
    assert len({r["installed"]["0_forward"] for r in reports}) == 1

    # DDP training with the installed wrapper matches eager DDP
    for r in reports:
        assert r["moved"] > 1e-4  # the steps changed the parameters, so the comparison means something
        assert r["max_param_diff"] < 1e-5, r["max_param_diff"]
        assert r["losses"] == pytest.approx(r["eager_losses"], rel=1e-4, abs=1e-6)


@pytest.mark.slow
def test_killing_the_leader_mid_optimization_leaves_the_others_on_inductor_within_the_timeout(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    store = dist.TCPStore("127.0.0.1", 0, 4, True, wait_for_workers=False)  # hosted here, like torchrun's agent
    liveness = 4.0
    procs = []
    for rank in range(3):
        # the leader optimizes in the background here (the torchrun test covers the inline default); either way
        # its heartbeat thread is what stops when it dies
        env = _env(tmp_path, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="3", TS_STORE_PORT=str(store.port),
                   TILESMITH_DIST_LIVENESS_S=str(liveness), TILESMITH_DIST_LEADER="background")
        procs.append(subprocess.Popen([sys.executable, str(REPO / "tests" / "dist_job.py"), "kill", str(out)],
                                      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))
    try:
        deadline = time.monotonic() + 400
        while not (out / "optimizing").exists():
            assert time.monotonic() < deadline, "the leader never started optimizing"
            assert all(p.poll() is None for p in procs), [p.communicate()[1][-3000:] for p in procs]
            time.sleep(0.2)
        os.killpg(procs[0].pid, signal.SIGKILL)  # the leader and its gate workers
        killed = time.time()
        for p in procs[1:]:
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-6000:]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    survivors = _reports(out, (1, 2))
    assert [p.name.split(".")[1] for p in (out / "sessions").iterdir()] == [str(procs[0].pid)]  # leader only
    for r in survivors:
        assert r["after_first"] == ["following"]  # the first call returned on Inductor before any decision
        assert r["finished"] and r["states"] == {"0_inference": "kept_inductor"} and r["benchmarks"] == []
        assert r["max_err"] < 1e-4
        lost = [m for k, m in r["diagnostics"] if k == "dist_leader_lost"]
        assert lost and "rank 0" in lost[0], r["diagnostics"]
        # the liveness limit, one heartbeat scan and a poll interval, with slack for a loaded 2-core machine
        assert r["decided"] - killed < liveness + 15, r["decided"] - killed
