"""Side effects by structure (issue 15, item 3; regression tests of item 6): the worker snapshots every attribute of
the namespaces the original wrapper uses, the readable values of ``torch.backends.*`` and the compiler
configurations, probes flush-to-zero behaviourally, and watches ``sys.path``/``sys.meta_path``/``sys.path_hooks``
(tilesmith/gate/sidefx.py). Gate-level tests switch the static scan off, so that the worker's structural
check alone must reject each red-team candidate (tests/cheats/redteam_sidefx.py), two or more spellings per class.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests import gate_support as gs
from tests.cheats import redteam_sidefx as rs
from tilesmith.gate import torchstate
from tilesmith.gate.host.answers import global_failures
from tilesmith.gate import sidefx
from tilesmith.records import Candidate


# -- unit: what the host watches, what the worker reports ---------------------------------------------------------
def test_wrapper_namespaces_come_from_the_originals_imports_and_ops():
    source = ("import torch\nimport triton.language as tl\nfrom torch._inductor.select_algorithm import extern_kernels\n"
              "aten = torch.ops.aten\n_q = torch.ops._quantized\nfrom . import rel\n")
    names = torchstate.wrapper_namespaces(source)
    for name in ("torch", "triton.language", "torch._inductor.select_algorithm",
                 "torch._inductor.select_algorithm.extern_kernels", "torch.ops.aten", "torch.ops._quantized"):
        assert name in names
    assert not any("rel" in n for n in names)
    assert torchstate.wrapper_namespaces("def broken(:\n") == []


@pytest.fixture
def effects():
    import torch._inductor.codecache  # noqa: F401 - imported before the baseline, as in the worker (Dynamo's
    import torch._inductor.select_algorithm  # noqa: F401 - import wraps torch.manual_seed)

    def baseline() -> sidefx.SideEffects:  # in the test's own phase: pytest adds log-capture handlers per phase
        watch = sidefx.SideEffects()
        watch.baseline(["torch._inductor.select_algorithm.extern_kernels", "torch.ops.aten"])
        return watch

    return baseline


def test_unchanged_process_reports_nothing_and_lazy_initialisation_is_not_a_change(effects):
    effects = effects()
    import tempfile

    from torch._inductor.select_algorithm import extern_kernels

    tempfile.gettempdir()  # sets tempfile.tempdir (None → str) on first use
    torch.ops.aten.sin  # resolves a packet on first use (an addition to the namespace)
    extern_kernels.mm  # reading is not writing
    assert effects.identity_changes() == []
    assert effects.state_changes() == {}


def test_replaced_non_callable_and_namespace_attributes_are_reported(effects):
    effects = effects()
    from torch._inductor import codecache
    from torch._inductor.select_algorithm import extern_kernels

    space, saved_mm, saved_timeout = vars(extern_kernels), extern_kernels.mm, codecache.LOCK_TIMEOUT
    saved_sinh = vars(torch.ops.aten).get("sinh")
    try:
        space["mm"] = lambda *a, **k: saved_mm(*a, **k)
        codecache.LOCK_TIMEOUT = saved_timeout + 1
        torch.ops.aten.__dict__["sinh"] = torch.ops.aten.cosh
        changed = effects.identity_changes()
    finally:
        space["mm"], codecache.LOCK_TIMEOUT = saved_mm, saved_timeout
        if saved_sinh is None:
            torch.ops.aten.__dict__.pop("sinh", None)
        else:
            torch.ops.aten.__dict__["sinh"] = saved_sinh
    assert "torch._inductor.select_algorithm.extern_kernels.mm" in changed
    assert "torch._inductor.codecache.LOCK_TIMEOUT" in changed
    assert any(c.startswith("torch.ops.aten.sinh") for c in changed)
    assert effects.identity_changes() == []


def test_getter_less_state_and_import_system_changes_are_reported(effects):
    effects = effects()
    mkldnn = torch.backends.mkldnn.enabled
    finder = type("Finder", (), {"find_spec": lambda self, *a: None})()
    try:
        torch.set_flush_denormal(True)
        torch.backends.mkldnn.enabled = not mkldnn
        sys.path.insert(0, "/nonexistent/tilesmith-sidefx")
        sys.meta_path.append(finder)
        changes = effects.state_changes()
    finally:
        torch.set_flush_denormal(False)
        torch.backends.mkldnn.enabled = mkldnn
        sys.path.remove("/nonexistent/tilesmith-sidefx")
        sys.meta_path.remove(finder)
    if torch.set_flush_denormal(False):  # supported on this CPU (SSE3): the probe must see the mode
        assert changes["probe.denormal_float32_torch"] == ["kept", "flushed"]
        assert changes["probe.denormal_float64_python"] == ["kept", "flushed"]
    assert changes["torch.backends.mkldnn.enabled"] == [mkldnn, not mkldnn]
    assert "/nonexistent/tilesmith-sidefx" in changes["sys.path"][1]
    assert "Finder" in changes["sys.meta_path"][1]
    assert effects.state_changes() == {}
    fails = global_failures({"state_changes": changes}, "the candidate's import")
    assert [f.check for f in fails] == ["global_state", "global_state"]
    assert "sys.path" in fails[1].message and "mkldnn" in fails[0].message


# -- gate level: the structural check alone ------------------------------------------------------------------
@pytest.fixture(scope="module")
def ln(tmp_path_factory):
    yield from gs.linear_ln_gate(tmp_path_factory.mktemp("sidefx"), "51de0fx0 (ln)")


def _rejected(ln, monkeypatch, make, check: str, name: str):
    gs.runtime_checks_only(monkeypatch)
    gate, cap, _ = ln
    verdict = gate.evaluate(Candidate(source=make(cap.source), proposer=f"redteam:{name}"))
    assert check in [f.check for f in verdict.failures], verdict.reasons
    assert verdict.status == "rejected_global_state", verdict.reasons
    return verdict


@pytest.mark.parametrize("make, key", [
    (rs.extern_kernel_through_vars, "extern_kernels.addmm"),
    (rs.inductor_constant_in_call, "codecache.LOCK_TIMEOUT"),
    (rs.ops_namespace_object, "torch.ops.aten.mm"),
], ids=["extern_kernels-vars", "constant-in-call", "ops-namespace"])
def test_replaced_attribute_of_a_namespace_the_original_uses_is_rejected(ln, monkeypatch, make, key):
    verdict = _rejected(ln, monkeypatch, make, "monkeypatch", make.__name__)
    assert key in " ".join(verdict.reasons)


@pytest.mark.parametrize("make, key", [
    (rs.flush_denormal_at_import, "probe.denormal"),
    (rs.flush_denormal_in_call, "probe.denormal"),
    (rs.onednn_off_at_import, "torch.backends.mkldnn.enabled"),
    (rs.onednn_off_in_call, "torch.backends.mkldnn.enabled"),
    (rs.inductor_config_at_import, "torch._inductor.config.max_autotune"),
    (rs.dynamo_config_in_call, "torch._dynamo.config."),
], ids=["denormal-import", "denormal-call", "onednn-import", "onednn-call", "inductor-config", "dynamo-config"])
def test_getter_less_and_backend_state_is_rejected(ln, monkeypatch, make, key):
    if key == "probe.denormal" and not torch.set_flush_denormal(False):
        pytest.skip("this CPU cannot flush denormals (no SSE3)")
    verdict = _rejected(ln, monkeypatch, make, "global_state", make.__name__)
    assert key in " ".join(verdict.reasons)


@pytest.mark.parametrize("make, key", [
    (lambda src: rs.sys_path_at_import(src, "/tmp/tilesmith-sidefx-helpers"), "sys.path"),
    (rs.meta_path_in_call, "sys.meta_path"),
    (rs.path_hooks_at_import, "sys.path_hooks"),
], ids=["sys.path", "meta_path", "path_hooks"])
def test_import_system_change_is_rejected(ln, monkeypatch, make, key):
    verdict = _rejected(ln, monkeypatch, make, "global_state", key)
    assert key in " ".join(verdict.reasons)


@pytest.mark.parametrize("make, where", [
    (rs.hoard_tensor_at_import, "after its import"),
    (rs.hoard_bytes_at_import, "after its import"),
    (rs.leak_every_call, "after its correctness calls"),
], ids=["tensor-at-import", "bytes-at-import", "leak-per-call"])
def test_memory_growth_beyond_the_originals_bound_is_rejected(ln, monkeypatch, make, where):
    verdict = _rejected(ln, monkeypatch, make, "memory_growth", make.__name__)
    assert where in " ".join(verdict.reasons)


def test_growth_bound_scales_with_the_originals_bytes():
    from tilesmith.gate.host.memory import GROWTH_SLACK_BYTES, MemoryPlan, growth_bound, growth_failure

    small = MemoryPlan("cpu", free=0, total=0, input_bytes=1 << 20, output_bytes=1 << 20, call_peak_bytes=0)
    large = MemoryPlan("cuda:0", free=0, total=0, input_bytes=1 << 30, output_bytes=1 << 30, call_peak_bytes=1 << 30)
    assert growth_bound(small) == GROWTH_SLACK_BYTES + 2 * (2 << 20)
    assert growth_bound(large) > 6 << 30
    assert growth_failure({"allocated": 0}, {"allocated": 1 << 30}, small, "after its import").check == "memory_growth"
    assert growth_failure({"allocated": 0}, {"allocated": 1 << 30}, large, "after its import") is None
    assert growth_failure({"allocated": 0}, {"allocated": 1 << 30}, small, "x", retained=1 << 30) is None
    assert growth_failure(None, {"allocated": 1 << 40}, small, "x") is None  # unknown: no verdict


def test_what_the_original_itself_changes_is_not_the_candidates_fault(tmp_path, monkeypatch):
    """The trusted worker reports what loading and warming up the original changed (on CUDA: Triton's and
    Inductor's lazy runtime state); candidate workers leave exactly those names out, and nothing else."""
    from tilesmith.gate import Gate

    monkeypatch.setenv("TILESMITH_ALLOW_CPU", "1")
    monkeypatch.setenv("TILESMITH_GATE_RUN_TIMEOUT_S", "60")
    torch.manual_seed(0)
    cap = gs.capture(gs.LinearLN(), torch.randn(32, 64))[0]
    lines = cap.graph.canonical_source.splitlines()
    at = max(i for i, line in enumerate(lines) if line.startswith(("import ", "from "))) + 1
    rebinding = ["import torch._inductor.codecache as _own_cc", "_own_cc.LOCK_TIMEOUT = _own_cc.LOCK_TIMEOUT + 1"]
    original = "\n".join(lines[:at] + rebinding + lines[at:]) + "\n"
    gate = Gate(gs.make_problem(cap, tmp_path / "snapshot", label="51de0fx1 (ln)", source=original),
                reference=cap.ref_fn, profiles_dir=tmp_path / "profiles", timing_pairs=6)
    try:
        assert "torch._inductor.codecache.LOCK_TIMEOUT" in gate.original_effects
        gs.runtime_checks_only(monkeypatch)
        same = gate.evaluate(Candidate(source=original, proposer="control"))
        assert same.failures == (), same.reasons
        patched = gate.evaluate(Candidate(source=rs.extern_kernel_through_vars(original), proposer="redteam"))
        assert "monkeypatch" in [f.check for f in patched.failures], patched.reasons
        assert "extern_kernels.addmm" in " ".join(patched.reasons)
    finally:
        gate.close()
