"""Production verification of installed wrappers (issue 15, item 4), CPU test mode.

Candidates are installed by a stand-in gate that accepts everything (tests/verify_support.py): the subject is
what happens in the user's process after install. Every test compares the user's outputs with plain Inductor's
(``torch.compile`` of the same function) call by call.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import pytest
import torch

import tilesmith
from tests import verify_support as vs
from tests.scripted import ScriptedFactory
from tilesmith.errors import SettingsError
from tilesmith.install import verify


stand_in_gate = vs.stand_in_gate
_fn = vs.tanh_matmul
_inputs = vs.tanh_matmul_inputs


def _compile(edit, setting, monkeypatch, fn=_fn):
    monkeypatch.setenv("TILESMITH_VERIFY", setting)
    factory = ScriptedFactory(edits=[edit])
    x, w = _inputs(0)
    return tilesmith.compile(fn, example_inputs=(x, w), agent_model=factory), factory


def _verifier(compiled):
    (handle,) = tilesmith.api._run_of(compiled).handles
    return handle, verify.verifier_of(handle)


def _kinds(compiled):
    return [d.kind for d in tilesmith.diagnostics(compiled)]


def _failure(compiled):
    (diag,) = [d for d in tilesmith.diagnostics(compiled) if d.kind == "verification_failed"]
    return diag


def _drive(compiled, calls, *, pause_before=None, pause_s=0.0, fn=_fn):
    """Call ``compiled`` and plain ``fn`` on fresh inputs ``calls`` times; return the max error of every call."""
    errors = []
    for i in range(calls):
        if pause_before is not None and i == pause_before:
            time.sleep(pause_s)
        x, w = _inputs(i + 1)
        errors.append(float((compiled(x, w) - fn(x, w)).abs().max()))
    return errors


def test_honest_candidate_passes_its_checks_and_unchecked_calls_copy_nothing(stand_in_gate, monkeypatch):
    from tilesmith.install.threads import ThreadCensus

    seen = {"copy": 0, "rng": 0, "census": 0}

    def spy(name, real):
        def wrapped(*a, **k):
            seen[name] += 1
            return real(*a, **k)
        return wrapped

    monkeypatch.setattr(verify, "_copy", spy("copy", verify._copy))
    monkeypatch.setattr(verify, "rng_state", spy("rng", verify.rng_state))
    monkeypatch.setattr(ThreadCensus, "unexplained", spy("census", ThreadCensus.unexplained))
    compiled, _ = _compile(vs.honest(), "first=3,every=off,interval=off", monkeypatch)
    errors = _drive(compiled, 1 + 20)  # the first call optimizes (and runs the original); 20 installed calls
    handle, v = _verifier(compiled)
    assert max(errors) < 1e-5
    assert handle.state == "installed" and len(tilesmith.benchmarks(compiled)) == 1
    assert (v.calls, v.checks, v.skipped, v.failed) == (20, 3, 0, False)
    # only the 3 checked calls copy their 2 inputs, read the RNG states (3 times) and list the threads
    assert seen == {"copy": 3 * 2, "rng": 3 * 3, "census": 3}, seen
    assert not [k for k in _kinds(compiled) if k.startswith("verification")]
    assert v.check_cost_s is not None and v.call_s is not None


def test_sampled_checks_follow_the_mean_gap(stand_in_gate, monkeypatch):
    compiled, _ = _compile(vs.honest(), "first=0,every=4,budget=off,interval=off", monkeypatch)
    x, w = _inputs(1)
    for _ in range(1 + 400):
        compiled(x, w)
    _, v = _verifier(compiled)
    assert v.calls == 400 and 40 <= v.checks <= 180, v.checks  # Binomial(400, 1/4): mean 100, sd 8.7
    assert not v.failed


def test_budget_raises_the_gap_above_every(stand_in_gate, monkeypatch):
    compiled, _ = _compile(vs.honest(), "first=5,every=2,budget=0.001,interval=off", monkeypatch)
    _drive(compiled, 1 + 6)
    _, v = _verifier(compiled)
    # a check costs at least the original's call again, so at 0.1 % the mean gap must exceed 1/0.001 calls
    assert v.gap >= 0.5 / 0.001 and v.gap == pytest.approx(v.check_cost_s / (0.001 * v.graph_time_s()), rel=1e-6)


@pytest.mark.parametrize("bomb", [vs.count_bomb_closure, vs.count_bomb_itertools], ids=["closure", "itertools"])
def test_call_count_bomb_within_the_first_calls_is_caught_and_quarantined(stand_in_gate, monkeypatch, bomb):
    compiled, _ = _compile(bomb(5), "first=20,every=off,interval=off", monkeypatch)
    errors = _drive(compiled, 1 + 12)
    assert max(errors) < 1e-5, errors  # including the call where it was caught and every later call
    handle, v = _verifier(compiled)
    assert handle.state == "uninstalled" and v is None and handle.compiled.current_callable is handle.original
    assert tilesmith.benchmarks(compiled) == ()
    diag = _failure(compiled)
    assert diag.graph_key == handle.key and handle.key[:8] in diag.message
    assert "call 6 since install" in diag.message and "output 0" in diag.message and "tolerance row float32" in \
        diag.message and "quarantined" in diag.message
    track = json.loads((stand_in_gate / "runs" / tilesmith.api._run_of(compiled).run_id / handle.key /
                        "track.json").read_text())
    assert track["status"] == "uninstalled" and track["verification"]["failed_call"] == 6
    from tilesmith.cache import ArtifactStore

    store = ArtifactStore(stand_in_gate)
    (record,) = store.quarantined()
    assert record.key == handle.key and record.moved_entry and "call 6" in record.reason
    assert store.get(handle.key) is None


def _second_compile(monkeypatch):
    torch._dynamo.reset()
    compiled, factory = _compile(vs.honest(), "first=2,every=off,interval=off", monkeypatch)
    _drive(compiled, 2)
    return compiled, factory


def test_quarantined_artifact_is_not_served_to_a_second_compile(stand_in_gate, monkeypatch):
    compiled, _ = _compile(vs.count_bomb_closure(2), "first=10,every=off,interval=off", monkeypatch)
    _drive(compiled, 1 + 4)
    assert "verification_failed" in _kinds(compiled)
    again, factory = _second_compile(monkeypatch)
    assert "cache_hit" not in _kinds(again) and len(factory.sessions) == 1, _kinds(again)


def test_control_an_honest_artifact_is_served_to_a_second_compile(stand_in_gate, monkeypatch):
    compiled, _ = _compile(vs.honest(), "first=10,every=off,interval=off", monkeypatch)
    _drive(compiled, 1 + 4)
    again, factory = _second_compile(monkeypatch)
    assert "cache_hit" in _kinds(again) and factory.sessions == []


def test_a_caught_graph_takes_its_identical_twin_down_with_it(stand_in_gate, monkeypatch):
    compiled, factory = _compile(vs.count_bomb_itertools(3), "first=10,every=off,interval=off", monkeypatch)
    x, w = _inputs(1)
    with torch.no_grad():
        compiled(x, w)
    with torch.inference_mode():  # a Dynamo guard fails: the same wrapper again, installed as a twin
        compiled(x, w)
    run = tilesmith.api._run_of(compiled)
    assert len(run.handles) == 2 and len(factory.sessions) == 1
    assert all(verify.verifier_of(h) is not None for h in run.handles), tilesmith.diagnostics(compiled)
    with torch.no_grad():
        errors = _drive(compiled, 5)  # the first handle's bomb fires on its 4th installed call
    with torch.inference_mode():
        errors += _drive(compiled, 5)  # the twin's would fire on its 4th call too, but it is gone
    assert max(errors) < 1e-5, errors
    states = [h.state for h in run.handles]  # inference tensors made under inference_mode may recompile again
    assert states[:2] == ["uninstalled", "uninstalled"] and set(states[2:]) <= {"kept_inductor"}, states
    assert all("production verification uninstalled" in d.message for d in tilesmith.diagnostics(compiled)
               if d.kind == "duplicate_graph" and "stays on Inductor" in d.message)
    assert len([d for d in tilesmith.diagnostics(compiled) if d.kind == "verification_failed"]) == 1


def test_call_count_bomb_in_the_sampled_phase_is_caught_within_a_bounded_number_of_calls(stand_in_gate,
                                                                                        monkeypatch):
    compiled, _ = _compile(vs.count_bomb_itertools(10), "first=2,every=3,budget=off,interval=off", monkeypatch)
    errors = _drive(compiled, 1 + 10 + 200)
    _, caught = _failure(compiled), _verifier(compiled)[0]
    n = int(_failure(compiled).message.split("failed on call ")[1].split()[0])
    assert 11 <= n <= 10 + 150  # P(no check in 140 calls at p = 1/3) < 1e-24
    assert max(errors[:1 + 10]) < 1e-5, "honest calls"
    assert max(errors[n:]) < 1e-5, "the caught call and every later one"
    assert caught.state == "uninstalled"


@pytest.mark.parametrize("bomb", [vs.time_bomb_monotonic, vs.time_bomb_perf_counter], ids=["monotonic", "perf"])
def test_wall_clock_bomb_is_caught_by_the_timed_check(stand_in_gate, monkeypatch, bomb):
    compiled, _ = _compile(bomb(0.6), "first=2,every=off,interval=0.4", monkeypatch)
    errors = _drive(compiled, 1 + 6, pause_before=1 + 3, pause_s=1.2)
    assert max(errors) < 1e-5, errors
    diag = _failure(compiled)
    assert "call 4 since install" in diag.message and "output 0" in diag.message, diag.message
    assert _verifier(compiled)[0].state == "uninstalled"


def test_without_the_timed_check_the_wall_clock_bomb_is_not_caught(stand_in_gate, monkeypatch):
    compiled, _ = _compile(vs.time_bomb_monotonic(0.3), "first=2,every=off,interval=off", monkeypatch)
    errors = _drive(compiled, 1 + 4, pause_before=1 + 3, pause_s=0.5)
    assert max(errors[-1:]) > 0.1 and "verification_failed" not in _kinds(compiled)


@pytest.mark.parametrize("starter", [vs.thread_starter_threading, vs.thread_starter_low_level],
                         ids=["threading", "_thread"])
def test_thread_started_on_a_checked_call_is_caught(stand_in_gate, monkeypatch, starter):
    compiled, _ = _compile(starter(3), "first=10,every=off,interval=off", monkeypatch)
    errors = _drive(compiled, 1 + 5)
    assert max(errors) < 1e-5
    diag = _failure(compiled)
    assert "call 3 since install" in diag.message and "thread_count" in diag.message
    assert "threads=off" in diag.message


@pytest.mark.parametrize("starter", [vs.thread_starter_threading, vs.thread_starter_low_level],
                         ids=["threading", "_thread"])
def test_thread_started_on_an_unchecked_call_is_caught_at_the_next_check(stand_in_gate, monkeypatch, starter):
    compiled, _ = _compile(starter(2), "first=1,every=off,interval=1.0", monkeypatch)
    _drive(compiled, 1 + 3, pause_before=1 + 2, pause_s=1.5)
    assert "call 3 since install" in _failure(compiled).message


def test_threads_of_the_users_own_code_are_not_blamed(stand_in_gate, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    compiled, _ = _compile(vs.honest(), "first=8,every=off,interval=off", monkeypatch)
    _drive(compiled, 1 + 2)
    stop = threading.Event()
    mine = threading.Thread(target=lambda: stop.wait(10), daemon=True)
    mine.start()
    pool = ThreadPoolExecutor(max_workers=2)
    try:
        list(pool.map(abs, range(4)))
        errors = _drive(compiled, 4)
    finally:
        stop.set()
        pool.shutdown()
    assert max(errors) < 1e-5 and "verification_failed" not in _kinds(compiled), tilesmith.diagnostics(compiled)
    assert _verifier(compiled)[1].checks == 6


def test_thread_check_can_be_turned_off(stand_in_gate, monkeypatch):
    compiled, _ = _compile(vs.thread_starter_low_level(2), "first=10,every=off,interval=off,threads=off",
                           monkeypatch)
    _drive(compiled, 1 + 4)
    assert "verification_failed" not in _kinds(compiled) and _verifier(compiled)[1].checks == 4


def test_verify_off_installs_the_bare_wrapper(stand_in_gate, monkeypatch):
    compiled, _ = _compile(vs.count_bomb_closure(2), "off", monkeypatch)
    errors = _drive(compiled, 1 + 4)
    handle, v = _verifier(compiled)
    assert v is None and handle.state == "installed" and not hasattr(handle.compiled.current_callable,
                                                                      "_tilesmith_verifier")
    assert errors[-1] > 0.1 and not [k for k in _kinds(compiled) if k.startswith("verification")]


@pytest.mark.parametrize("value", ["sometimes", "first=-1", "every=0", "interval=0", "first=1,rate=3", "5,100,60"])
def test_invalid_verify_setting_is_a_settings_error_naming_the_forms(cpu_test_mode, monkeypatch, value):
    monkeypatch.setenv("TILESMITH_VERIFY", value)
    with pytest.raises(SettingsError, match=r"TILESMITH_VERIFY=.*expected 'off'; 'on'.*first=.*every=.*interval="):
        tilesmith.compile(_fn, example_inputs=_inputs(0), agent_model=ScriptedFactory())


def test_candidate_raising_on_a_checked_call_returns_the_originals_outputs(stand_in_gate, monkeypatch):
    compiled, _ = _compile(vs.raises_after(2), "first=10,every=off,interval=off", monkeypatch)
    errors = _drive(compiled, 1 + 4)
    assert max(errors) < 1e-5 and "crash" in _failure(compiled).message


def test_candidate_raising_on_an_unchecked_call_is_uninstalled_and_the_error_re_raised(stand_in_gate,
                                                                                      monkeypatch):
    compiled, _ = _compile(vs.raises_after(2), "first=1,every=off,interval=off", monkeypatch)
    _drive(compiled, 1 + 2)
    with pytest.raises(RuntimeError, match="injected"):
        _drive(compiled, 1)
    assert max(_drive(compiled, 3)) < 1e-5, "later calls run on Inductor"
    assert "unchecked call" in _failure(compiled).message


def _row_sum(x):
    return x.sum(1)


def _cancelling(seed):
    """Rows of ±(1000 + u) pairs: sums of order 0.1 whose float32 rounding error (~1e-3) is far above rtol."""
    g = torch.Generator().manual_seed(seed)
    big = 1000 + torch.rand(64, 16, generator=g)
    x = torch.empty(64, 32)
    x[:, 0::2], x[:, 1::2] = big, -(big + 0.1 * torch.randn(64, 16, generator=g))
    return x


def test_honest_rounding_beyond_the_elementwise_tolerance_is_judged_against_the_originals_noise(stand_in_gate,
                                                                                                 monkeypatch):
    from tilesmith.gate.host.compare import compare_output

    more_precise = vs.rebind_call("x = args[0]\nout = _inner(args)\nout[0].copy_(x.double().sum(1).float())\n"
                                  "return out")
    monkeypatch.setenv("TILESMITH_VERIFY", "first=5,every=off,interval=off")
    compiled = tilesmith.compile(_row_sum, example_inputs=(_cancelling(0),),
                                 agent_model=ScriptedFactory(edits=[more_precise]))
    strict = []
    for i in range(1 + 5):
        x = _cancelling(i + 1)
        got, want = compiled(x), torch.compile(_row_sum)(x)
        strict.append(compare_output(0, want, got, variant="production", tf32=False, poison_byte=None, others={},
                                     where="test"))
    assert all(f is not None for f in strict[1:]), "the elementwise test alone would uninstall it"
    _, v = _verifier(compiled)
    assert v.checks == 5 and not v.failed, tilesmith.diagnostics(compiled)


def test_precision_downgrade_bomb_is_not_excused_as_rounding_noise(stand_in_gate, monkeypatch):
    compiled, _ = _compile(vs.precision_bomb(3), "first=10,every=off,interval=off", monkeypatch)
    errors = _drive(compiled, 1 + 6)
    assert max(errors) < 1e-5
    message = _failure(compiled).message
    assert "call 4 since install" in message and "precision_loss" in message and "rounding sensitivity" in message


def test_a_fault_inside_the_check_serves_the_original_and_uninstalls_without_quarantine(stand_in_gate,
                                                                                        monkeypatch):
    def broken(*_):
        raise RuntimeError("bug in the check (injected)")

    compiled, _ = _compile(vs.count_bomb_closure(0), "first=10,every=off,interval=off", monkeypatch)
    monkeypatch.setattr(verify, "output_facts", broken)
    errors = _drive(compiled, 1 + 3)
    assert max(errors) < 1e-5, "the bomb's outputs were never judged, so never returned"
    (diag,) = [d for d in tilesmith.diagnostics(compiled) if d.kind == "verification_error"]
    assert "injected" in diag.message and "not quarantined" in diag.message
    from tilesmith.cache import ArtifactStore

    assert ArtifactStore(stand_in_gate).quarantined() == [] and _verifier(compiled)[0].state == "uninstalled"


# -- random numbers -------------------------------------------------------------------------------------------
def _dropout(x, w):
    return torch.nn.functional.dropout(x @ w, p=0.5, training=True) + 1.0


def test_rng_graph_checks_replay_the_generator_and_keep_the_users_stream(stand_in_gate, monkeypatch):
    compiled, _ = _compile(vs.honest(), "first=50,every=off,interval=off", monkeypatch, fn=_dropout)
    plain = torch.compile(_dropout)
    x, w = _inputs(1)
    torch.manual_seed(123)
    ours = [compiled(x, w) for _ in range(1 + 5)] + [torch.rand(3)]
    torch.manual_seed(123)
    theirs = [plain(x, w) for _ in range(1 + 5)] + [torch.rand(3)]
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    _, v = _verifier(compiled)
    assert v.checks == 5 and not [k for k in _kinds(compiled) if k.startswith("verification")]


def test_rng_thief_is_caught(stand_in_gate, monkeypatch):
    compiled, _ = _compile(vs.rng_thief(3), "first=50,every=off,interval=off", monkeypatch, fn=_dropout)
    plain = torch.compile(_dropout)
    x, w = _inputs(1)
    torch.manual_seed(7)
    ours = [compiled(x, w) for _ in range(1 + 5)] + [torch.rand(3)]
    torch.manual_seed(7)
    theirs = [plain(x, w) for _ in range(1 + 5)] + [torch.rand(3)]
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the RNG stream stays the original's throughout
    diag = _failure(compiled)
    assert "rng_state" in diag.message and "call 3 since install" in diag.message


# -- training graphs ------------------------------------------------------------------------------------------
class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 64)
        self.fc2 = torch.nn.Linear(64, 8)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _train(edit_for, monkeypatch, steps=5, setting="first=50,every=off,interval=off"):
    monkeypatch.setenv("TILESMITH_VERIFY", setting)
    torch.manual_seed(0)
    ours, theirs = _Net(), _Net()
    theirs.load_state_dict(ours.state_dict())
    factory = ScriptedFactory(edits=[edit_for])
    x0 = torch.randn(16, 32)
    compiled = tilesmith.compile(ours, example_inputs=(x0,), agent_model=factory)
    plain = torch.compile(theirs)
    worst = []
    for step in range(steps):
        x = torch.randn(16, 32)
        for model in (compiled, plain):
            model.zero_grad()
            model(x).square().sum().backward()
        worst.append(max(float((a.grad - b.grad).abs().max()) for a, b in zip(ours.parameters(),
                                                                               theirs.parameters())))
    return compiled, worst


def _by_kind(compiled):
    return {h.graph.kind: h for h in tilesmith.api._run_of(compiled).handles}


def test_training_forward_and_backward_are_both_verified(stand_in_gate, monkeypatch):
    compiled, worst = _train(lambda t: vs.honest()(t), monkeypatch)
    assert max(worst) < 1e-4, worst
    handles = _by_kind(compiled)
    assert set(handles) == {"forward", "backward"}
    for h in handles.values():
        v = verify.verifier_of(h)
        assert v is not None and v.checks == 4 and not v.failed, h.label  # steps 2..5 (step 1 optimizes)
    assert not [k for k in _kinds(compiled) if k.startswith("verification")]


def test_backward_bomb_is_caught_and_gradients_stay_right(stand_in_gate, monkeypatch):
    def edit(text):
        return vs.count_bomb_closure(2)(text) if "tangents_1" in text else vs.honest()(text)

    compiled, worst = _train(edit, monkeypatch, steps=6)
    assert max(worst) < 1e-4, worst
    handles = _by_kind(compiled)
    assert handles["backward"].state == "uninstalled" and handles["forward"].state == "installed"
    diag = _failure(compiled)
    assert diag.graph_key == handles["backward"].key and "call 3 since install" in diag.message


# -- the thread census ----------------------------------------------------------------------------------------
def _idle(stop):
    stop.wait(10)


def _native_named(name: bytes, stop) -> None:
    """A ``_thread`` thread (unknown to ``threading``) that sets its OS name, as a native runtime thread does."""
    import ctypes

    ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME
    stop.wait(10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_NAME) and /proc are Linux's")
def test_census_explains_pytorchs_autograd_threads_that_share_one_name():
    import _thread

    from tilesmith.install.threads import ThreadCensus, os_threads

    stop = threading.Event()
    try:
        def named(name: str) -> int:
            return list(os_threads().values()).count(name)

        def wait_for(name: str, count: int) -> None:
            deadline = time.monotonic() + 5
            while named(name) < count and time.monotonic() < deadline:
                time.sleep(0.01)
            assert named(name) == count

        census = ThreadCensus()  # earlier tests' backward passes may have started real autograd threads
        before = named("pt_autograd_0")
        for _ in range(4):  # the engine starts pt_autograd_0 once per device type it knows (H200: four)
            _thread.start_new_thread(_native_named, (b"pt_autograd_0", stop))
        wait_for("pt_autograd_0", before + 4)
        assert census.unexplained(()) == []
        before = named("helper")
        for _ in range(2):  # any other shared name stays an inherited name, reported
            _thread.start_new_thread(_native_named, (b"helper", stop))
        wait_for("helper", before + 2)
        lines = census.unexplained(())
        assert len(lines) == 2 and all("'helper'" in line and "inherited name" in line for line in lines), lines
    finally:
        stop.set()


def test_census_explains_library_threads_and_reports_anonymous_and_wrapper_threads():
    import _thread
    from concurrent.futures import ThreadPoolExecutor

    from tilesmith.install.threads import ThreadCensus

    stop = threading.Event()
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        census = ThreadCensus()
        assert census.available and census.unexplained(()) == []
        pool.submit(abs, 1).result()
        threading.Thread(target=_idle, args=(stop,), daemon=True).start()
        timer = threading.Timer(10, _idle, args=(stop,))  # e.g. the standby gate worker's expiry timer
        timer.start()
        timer_stop = timer.cancel
        assert census.unexplained(()) == [], "an executor's worker, a timer and a thread running this file's code"
        timer_stop()
        census = ThreadCensus()
        threading.Thread(target=time.sleep, args=(3,), daemon=True).start()
        (line,) = census.unexplained(())
        assert "runs no code that identifies its owner" in line
        census = ThreadCensus()
        _thread.start_new_thread(time.sleep, (3,))
        time.sleep(0.05)
        (line,) = census.unexplained(())
        assert "unknown to Python's threading module" in line and "inherited name" in line
        census = ThreadCensus()
        threading.Thread(target=_idle, args=(stop,), daemon=True).start()
        (line,) = census.unexplained((__file__,))
        assert "runs code of the installed wrapper" in line
    finally:
        stop.set()
        pool.shutdown()


# -- the gate's side-effect snapshot, re-checked in the user's process (issue 15, "Gate, structurally") ----------
@pytest.fixture
def restored():
    with vs.restore_process_state():
        yield


@pytest.mark.parametrize("changer, key", [
    (vs.extern_kernel_patcher, "extern_kernels.mm"),
    (vs.backend_flag_flipper, "torch.backends.mkldnn.enabled"),
    (vs.flush_denormal_flipper, "probe.denormal"),
], ids=["extern_kernels", "backends-flag", "flush-denormal"])
def test_global_state_changed_on_a_checked_call_is_caught(stand_in_gate, monkeypatch, restored, changer, key):
    compiled, _ = _compile(changer(3), "first=10,every=off,interval=off,threads=off", monkeypatch)
    errors = _drive(compiled, 1 + 5)
    assert max(errors) < 1e-5
    handle, _ = _verifier(compiled)
    assert handle.state == "uninstalled"
    diag = _failure(compiled)
    assert "call 3 since install" in diag.message and "global_state" in diag.message and key in diag.message
    assert handle.key[:8] in diag.message and "state=off" in diag.message and "quarantined" in diag.message


@pytest.mark.parametrize("changer", [vs.extern_kernel_patcher, vs.backend_flag_flipper],
                         ids=["extern_kernels", "backends-flag"])
def test_global_state_changed_on_an_unchecked_call_is_caught_at_the_next_check(stand_in_gate, monkeypatch,
                                                                               restored, changer):
    compiled, _ = _compile(changer(2), "first=1,every=off,interval=1.0,threads=off", monkeypatch)
    _drive(compiled, 1 + 3, pause_before=1 + 2, pause_s=1.5)
    assert "call 3 since install" in _failure(compiled).message


def test_state_check_can_be_turned_off(stand_in_gate, monkeypatch, restored):
    compiled, _ = _compile(vs.backend_flag_flipper(2), "first=10,every=off,interval=off,state=off", monkeypatch)
    _drive(compiled, 1 + 4)
    assert "verification_failed" not in _kinds(compiled) and _verifier(compiled)[1].snapshot is None


# -- state windows: what changes while only the wrapper runs (its import, a checked call) -------------------------
@pytest.fixture
def user_state():
    """Save and restore what the window tests change: the default dtype, the float32 matmul precision, Python's
    global ``random``."""
    import random

    dtype, precision, state = torch.get_default_dtype(), torch.get_float32_matmul_precision(), random.getstate()
    yield
    torch.set_default_dtype(dtype)
    torch.set_float32_matmul_precision(precision)
    random.setstate(state)


@pytest.mark.parametrize("changer, key", [
    (vs.random_reseeder, "rng.python_random"),
    (vs.random_drawer, "rng.python_random"),
    (vs.precision_setter, "float32_matmul_precision"),
], ids=["reseed-random", "draw-random", "matmul-precision"])
def test_state_changed_while_the_wrapper_runs_is_caught_and_put_back(stand_in_gate, monkeypatch, restored,
                                                                   user_state, changer, key):
    import random

    compiled, _ = _compile(changer(2), "first=10,every=off,interval=off,threads=off", monkeypatch)
    random.seed(99)
    expected = [random.random() for _ in range(4)]
    random.seed(99)
    precision = torch.get_float32_matmul_precision()
    drawn = []
    for i in range(4):  # the user's own draws between calls are not blamed on the wrapper
        x, w = _inputs(i + 1)
        assert float((compiled(x, w) - _fn(x, w)).abs().max()) < 1e-5
        drawn.append(random.random())
    handle, _ = _verifier(compiled)
    assert handle.state == "uninstalled"
    diag = _failure(compiled)
    assert "call 2 since install" in diag.message and key in diag.message and handle.key[:8] in diag.message
    # the wrapper's change was put back: the user's stream and settings are what they would have been
    assert drawn == expected and torch.get_float32_matmul_precision() == precision


def test_users_own_state_changes_between_calls_are_not_blamed(stand_in_gate, monkeypatch, restored, user_state):
    import random

    compiled, _ = _compile(vs.honest(), "first=10,every=off,interval=off", monkeypatch)
    for i in range(5):
        random.seed(i)
        random.random()
        x, w = _inputs(i + 1)
        compiled(x, w)
    assert "verification_failed" not in _kinds(compiled) and _verifier(compiled)[0].state == "installed"


@pytest.mark.parametrize("prelude, key", [
    ("torch.set_default_dtype(torch.float64)\n", "default_dtype"),
    ("import random as _r\n_r.seed(7)\n", "rng.python_random"),
], ids=["default-dtype", "reseed-random"])
def test_state_changed_by_the_wrappers_import_keeps_inductor_and_is_put_back(stand_in_gate, monkeypatch, restored,
                                                                             user_state, prelude, key):
    import random

    random.seed(5)
    expected = random.random()
    random.seed(5)
    compiled, _ = _compile(vs.import_time_state(prelude), "first=10,every=off,interval=off", monkeypatch)
    x, w = _inputs(1)
    assert float((compiled(x, w) - _fn(x, w)).abs().max()) < 1e-5
    (diag,) = [d for d in tilesmith.diagnostics(compiled) if d.kind == "verification_failed"]
    assert "importing the accepted wrapper" in diag.message and key in diag.message
    assert _verifier(compiled)[0].state != "installed"
    assert torch.get_default_dtype() == torch.float32 and random.random() == expected


def test_checks_stay_frequent_when_the_wrapper_makes_unchecked_calls_look_free(stand_in_gate, monkeypatch):
    """The sampled gap uses the graph's own time per call; a wrapper that skips its work on calls it guesses are
    unchecked shrinks the wall time between checks. The gate's measured time is the floor of that estimate."""
    compiled, _ = _compile(vs.honest(), "first=1,every=10,interval=off", monkeypatch)
    x, w = _inputs(1)
    compiled(x, w)
    _, verifier = _verifier(compiled)
    verifier.gate_call_s = 0.01
    verifier.call_s, verifier.spacing_s = 1e-3, 1e-7  # unchecked calls that seem to cost nothing
    assert verifier.graph_time_s() == pytest.approx(0.005)
    verifier.gate_call_s = 0.0
    assert verifier.graph_time_s() == pytest.approx(1e-7)
