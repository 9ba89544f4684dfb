"""The gate's memory plan (tilesmith.gate.host.memory): sized from the graph's bytes and the free memory; a graph
that does not fit gets gate_memory naming the bytes; an out-of-memory that the gate's own buffers may have
caused is gate_memory, a candidate asking for more than the device had is its own crash."""

from __future__ import annotations

from tilesmith.gate.host.checks import HELD_BYTES_BUDGET, MIN_HELD_CALLS, held_calls
from tilesmith.gate.host.memory import MemoryPlan, oom_check, plan_from, requested_bytes
from tilesmith.gate.host.phase import status_for
from tilesmith.records import CheckFailure

GIB = 1 << 30


def test_a_small_graph_fits_and_gets_the_full_held_calls():
    plan = MemoryPlan("cuda:0", free=100 * GIB, total=141 * GIB, input_bytes=4 << 20, output_bytes=4 << 20,
                      call_peak_bytes=16 << 20)
    assert plan.fits and plan.held_budget == HELD_BYTES_BUDGET
    assert held_calls(plan.output_bytes, plan.held_budget) == 16


def test_a_big_graph_gets_fewer_held_calls_and_a_too_big_one_does_not_fit_with_a_message():
    big = MemoryPlan("cuda:0", free=60 * GIB, total=141 * GIB, input_bytes=GIB, output_bytes=GIB, call_peak_bytes=2 * GIB)
    assert big.fits and held_calls(big.output_bytes, big.held_budget) == MIN_HELD_CALLS
    tight = MemoryPlan("cuda:0", free=8 * GIB, total=141 * GIB, input_bytes=GIB, output_bytes=GIB,
                       call_peak_bytes=2 * GIB)
    assert not tight.fits and tight.minimum > tight.free
    text = tight.message("1a2b3c4d (0_inference)")
    assert text.startswith("1a2b3c4d (0_inference):") and "GiB" in text and "8.00 GiB of 141.00 GiB are free" in text


def test_plan_from_the_trusted_workers_answer():
    plan = plan_from("cpu", {"memory": {"free": 5 * GIB, "total": 8 * GIB}, "input_bytes": 10, "output_bytes": 20,
                             "call_peak_bytes": 0})
    assert (plan.free, plan.total, plan.input_bytes, plan.output_bytes) == (5 * GIB, 8 * GIB, 10, 20)


def test_out_of_memory_is_gate_memory_unless_the_candidate_asked_for_more_than_there_was():
    plan = MemoryPlan("cuda:0", free=20 * GIB, total=141 * GIB, input_bytes=GIB, output_bytes=GIB, call_peak_bytes=0)
    assert requested_bytes("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has") == int(2.5 * GIB)
    assert requested_bytes("DefaultCPUAllocator: not enough memory: you tried to allocate 1125899906842624 bytes") \
        == 2 ** 50
    assert oom_check("Tried to allocate 2.50 GiB", plan) == "gate_memory"
    assert oom_check("you tried to allocate 1125899906842624 bytes", plan) == "oom"
    assert oom_check("std::bad_alloc", plan) == "gate_memory"  # unknown size: the benefit of the doubt
    assert status_for([CheckFailure("gate_memory", "m")]) == "gate_memory"
    assert status_for([CheckFailure("oom", "m")]) == "rejected_crash"
