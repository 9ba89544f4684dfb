"""Worker-process plumbing: scrubbed environment, redaction, exit descriptions, protocol framing, the
size check before loading worker files, and the worker-side guards (in-process unit tests)."""

from __future__ import annotations

import pytest
import torch

from tilesmith.errors import WorkerError
from tilesmith.gate import protocol, torchstate
from tilesmith.gate.host.process import describe_exit, worker_environment
from tilesmith.secrets import redact
from tilesmith.gate.host.reference import OutputTooLarge, load_outputs
from tilesmith.gate.layout import output_facts
from tilesmith.gate.worker.runtime import GuardedAllocator, InputSet


def test_worker_environment_has_no_secrets():
    env = {"PATH": "/usr/bin", "HOME": "/home/u", "OPENAI_API_KEY": "sk-aaaaaaaaaaaaaaaaaaaa",
           "ANTHROPIC_API_KEY": "x" * 30, "TILESMITH_API_KEY": "t" * 20, "TILESMITH_MODEL": "gpt",
           "GITHUB_TOKEN": "ghp_x", "DB_PASSWORD": "pw", "AWS_SECRET_ACCESS_KEY": "s",
           "COPY_OF_KEY_VALUE": "prefix-sk-aaaaaaaaaaaaaaaaaaaa", "TORCHINDUCTOR_CACHE_DIR": "/tmp/ic",
           "CUDA_VISIBLE_DEVICES": "0", "PYTHONPATH": "/opt/lib"}
    clean = worker_environment(env)
    assert set(clean) >= {"PATH", "HOME", "TORCHINDUCTOR_CACHE_DIR", "CUDA_VISIBLE_DEVICES", "PYTHONPATH"}
    for gone in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "TILESMITH_API_KEY", "TILESMITH_MODEL", "GITHUB_TOKEN",
                 "DB_PASSWORD", "AWS_SECRET_ACCESS_KEY", "COPY_OF_KEY_VALUE"):
        assert gone not in clean
    assert not any("sk-aaaa" in v for v in clean.values())
    assert clean["PYTHONPATH"].endswith("/opt/lib") and clean["TORCHINDUCTOR_COMPILE_THREADS"] == "1"


def test_redaction_replaces_key_values(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "my-very-secret-value-123")
    assert redact("error: my-very-secret-value-123 rejected") == "error: <redacted> rejected"
    assert "<redacted>" in redact("token sk-abcdefghijklmnopqrstuvwx here")


def test_exit_descriptions_name_signals():
    assert describe_exit(-11) == "killed by signal SIGSEGV (11)"
    assert describe_exit(3) == "exited with status 3"


def test_protocol_round_trip_and_non_finite_floats():
    line = protocol.dumps({"id": 1, "x": float("nan"), "y": [float("inf"), 1.5]})
    assert line.endswith(b"\n")
    assert protocol.loads(line) == {"id": 1, "x": "nan", "y": ["inf", 1.5]}
    with pytest.raises(ValueError):
        protocol.loads(b"[1, 2]")


def test_oversized_worker_file_is_refused_before_loading(tmp_path):
    path = tmp_path / "out.pt"
    torch.save({"outputs": [torch.zeros(1 << 20)], "mutated_inputs": []}, path)
    with pytest.raises(OutputTooLarge):
        load_outputs(path, expected_bytes=1024, tensors=1)
    assert load_outputs(path, expected_bytes=4 << 20, tensors=1)["outputs"][0].numel() == 1 << 20


def test_worker_file_with_other_objects_is_refused(tmp_path):
    path = tmp_path / "out.pt"
    torch.save({"outputs": [{"not": "a tensor"}]}, path)
    with pytest.raises(WorkerError):
        load_outputs(path, expected_bytes=1 << 20)


def test_guarded_inputs_tell_mutations_from_out_of_bounds_writes():
    x = torch.randn(10, 20)[:, 3:11]
    iset = InputSet([x, 3], torch.device("cpu"), guarded=True)
    t = iset.values[0]
    assert torch.equal(t, x) and t.stride() == x.stride() and t.storage_offset() == x.storage_offset()
    iset.arm()
    assert iset.changes() == []
    t[0, 0] += 1
    assert iset.changes() == [{"index": 0, "in_view": True, "outside_view": False}]
    iset.arm()
    t.untyped_storage()[0] = 7  # a byte of the offset prefix, outside the view
    assert iset.changes() == [{"index": 0, "in_view": False, "outside_view": True}]


