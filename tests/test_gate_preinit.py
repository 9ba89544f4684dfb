"""CUDA spares get their ``init`` ahead of need (``Gate._preinit``), and ``WorkerProcess.poll_ready`` never waits.

The policy is tested on stand-in workers (CI has no GPU); ``poll_ready`` on a real CPU worker process."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from tilesmith.gate.host.gate import Gate
from tilesmith.gate.host.memory import CONTEXT_BYTES, MemoryPlan
from tilesmith.gate.host.process import WorkerProcess

GIB = 1 << 30


class FakeSpare:
    def __init__(self, ready: bool) -> None:
        self.ready, self.init_rid, self.init_fields, self.sent = ready, None, {"role": "candidate"}, []

    def poll_ready(self) -> bool:
        return self.ready

    def send(self, op: str, **fields):
        self.sent.append(op)
        return 7


def _gate(device: str, free: int, input_bytes: int, spares: list[FakeSpare], problem: str | None = None):
    plan = MemoryPlan(device=device, free=free, total=80 * GIB, input_bytes=input_bytes, output_bytes=input_bytes,
                      call_peak_bytes=input_bytes)
    return SimpleNamespace(device=torch.device(device), memory_problem=problem, memory=plan,
                           spare_count=len(spares), _spares=spares, _send_init=Gate._send_init)


def test_cuda_spares_that_have_started_get_init_ahead_of_need():
    started, starting = FakeSpare(True), FakeSpare(False)
    gate = _gate("cuda", 60 * GIB, 32 << 20, [started, starting])
    Gate._preinit(gate)
    assert started.sent == ["init"] and started.init_rid == 7
    assert starting.sent == [] and starting.init_rid is None  # still importing torch: left alone, not waited for
    Gate._preinit(gate)
    assert started.sent == ["init"]  # sent once


def test_no_preinit_on_cpu_for_big_graphs_or_without_memory():
    for device, free, inputs, problem in [("cpu", 60 * GIB, 1 << 20, None),
                                          ("cuda", 8 * GIB, 1 * GIB, None),   # inputs of a GiB, 8 GiB free
                                          ("cuda", 60 * GIB, 1 << 20, "too big")]:
        spare = FakeSpare(True)
        Gate._preinit(_gate(device, free, inputs, [spare], problem))
        assert spare.sent == [], (device, free, inputs, problem)
    # The bound: the spares' contexts and two input copies each within a quarter of what one worker leaves free.
    per_spare = CONTEXT_BYTES + 2 * (64 << 20)
    for extra, sent in [(4 * per_spare, ["init"]), (4 * per_spare - (1 << 20), [])]:
        spare = FakeSpare(True)
        gate = _gate("cuda", 0, 64 << 20, [spare])
        gate.memory = MemoryPlan("cuda", free=gate.memory.minimum + extra, total=80 * GIB, input_bytes=64 << 20,
                                 output_bytes=64 << 20, call_peak_bytes=64 << 20)
        Gate._preinit(gate)
        assert spare.sent == sent, extra


def test_poll_ready_does_not_wait_and_reads_the_greeting(tmp_path):
    worker = WorkerProcess(tmp_path, label="poll", device_type="cpu")
    try:
        t0 = time.monotonic()
        first = worker.poll_ready()
        assert time.monotonic() - t0 < 0.5
        assert first is False  # an interpreter importing torch has not greeted yet
        deadline = time.monotonic() + 120
        while not worker.poll_ready():
            assert time.monotonic() < deadline, "the worker never greeted"
            time.sleep(0.05)
        assert worker.ready_info is not None and worker.ready_info.get("type") == "ready"
        answer = worker.request("init", 120, "init", role="candidate", device="cpu")  # the stream is still in step
        assert isinstance(answer, dict)
        worker.stop()
        assert worker.poll_ready() is True  # known already; a stopped worker is not read
    finally:
        worker.kill()


def test_before_anything_is_timed_a_preinited_cuda_spare_finishes_its_init():
    calls = []

    class Spare:
        init_rid, init_answer, role = 3, None, "candidate"

        def alive(self):
            return True

    done, pending = Spare(), Spare()
    done.init_answer = {"ok": True}
    gate = SimpleNamespace(device=torch.device("cuda"), _spares=[done, pending], _workers=[done, pending],
                           _ready=lambda w, what: calls.append(w))
    assert Gate._untrusted(gate) == [done, pending]
    assert calls == [pending]  # waited for the init in flight, not for the one answered
    calls.clear()
    gate.device = torch.device("cpu")  # CPU spares are stopped mid-start as before: nothing to wait for
    Gate._untrusted(gate)
    assert calls == []
