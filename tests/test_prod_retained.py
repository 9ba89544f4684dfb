"""Red-team classes R1 (hidden references to outputs), R8 (slower only outside the gate) and R9 (Python objects
kept in CPython's arenas) in the user's process and, for R1, in the gate worker (CPU test mode).

Most tests install through the stand-in gate of tests/verify_support.py (every candidate accepted): what is under
test is production verification. ``test_gate_rejects_*`` and ``test_sniffing_slow_candidate_*`` go through the
real gate.
"""

from __future__ import annotations

import pytest
import torch

import tilesmith
from tests import verify_support as vs
from tests.models import MulSum, has_mulsum_loop, mm_instead_of_loop
from tests.scripted import ScriptedFactory, comment
from tilesmith.gate import retained
from tilesmith.install import leaks, retime, verify

stand_in_gate = vs.stand_in_gate


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """Production re-timing compares wall times in this process. On the 2-core CI machine with two CPU burners
    beside it (issue 19), a 2-thread intra-op pool waits a scheduler slice for its second thread at parallel regions:
    calls of 0.1 ms took 13–15 ms in streaks, and once the streaks fell on one arm only, an honest wrapper timed at
    0.02× its original and was uninstalled. So the user's side runs single-threaded here, as the gate's CPU workers
    do (docs/gate.md, "Timing"); on CUDA re-timing uses events and is not affected."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
_fn = vs.tanh_matmul
_inputs = vs.tanh_matmul_inputs

_CHECK_ALL = "first=40,every=off,interval=off"

# -- candidate edits ------------------------------------------------------------------------------------------------
RING = vs.rebind_call("""
    out = _inner(args)
    slot = _ring[_n[0] % 64]
    _n[0] += 1
    if slot is None or slot.shape != out[0].shape:
        slot = _ring[_n[0] % 64] = torch.empty_like(out[0])
    slot.copy_(out[0])
    return (slot,) + tuple(out[1:])
    """, prelude="_ring = [None] * 64\n_n = [0]\n")
"""R1: outputs from a ring of 64 static buffers (more slots than the gate's held calls)."""

STASH_VIEW = vs.rebind_call("""
    out = _inner(args)
    _stash.append(out[0].view(-1))
    del _stash[:-64]
    return out
    """, prelude="_stash = []\n")
"""R1, second spelling: a view of every output kept in a module-level list."""

CLOSURE_DEFAULT = vs.rebind_call("""
    return _keeper(_inner(args))
    """, prelude="def _keeper(out, _mem=[]):\n    _mem.append(out[0])\n    del _mem[:-64]\n    return out\n")
"""R1, third spelling: the output tensor itself kept in a function's default list."""

STORAGE_ATTR = vs.rebind_call("""
    out = _inner(args)
    _inner_keep.keep = getattr(_inner_keep, 'keep', []) + [out[0].untyped_storage()]
    return out
    """, prelude="def _inner_keep():\n    pass\n")
"""R1, fourth spelling: the output's storage object kept on a function object's attribute."""


def _slow_outside(condition: str, seconds: float = 0.004):
    """R8: correct results, but sleeps ``seconds`` per call when ``condition`` (a gate-worker detection) is false."""
    return vs.rebind_call(f"""
        if not ({condition}):
            _time.sleep({seconds})
        return _inner(args)
        """, prelude="import time as _time\nimport os as _os\n")


PY_DICTS = vs.rebind_call("""
    _keep.append([{'i': i, 'k': str(i)} for i in range(200)])
    return _inner(args)
    """, prelude="_keep = []\n")
"""R9: small dicts in a module-level list (CPython arenas: invisible to mallinfo2)."""

PY_BYTES = vs.rebind_call("""
    for i in range(300):
        _grow[(len(_grow), i)] = bytes(48)
    return _inner(args)
    """, prelude="_grow = {}\n")
"""R9, second spelling: a growing dict of small bytes objects."""


def _compile(edit, setting, monkeypatch):
    monkeypatch.setenv("TILESMITH_VERIFY", setting)
    return tilesmith.compile(_fn, example_inputs=_inputs(0), agent_model=ScriptedFactory(edits=[edit]))


def _drive(compiled, calls, keep=False):
    kept, errors = [], []
    for i in range(calls):
        x, w = _inputs(i + 1)
        out = compiled(x, w)
        errors.append(float((out - _fn(x, w)).abs().max()))
        if keep:
            kept.append((out, _fn(x, w)))
    return errors, kept


def _verifier(compiled):
    (handle,) = tilesmith.api._run_of(compiled).handles
    return verify.verifier_of(handle) or getattr(handle, "_verifier_gone", None)


def _failures(compiled):
    return [d for d in tilesmith.diagnostics(compiled) if d.kind == "verification_failed"]


# -- R1 in production ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("edit", [RING, STASH_VIEW, CLOSURE_DEFAULT, STORAGE_ATTR],
                         ids=["ring64", "stashed-view", "closure-default", "storage-on-function"])