def test_guarded_allocations_poison_and_catch_writes_past_the_end():
    guard = GuardedAllocator(torch.device("cpu"))
    space = {"empty_strided_cpu": torch._C._dynamo.guards._empty_strided_cpu}
    saved = guard.install(space)
    guard.reset(0xFF)
    buf = space["empty_strided_cpu"]((4, 4), (4, 1), torch.float32)
    assert torch.isnan(buf).all()
    buf.fill_(1.0)
    assert guard.violations([buf]) == []
    buf.untyped_storage()[64] = 0  # the first guard byte after 16 floats
    [hit] = guard.violations([buf])
    assert hit["output_index"] == 0 and hit["shape"] == [4, 4]
    GuardedAllocator.uninstall(space, saved)
    assert space["empty_strided_cpu"] is torch._C._dynamo.guards._empty_strided_cpu


def test_output_facts_report_identity_views_and_foreign_types():
    a, b = torch.randn(4), torch.randn(4)
    out = (a, a[:2], torch.randn(3), None, 5, torch.randn(2).as_subclass(type("Sub", (torch.Tensor,), {})))
    facts = output_facts(out, [a, b])
    assert facts[0]["input_identity"] == 0 and facts[1]["input_identity"] is None and facts[1]["input_storage"] == 0
    assert facts[0]["shares_outputs"] == [1] and facts[2]["input_storage"] is None
    assert facts[3] == {"kind": "none"} and facts[4] == {"kind": "scalar", "value": 5}
    assert facts[5]["kind"] == "other"


def test_identity_snapshot_sees_replaced_functions_and_added_methods():
    import time

    before = torchstate.identity_snapshot()
    original = time.perf_counter_ns
    try:
        time.perf_counter_ns = lambda: 0  # type: ignore[assignment]
        torch.Tensor._tilesmith_test_method = lambda self: 0  # type: ignore[attr-defined]
        changed = torchstate.diff_identities(before, torchstate.identity_snapshot())
    finally:
        time.perf_counter_ns = original
        del torch.Tensor._tilesmith_test_method
    assert "time.perf_counter_ns" in changed
    assert "torch.Tensor._tilesmith_test_method (added)" in changed
    assert torchstate.diff_identities(before, torchstate.identity_snapshot()) == []


def test_state_snapshot_sees_precision_flags():
    before = torchstate.state_snapshot("cpu")
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        changed = torchstate.diff_state(before, torchstate.state_snapshot("cpu"))
    finally:
        torch.set_float32_matmul_precision(old)
    assert "cuda.matmul.fp32_precision" in changed or "mkldnn.matmul.fp32_precision" in changed


def test_quiescence_stop_resume_and_a_worker_that_dies_while_stopped(tmp_path):
    """SIGSTOP stops every thread of the worker (the host sees state T in /proc), a request resumes it first, and
    a worker killed while stopped (the OOM killer, say) is reported as a crash at the next request."""
    import os
    import signal

    from tilesmith.gate.host.process import WorkerCrashed, WorkerProcess, task_states

    worker = WorkerProcess(tmp_path, label="quiescence test", device_type="cpu")
    try:
        assert worker.wait_ready(180)["type"] == "ready"
        threads, others = worker.os_counts()
        assert threads >= 2 and others == 0  # main + the parent watch, no child processes
        assert worker.stop() and worker.stopped
        assert task_states(worker.pid) and all(s in "Tt" for s in task_states(worker.pid))
        answer = worker.request("nonsense", 60, "a request to a stopped worker")  # resumed before the request
        assert not worker.stopped and answer["ok"] is False and "unknown op" in answer["error"]["message"]
        assert worker.stop()
        os.kill(worker.pid, signal.SIGKILL)
        with pytest.raises(WorkerCrashed, match="killed by signal SIGKILL"):
            worker.request("exit", 30, "a request after the worker died while stopped")
        assert worker.stop() is False  # a dead worker is not "stopped"
    finally:
        worker.kill()
    assert not worker.dir.exists()


