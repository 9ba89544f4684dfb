"""On CUDA every timed call is isolated: the device is synchronized after each call, in the gate's samples, the
search worker's profile and the configuration screen (docs/gate.md, "Timing method").

CI has no GPU, so the CUDA paths run here with their clock and synchronize functions replaced by recorders; the
tests check the order of what they would do on a GPU.
"""

from __future__ import annotations

import types

import torch

from tilesmith.agent.builtin import config_screen, search_worker
from tilesmith.gate.worker import timing as worker_timing


def test_a_gate_sample_synchronizes_the_device_after_every_call(monkeypatch):
    log: list[str] = []

    names = iter(["start", "end"])

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            self.name = next(names)

    fake = types.SimpleNamespace(
        perf_ns=lambda: 0,
        Event=Event,
        event_record=lambda e: log.append(f"event {e.name}"),
        event_sync=lambda e: None,
        elapsed=lambda a, b: 1.0,
        cuda_sync=lambda device=None: log.append("sync"),
    )
    monkeypatch.setattr(worker_timing, "T", fake)
    monkeypatch.setattr(worker_timing, "sync", lambda device: log.append("sync before"))

    def fn(args):
        log.append(f"call {args[0]}")
        return [args[0]]

    ms, _, outs, _ = worker_timing._timed(torch.device("cuda"), torch.zeros(4), fn, [[0], [1], [2]])

    assert log == ["sync before", "event start", "call 0", "sync", "call 1", "sync", "call 2", "sync", "event end"]
    assert ms == 1.0 and outs == [[0], [1], [2]]  # every output kept until the clock stopped


def test_the_screen_synchronizes_after_every_cuda_call(monkeypatch):
    log: list[str] = []
    monkeypatch.setattr(config_screen, "_sync", lambda kind: log.append(f"sync {kind}"))

    config_screen._batch(lambda: log.append("call"), 3, "cuda")
    assert log == ["sync cuda"] + ["call", "sync cuda"] * 3


def test_the_search_workers_profile_synchronizes_after_every_call(monkeypatch):
    log: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("sync"))

    search_worker._best_rate(lambda: log.append("call"))

    calls = [i for i, entry in enumerate(log) if entry == "call"]
    assert calls and all(log[i + 1] == "sync" for i in calls)

    log.clear()
    search_worker._best_rate(lambda: log.append("call"), sync=False)
    assert set(log) == {"call"}