def test_output_kept_by_the_wrapper_is_caught_at_the_first_checked_call(stand_in_gate, monkeypatch, edit):
    compiled = _compile(edit, _CHECK_ALL, monkeypatch)
    errors, kept = _drive(compiled, 1 + 70, keep=True)
    assert max(errors) < 1e-5
    (diag,) = _failures(compiled)
    assert "output_retained" in diag.message and "call 1 since install" in diag.message, diag.message
    assert "output 0" in diag.message and "retained=off" in diag.message
    for got, want in kept:  # the ring never ran after its first call: every kept output is still right
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_honest_wrapper_returning_views_and_inputs_has_no_hidden_references():
    base = torch.empty(8)

    def honest(args):
        a, b = torch.empty(4), torch.empty(16)
        return (a, b.view(4, 4), b[2:], None, 3, args[0], args[0][1:])

    def original(args):
        a, b = torch.empty(4), torch.empty(16)
        return (a, b.view(4, 4), b[2:], None, 3, args[0], args[0][1:])

    _, ref = retained.call_measured(original, [base])
    _, got = retained.call_measured(honest, [base])
    assert retained.hidden(got, ref) == [] and ref["outputs"][0] == {"storage": 0, "object": 0, "weak": 0,
                                                                      "resizable": 1}


def test_a_sequence_or_tensor_subclass_cannot_hide_a_kept_output():
    """A list subclass (or a tensor subclass) is not measured, so returning one where the original returns a plain
    list (tensor) is itself a finding: otherwise a ring of kept outputs returned in a subclass passed unseen."""
    class Seq(list):
        pass

    class T(torch.Tensor):
        pass

    keep = []

    def original(args):
        return [torch.empty(4), torch.empty(4)]

    def in_subclass(args):
        out = Seq([torch.empty(4), torch.empty(4)])
        keep.append(out[0])
        return out

    def tensor_subclass(args):
        return [torch.empty(4).as_subclass(T), torch.empty(4)]

    _, ref = retained.call_measured(original, [])
    _, got = retained.call_measured(in_subclass, [])
    (found,) = retained.hidden(got, ref)
    assert found[0] is None and "Seq" in found[1]
    _, got = retained.call_measured(tensor_subclass, [])
    (found,) = retained.hidden(got, ref)
    assert found[0] == 0 and "T was returned" in found[1]
    _, same = retained.call_measured(in_subclass, [])  # the original's own subclass is not judged against itself
    assert retained.hidden(same, same) == []


def test_retained_off_turns_the_check_off(stand_in_gate, monkeypatch):
    compiled = _compile(STASH_VIEW, _CHECK_ALL + ",retained=off", monkeypatch)
    _drive(compiled, 1 + 10)
    assert not [d for d in _failures(compiled) if "output_retained" in d.message]


# -- R1 at the gate ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("edit", [RING, CLOSURE_DEFAULT], ids=["ring64", "closure-default"])
def test_gate_rejects_a_wrapper_keeping_its_outputs(cpu_test_mode, monkeypatch, edit):
    monkeypatch.setenv("TILESMITH_VERIFY", "off")
    torch.manual_seed(0)
    model = MulSum()
    factory = ScriptedFactory(edits=[lambda t: edit(mm_instead_of_loop(t)) if has_mulsum_loop(t)
                                     else comment("noop")(t)])
    x = torch.randn(64, 512)
    compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=factory, loops=1)
    with torch.no_grad():
        compiled(x)
    (verdict,) = factory.verdicts
    assert verdict.status != "accepted"
    assert "output_retained" in " ".join(verdict.reasons) + str(getattr(verdict, "failures", "")), verdict.reasons


# -- R8 ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("condition", ["_torch_threads() == 1", "_os.environ.get('OMP_NUM_THREADS') == '1'"],
                         ids=["thread-count", "environment"])
def test_wrapper_slower_in_production_is_uninstalled_after_the_minimum_checks(stand_in_gate, monkeypatch, condition):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    edit = _slow_outside(condition.replace("_torch_threads()", "torch.get_num_threads()"))
    if condition.startswith("_torch") and torch.get_num_threads() == 1:
        monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    compiled = _compile(edit, _CHECK_ALL, monkeypatch)
    errors, _ = _drive(compiled, 1 + 20)
    assert max(errors) < 1e-5
    (diag,) = _failures(compiled)
    n = int(diag.message.split("failed on call ")[1].split()[0])
    # Decided at the first check with enough pairs (call 10) on an idle machine; under load one pair may be hit by a
    # scheduler slice on the original's side (a ratio near 1: seen at 2 burners), and the sign-test bound then needs a
    # few more pairs. Never before the minimum.
    assert retime.WARMUP + retime.MIN_PAIRS <= n <= retime.WARMUP + retime.MIN_PAIRS + 6, diag.message
    assert "slower_in_production" in diag.message and "retime=off" in diag.message, diag.message


@pytest.mark.parametrize("attempt", range(3))
def test_honest_faster_wrapper_stays_installed_over_the_same_checks(stand_in_gate, monkeypatch, attempt):
    compiled = _compile(vs.honest(), _CHECK_ALL, monkeypatch)
    errors, _ = _drive(compiled, 1 + 40)
    v = _verifier(compiled)
    assert v is not None and not v.failed and v.checks == 40, tilesmith.diagnostics(compiled)
    assert len(v.retime.original) >= retime.MIN_PAIRS


# -- R9 ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("edit", [PY_DICTS, PY_BYTES], ids=["list-of-dicts", "dict-of-bytes"])
def test_python_objects_kept_every_call_are_a_leak(stand_in_gate, monkeypatch, edit):
    monkeypatch.setattr(leaks, "BLOCK_BOUND", 5000, raising=False)
    compiled = _compile(edit, _CHECK_ALL + ",retime=off", monkeypatch)
    errors, _ = _drive(compiled, 1 + 20)
    assert max(errors) < 1e-5
    (diag,) = _failures(compiled)
    n = int(diag.message.split("failed on call ")[1].split()[0])
    assert leaks.WARMUP + leaks.STREAK <= n <= 12, diag.message
    assert "memory_leak" in diag.message and "Python object blocks" in diag.message, diag.message