def test_a_spare_stopped_longer_than_its_start_timeout_still_starts(tmp_path, monkeypatch):
    """H200 calibration, session 7: a spare candidate worker is stopped while anything is timed; after ~180 s of
    back-to-back timing runs its start "did not finish within 180 s" although it had barely run. The start
    timeout counts only the time the worker could run, and waiting for the start resumes a stopped worker."""
    import time

    from tilesmith.gate.host.process import WorkerProcess

    worker = WorkerProcess(tmp_path, label="stopped spare", device_type="cpu")
    try:
        assert worker.stop()
        time.sleep(1.5)
        worker.resume()
        assert worker.stopped_s >= 1.5
        assert worker.stop()  # stopped again when the gate takes it
        time.sleep(0.5)
        deadlines: list[float] = []
        real = worker._read_message

        def spy(deadline: float, what: str, timeout_s: float) -> dict:
            deadlines.append(deadline)
            return real(deadline + 120, what, timeout_s)  # the real wait, with room for a loaded machine

        monkeypatch.setattr(worker, "_read_message", spy)
        assert worker.wait_ready(30)["type"] == "ready"  # never starts unless the wait resumes it
        assert not worker.stopped and worker.stopped_s >= 2.0
        assert abs(deadlines[0] - (worker.started + worker.stopped_s + 30)) < 1e-6
    finally:
        worker.kill()


def test_quiescence_lets_a_cuda_spare_import_torch_off_the_timing_cpu(monkeypatch):
    """A CUDA spare that was never sent wrapper code (its start and ``init`` are Tilesmith's code only) keeps going
    while arms are timed, on the CPUs the timed workers do not use; everything else untrusted is stopped."""
    import os

    from tilesmith.gate.host.timing import Quiescence

    class Fake:
        def __init__(self, label: str, device_type: str, loaded: bool) -> None:
            self.label, self.device_type, self.loaded = label, device_type, loaded
            self.stopped, self.pins = False, []

        def alive(self) -> bool:
            return True

        def stop(self) -> bool:
            self.stopped = True
            return True

        def resume(self) -> None:
            self.stopped = False

        def pin(self, cpus):
            self.pins.append(cpus)

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    active = Fake("timed", "cuda", True)
    spare = Fake("cuda spare (init sent or not)", "cuda", False)
    loaded = Fake("confirmation worker (candidate sent)", "cuda", True)
    cpu_spare = Fake("cpu spare", "cpu", False)
    quiet = Quiescence([active, spare, loaded, cpu_spare], timing_cpus={3})
    quiet.only(active)
    quiet.only(active)
    assert not active.stopped and loaded.stopped and cpu_spare.stopped
    assert not spare.stopped and spare.pins == [{0, 1, 2}]
    quiet.release()
    assert not loaded.stopped and spare.pins == [{0, 1, 2}, None]
    # One CPU only: nowhere else to run, so the spare is stopped like the rest.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3}, raising=False)
    spare2 = Fake("cuda spare", "cuda", False)
    quiet = Quiescence([active, spare2], timing_cpus={3})
    quiet.only(active)
    assert spare2.stopped and spare2.pins == []


_ORPHAN = """
import os, subprocess, sys, time
child = '''
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("worker_main", sys.argv[2])  # the file alone: no torch import
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
_watch_parent = module._watch_parent
host_fd = os.pidfd_open(os.getppid()) if sys.argv[1] == "pidfd" else None
_watch_parent(host_fd)
print("watching", flush=True)
time.sleep(60)
'''
proc = subprocess.Popen([sys.executable, "-c", child, *sys.argv[1:]], stdout=subprocess.PIPE, text=True)
assert proc.stdout.readline().strip() == "watching"
print(proc.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("how", ["ppid", "pidfd"])
def test_worker_leaves_when_its_host_is_killed(how):
    """A worker whose host died without closing the gate (SIGKILL: no cleanup ran) exits by itself within about a
    second: by polling its parent pid (a started worker) or on its host's pidfd (a worker forked by the zygote,
    whose parent is the zygote)."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    main = Path(__file__).resolve().parents[1] / "tilesmith" / "gate" / "worker" / "__main__.py"
    host = subprocess.Popen([sys.executable, "-c", _ORPHAN, how, str(main)], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(host.stdout.readline())
        assert Path(f"/proc/{worker}").exists()
        host.kill()
        host.wait(10)

        def gone() -> bool:
            try:
                state = Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                return True
            return state in ("Z", "X")  # exited; reaped by whoever adopted it

        deadline = time.monotonic() + 10
        while not gone() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(), f"the worker {worker} outlived its killed host by 10 s ({how})"
    finally:
        host.kill()
        if "worker" in locals() and not gone():
            os.kill(worker, signal.SIGKILL)
