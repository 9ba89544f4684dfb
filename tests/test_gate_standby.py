"""The standby gate worker (tilesmith.gate.host.standby): started by tilesmith.compile(), adopted by the first gate,
never adopted with a stale environment, never given a secret, gone with its folder afterwards (CPU)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

import tilesmith
from tilesmith.gate.host import standby


@pytest.fixture
def prestart_on(monkeypatch):
    monkeypatch.setenv("TILESMITH_PRESTART_WORKER", "1")
    standby.discard()
    yield
    standby.discard()


def _waiting():
    """(worker, parent folder) of the waiting standby worker, or None."""
    return None if standby._standby is None else (standby._standby, standby._standby.extra_dirs[0])


def _gone(worker, parent: Path) -> bool:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (worker.alive() or parent.exists()):
        time.sleep(0.05)
    return not worker.alive() and not parent.exists()


def test_prestart_is_off_with_the_setting(monkeypatch):
    monkeypatch.setenv("TILESMITH_PRESTART_WORKER", "0")
    standby.discard()
    assert standby.prestart() is False and _waiting() is None


def test_one_standby_per_process_adopted_once_and_removed_with_its_worker(prestart_on):
    assert standby.prestart() is True
    worker, parent = _waiting()
    assert standby.prestart() is True and _waiting()[0] is worker  # at most one waits
    assert parent.is_dir() and worker.dir.parent == parent and oct(parent.stat().st_mode & 0o777) == "0o700"
    adopted = standby.adopt("deadbeef (0_inference) candidate worker")
    assert adopted is worker and _waiting() is None and standby.adopt("x") is None
    assert adopted.label.startswith("deadbeef (0_inference) candidate worker#")
    assert adopted.wait_ready(120)["type"] == "ready"  # the same protocol greeting a gate's own worker sends
    adopted.kill()
    assert _gone(worker, parent)


def test_a_changed_environment_is_never_adopted_and_prestart_replaces_the_worker(prestart_on, monkeypatch):
    standby.prestart()
    worker, parent = _waiting()
    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "1")  # would change what the worker compiles
    assert standby.prestart() is True
    fresh, fresh_parent = _waiting()
    assert fresh is not worker and b"TORCHINDUCTOR_MAX_AUTOTUNE=1" in _environ(fresh)
    assert _gone(worker, parent)
    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "0")
    assert standby.adopt("graph worker") is None and _waiting() is None
    assert _gone(fresh, fresh_parent)


def test_variables_torch_sets_while_compiling_do_not_block_adoption(prestart_on, monkeypatch):
    standby.prestart()
    worker = _waiting()[0]
    for name in ("TRITON_PTXAS_PATH", "CUBLAS_WORKSPACE_CONFIG", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"):
        monkeypatch.setenv(name, "set-by-torch-after-the-standby-started")
    assert standby.adopt("graph worker") is worker
    worker.kill()


def _environ(worker) -> bytes:
    """The environment the worker's process started with. Right after ``Popen`` the file can still be empty
    (the child has not reached ``exec`` yet), so it is polled."""
    deadline = time.monotonic() + 30
    while True:
        raw = Path(f"/proc/{worker.pid}/environ").read_bytes()
        if raw or time.monotonic() > deadline:
            return raw
        time.sleep(0.02)


def test_the_standby_gets_exactly_a_gate_workers_environment_without_secrets(prestart_on, monkeypatch):
    from tilesmith.gate.host.process import private_environment, worker_environment

    monkeypatch.setenv("OPENAI_API_KEY", "sk-standby-secret-0123456789")
    monkeypatch.setenv("MY_SERVICE_TOKEN", "tok-standby-secret-abcdef")
    standby.prestart()
    worker = _waiting()[0]
    raw = _environ(worker)
    assert b"standby-secret" not in raw
    started = dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)
    assert started == {**worker_environment(), **private_environment(worker.dir)}


def test_a_standby_adopted_long_after_it_started_gets_the_full_start_timeout(prestart_on):
    standby.prestart()
    worker = _waiting()[0]
    worker.started -= 200  # older than the 180 s start timeout, younger than MAX_IDLE_S
    adopted = standby.adopt("graph worker")
    assert adopted is worker and adopted.wait_ready(180)["type"] == "ready"
    adopted.kill()


def test_settle_waits_for_the_greeting_and_keeps_the_standby_waiting(prestart_on):
    standby.prestart()
    worker = _waiting()[0]
    assert worker.ready_info is None
    standby.settle(180)
    assert worker.ready_info is not None and _waiting()[0] is worker
    assert standby.adopt("graph worker") is worker
    worker.kill()


def test_compile_starts_the_standby_and_the_first_gate_adopts_it(prestart_on, cpu_test_mode, monkeypatch):
    from tests.models import MulSum, has_mulsum_loop, mm_instead_of_loop
    from tests.scripted import ScriptedFactory, comment

    adopted = []
    real_adopt = standby.adopt

    def spy(label, *rest):
        worker = real_adopt(label, *rest)
        adopted.append((label, worker))
        return worker

    monkeypatch.setattr(standby, "adopt", spy)
    torch.manual_seed(0)
    model, x = MulSum().eval(), torch.randn(64, 512)
    factory = ScriptedFactory(edits=[lambda t: mm_instead_of_loop(t) if has_mulsum_loop(t) else comment("noop")(t)])
    compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=factory)
    waiting = _waiting()
    assert waiting is not None, "tilesmith.compile() in CPU test mode did not start a standby worker"
    pid, parent = waiting[0].pid, waiting[1]
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    assert [w.pid for _, w in adopted if w is not None] == [pid], adopted  # adopted once: the first worker
    assert len(factory.sessions) == 1 and factory.verdicts, "the gate did not evaluate the candidate"
    assert _gone(waiting[0], parent)  # the gate closed after the graph's stages: worker and folder gone


def test_a_forked_child_leaves_its_parents_standby_alone(prestart_on):
    standby.prestart()
    worker = _waiting()[0]
    pid = os.fork()
    if pid == 0:  # the child: an exit through atexit-like cleanup must not kill the parent's worker
        try:
            standby.discard()
            code = 0 if standby.adopt("x") is None else 1
        except BaseException:  # noqa: BLE001
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert worker.alive() and _waiting()[0] is worker
