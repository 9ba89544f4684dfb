"""CUDA spares get their ``init`` as soon as they start where their device copies fit (``Gate._early_init_fits``),
and a spare that was never sent wrapper code is not stopped by a timing run (``WorkerProcess.loaded``).

The policy is tested on stand-in objects (CI has no GPU); ``loaded`` on a real CPU worker process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tilesmith.gate.host.gate import Gate
from tilesmith.gate.host.memory import CONTEXT_BYTES, MemoryPlan
from tilesmith.gate.host.process import WorkerProcess

GIB = 1 << 30


def _gate(device: str, free: int, input_bytes: int, spares: int = 2, problem: str | None = None, early: bool = True):
    plan = MemoryPlan(device=device, free=free, total=80 * GIB, input_bytes=input_bytes, output_bytes=input_bytes,
                      call_peak_bytes=input_bytes)
    return SimpleNamespace(device=torch.device(device), memory_problem=problem, memory=plan, spare_count=spares,
                           early_init=early)


def test_early_init_where_the_spares_device_copies_fit_easily():
    assert Gate._early_init_fits(_gate("cuda", 60 * GIB, 32 << 20))
    assert not Gate._early_init_fits(_gate("cuda", 8 * GIB, 1 * GIB))  # inputs of a GiB, 8 GiB free: when taken
    assert not Gate._early_init_fits(_gate("cuda", 60 * GIB, 1 << 20, problem="too big"))
    assert not Gate._early_init_fits(_gate("cuda", 60 * GIB, 1 << 20, early=False))
    assert not Gate._early_init_fits(SimpleNamespace(early_init=True, memory_problem=None))  # no plan yet
    # The bound: all spares' contexts and two input copies each within a quarter of what one worker leaves free.
    per_spare = CONTEXT_BYTES + 2 * (64 << 20)
    for spares in (2, 4):
        for extra, fits in [(4 * spares * per_spare, True), (4 * spares * per_spare - (1 << 20), False)]:
            gate = _gate("cuda", 0, 64 << 20, spares=spares)
            gate.memory = MemoryPlan("cuda", free=gate.memory.minimum + extra, total=80 * GIB, input_bytes=64 << 20,
                                     output_bytes=64 << 20, call_peak_bytes=64 << 20)
            assert Gate._early_init_fits(gate) is fits, (spares, extra)


@pytest.mark.parametrize("early", [True, False])
def test_a_cuda_spare_is_sent_init_when_armed_only_where_early_init_fits(early):
    class Spare:
        role, init_rid, templated, sent = "candidate", None, True, None

        def send(self, op, **fields):
            self.sent = op
            return 5

    gate = _gate("cuda", 60 * GIB, 1 << 20, early=early)
    gate.__dict__.update(_template=None, flags={}, watch=[], constants_path=None, original_path="orig.py",
                         problem=SimpleNamespace(graph=SimpleNamespace(inputs_to_check=[], mutated_input_idxs=[]),
                                                 inputs_path="inputs.pt"),
                         original_effects=(), original_imports={}, expected=[], fsize_limit=0,
                         _send_init=Gate._send_init, _early_init_fits=lambda: Gate._early_init_fits(gate))
    spare = Gate._arm(gate, Spare())
    assert (spare.sent, spare.init_rid) == (("init", 5) if early else (None, None))


def test_a_worker_sent_wrapper_code_is_marked_loaded(tmp_path):
    worker = WorkerProcess(tmp_path, label="loaded", device_type="cpu")
    try:
        assert worker.loaded is False
        worker.send("init", role="candidate", device="cpu")
        assert worker.loaded is False  # Tilesmith's own code only
        worker.send("load", name="cand", source="def call(args):\n    return ()\n")
        assert worker.loaded is True
    finally:
        worker.kill()
