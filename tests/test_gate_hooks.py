"""Red team of 2026-12-05, R3/R4/R7, in the gate: every torch/Triton class's ``__dict__``
(tilesmith/gate/classdigest.py), the process's hook tables (tilesmith/gate/hooktables.py) and the thread's mode
stacks, autocast and saved-tensors hooks (tilesmith/gate/modes.py, in ``torchstate.state_snapshot``). Gate-level tests
switch the static scan off, so that the worker's structural checks alone must reject each candidate
(tests/cheats/redteam_hooks.py, two or more spellings per class). Production verification: tests/test_verify_hooks.py.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

from tests import gate_support as gs
from tests.cheats import redteam_hooks as rh
from tilesmith.gate import sidefx, torchstate
from tilesmith.records import Candidate

# The new modules are imported where used, so that the gate-level tests below still run (and fail) with the
# production change reverted.


# -- unit: what is read, what counts --------------------------------------------------------------------------------
@pytest.fixture
def digest():
    from tilesmith.gate.classdigest import ClassDigest

    import torch._inductor.codecache  # noqa: F401 - as loaded in the worker before its baseline
    import torch._inductor.select_algorithm  # noqa: F401

    found = ClassDigest()
    found.baseline()
    return found


def test_a_method_replaced_however_reached_is_reported_and_additions_are_not(digest):
    import importlib

    linear, module = torch.nn.Linear, importlib.import_module("torch.nn.modules.module").Module
    forward, call = linear.forward, module.__call__
    try:
        (lambda m: m)(torch.nn).Linear.forward = lambda self, x: x
        type.__setattr__(sys.modules["torch.nn.modules.module"].Module, "__call__", lambda self, *a: None)
        linear.tilesmith_added = 1  # an addition is not a patch (Python and torch add attributes lazily)
        changed = digest.changes()
    finally:
        linear.forward, module.__call__ = forward, call
        del linear.tilesmith_added
    assert "torch.nn.modules.linear.Linear.forward (replaced)" in changed
    assert "torch.nn.modules.module.Module.__call__ (replaced)" in changed
    assert digest.changes() == []


def test_class_level_counters_and_new_classes_are_not_patches(digest):
    from torch.utils.hooks import RemovableHandle

    RemovableHandle(torch.nn.modules.module._global_forward_hooks)  # bumps the class-level next_id counter
    type("Fresh", (torch.nn.Module,), {"__module__": "torch.tilesmith_test"})
    assert digest.changes() == []


def test_a_fresh_digest_covers_the_loaded_classes_and_agrees_with_the_first(digest):
    """A second digest of the same process sees the same >1000 classes and no change. Its cost (~35 ms baseline,
    ~8 ms comparison on the 2-core CI box) is a number for bench/snapshot_cost.py, not an assertion here: a timed
    assertion failed under load (339 ms, session 19)."""
    from tilesmith.gate.classdigest import ClassDigest

    again = ClassDigest()
    again.baseline()
    assert len(digest.entries) > 1000 and len(again.entries) >= len(digest.entries)
    assert again.changes() == [] and digest.changes() == []


def test_hook_tables_report_replaced_hooks_filters_and_torch_hook_dicts():
    from tilesmith.gate import hooktables

    before = hooktables.hook_values()
    show, hook = warnings.showwarning, sys.excepthook
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = lambda *a, **k: None
            warnings.simplefilter("ignore")
            sys.excepthook = lambda *a: None
            changed = sidefx.hook_changes(before, hooktables.hook_values())
    finally:
        sys.excepthook = hook
        handle.remove()
    assert warnings.showwarning is show
    for key in ("warnings.showwarning", "warnings.filters", "sys.excepthook",
                "torch.nn.modules.module._global_forward_hooks"):
        assert f"hook {key}" in changed, changed
    assert sidefx.hook_changes(before, hooktables.hook_values()) == {}


def test_torchs_lazy_trace_handler_removing_itself_is_not_a_change_but_a_tampered_one_is():
    """Torch's LazyTraceHandler leaves ``torch.__trace`` at torch's first structured-trace record, which a
    candidate's import may trigger (a cold-cache C++ build) and the original's not: fresh-clone CI rejected an honest
    cpp_wrapper variant as global_state for it. Any other handler, or that handler with a replaced ``emit``, is."""
    import logging

    from torch._logging._internal import LazyTraceHandler

    from tilesmith.gate import hooktables

    trace = logging.getLogger("torch.__trace")
    key = "hook logging.getLogger('torch.__trace') (handlers, filters, level, disabled, propagate)"
    saved = list(trace.handlers)
    lazy, tampered, other = LazyTraceHandler(None), LazyTraceHandler(None), logging.NullHandler()
    tampered.emit = lambda record: None
    try:
        trace.addHandler(lazy)
        before = hooktables.hook_values()
        trace.removeHandler(lazy)  # what torch's handler does at its first record without a trace folder
        assert key not in sidefx.hook_changes(before, hooktables.hook_values())
        for added in (tampered, other):
            trace.addHandler(added)
            assert key in sidefx.hook_changes(before, hooktables.hook_values()), added
            trace.removeHandler(added)
    finally:
        trace.handlers[:] = saved


def test_mode_stacks_autocast_and_saved_tensor_hooks_are_state():
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from tilesmith.gate import modes

    before = torchstate.state_snapshot("cpu")
    stacks = modes.capture()
    TorchDispatchMode().__enter__()
    torch._C._push_on_torch_function_stack(TorchFunctionMode())
    torch._C._autograd._push_saved_tensors_default_hooks(lambda t: t, lambda t: t)
    try:
        changed = torchstate.diff_state(before, torchstate.state_snapshot("cpu"))
        popped = modes.pop_new(stacks)
    finally:
        torch._C._autograd._pop_saved_tensors_default_hooks()
    for key in ("modes.dispatch", "modes.function", "modes.torch_function_mode_enabled",
                "autograd.saved_tensors_default_hooks"):
        assert key in changed, changed
    assert [p.split(" mode ")[0] for p in popped] == ["popped dispatch", "popped function"]
    assert torchstate.diff_state(before, torchstate.state_snapshot("cpu")) == {}
    with torch.autocast("cpu"):
        assert "autocast.enabled(cpu)" in torchstate.diff_state(before, torchstate.state_snapshot("cpu"))


def test_pop_to_restores_depths_recorded_before_a_call():
    from torch.utils._python_dispatch import TorchDispatchMode

    from tilesmith.gate import modes

    depths = modes.depths()
    TorchDispatchMode().__enter__()
    assert modes.depths() != depths
    assert modes.pop_to(depths)[0].startswith("popped dispatch mode torch.utils._python_dispatch.TorchDispatchMode")
    assert modes.depths() == depths


# -- gate level: the structural checks alone ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ln(tmp_path_factory):
    yield from gs.linear_ln_gate(tmp_path_factory.mktemp("hooks"), "51de0fx2 (ln)")


def _rejected(ln, monkeypatch, make, check: str, key: str):
    gs.runtime_checks_only(monkeypatch)
    gate, cap, _ = ln
    verdict = gate.evaluate(Candidate(source=make(cap.source), proposer=f"redteam:{make.__name__}"))
    assert check in [f.check for f in verdict.failures], verdict.reasons
    assert verdict.status == "rejected_global_state", verdict.reasons
    assert key in " ".join(verdict.reasons), verdict.reasons
    return verdict


@pytest.mark.parametrize("make, key", [
    (rh.linear_forward_through_call, "torch.nn.modules.linear.Linear.forward"),
    (rh.module_call_type_setattr_in_call, "torch.nn.modules.module.Module.__call__"),
], ids=["R3-store-through-call", "R3-type-setattr-in-call"])
def test_r3_replaced_method_of_any_torch_class_is_rejected(ln, monkeypatch, make, key):
    _rejected(ln, monkeypatch, make, "monkeypatch", key)


@pytest.mark.parametrize("make, key", [
    (rh.global_forward_hook_table, "torch.nn.modules.module._global_forward_hooks"),
    (rh.global_forward_hook_registered_in_call, "torch.nn.modules.module._global_forward_hooks"),
    (rh.showwarning_at_import, "warnings.showwarning"),
    (rh.excepthook_in_call, "sys.excepthook"),
    (rh.threading_excepthook_in_call, "threading.excepthook"),
    (rh.atexit_callback_at_import, "atexit._ncallbacks()"),
    (rh.logging_handler_in_call, "logging.getLogger('torch')"),
    (rh.warning_filter_at_import, "warnings.filters"),
], ids=["R3-hook-dict", "R3-hook-registered", "R7-showwarning", "R7-excepthook", "R7-threading-excepthook",
        "R7-atexit", "R7-logging-handler", "R7-warning-filter"])
def test_r7_replaced_hook_table_is_rejected(ln, monkeypatch, make, key):
    _rejected(ln, monkeypatch, make, "global_state", key)


@pytest.mark.parametrize("make, key", [
    (rh.dispatch_mode_in_call, "modes.dispatch"),
    (rh.function_mode_at_import, "modes.function"),
    (rh.saved_tensors_hooks_in_call, "autograd.saved_tensors_default_hooks"),
], ids=["R4-dispatch-mode-call", "R4-function-mode-import", "R4-saved-tensors-hooks"])
def test_r4_mode_left_on_the_stack_is_rejected(ln, monkeypatch, make, key):
    _rejected(ln, monkeypatch, make, "global_state", key)


def test_honest_candidate_is_not_rejected_by_the_new_snapshots(ln, monkeypatch):
    gs.runtime_checks_only(monkeypatch)
    gate, cap, _ = ln
    verdict = gate.evaluate(Candidate(source=cap.source, proposer="control"))
    assert not [f for f in verdict.failures if f.check in ("monkeypatch", "global_state")], verdict.reasons
