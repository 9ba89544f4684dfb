"""Imports restricted to the original's plus an allow-list (issue 15, "Gate, structurally"): the worker's import
guard (tilesmith/gate/worker/imports.py) records what the original imports in the trusted worker and refuses any
other import requested by candidate code (docs/gate.md, "Imports"). Gate-level tests switch the static scan off, so
the worker's guard alone must reject each candidate of tests/cheats/redteam_imports.py.
"""

from __future__ import annotations

import builtins

import pytest
import torch

from tests import gate_support as gs
from tests.cheats import redteam_imports as ri
from tilesmith.gate.host.answers import ALLOW_TEXT, failures_from_answer
from tilesmith.gate.host.phase import status_for
from tilesmith.gate.worker import imports
from tilesmith.records import Candidate, CheckFailure


# -- unit: grants and decisions -----------------------------------------------------------------------------------
def test_names_imported_from_a_module_do_not_grant_the_module():
    guard = imports.ImportGuard()
    guard.grant({"modules": ["torch", "os", "triton.language"], "names": [["ctypes", "c_void_p"]], "bound": []})
    assert guard.module_ok("os") and guard.module_ok("triton") and guard.module_ok("triton.language")
    assert guard.module_ok("torch._inductor.runtime.triton_helpers")  # allow-list
    assert not guard.module_ok("ctypes") and not guard.module_ok("os.path") and not guard.module_ok("socket")
    assert guard._may_enter("ctypes", ["c_void_p"]) and not guard._may_enter("ctypes", ["CDLL"])
    assert guard._may_enter("tilesmith.kernels.runtime", ["native_module"])
    assert not guard._may_enter("tilesmith.kernels.runtime", ["kernel_dir"])
    assert not guard._may_enter("importlib", []) and not guard._may_enter("sys", [])


def test_refusals_become_an_import_failure_ranked_before_the_load_error():
    answer = {"ok": False, "facts": {"imports_refused": ["socket (import at line 3)"]},
              "steps": [{"imports_refused": ["socket (import at line 3)"]}]}
    fails = failures_from_answer(answer, "importing the candidate")
    assert [f.check for f in fails] == ["import_not_allowed"]
    assert "socket" in fails[0].message and "allow-list" in fails[0].message
    assert status_for(fails + [CheckFailure("load_error", "ImportError")]) == "rejected_global_state"


def test_the_remedy_quotes_the_workers_allow_list():
    quoted = ALLOW_TEXT.replace("`", "")
    for rule in imports.ALLOWED:
        assert rule in quoted.split(", "), rule
    for module, name in imports.ALLOWED_NAMES:
        assert f"from {module} import {name}" in quoted


# -- gate level -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ln(tmp_path_factory):
    yield from gs.linear_ln_gate(tmp_path_factory.mktemp("imports"), "1e0a4f00 (ln)")


def test_the_trusted_worker_reports_what_the_original_imports(ln):
    gate, _, _ = ln
    granted = gate.original_imports
    assert "torch" in granted["modules"] and "tempfile" in granted["modules"]
    assert ["ctypes", "c_void_p"] in granted["names"] and "ctypes" not in granted["modules"]
    assert "socket" not in granted["modules"] and "importlib" not in granted["modules"]
    assert builtins.__import__ is __import__  # the guard lives in the workers only


@pytest.mark.parametrize("make, module", [
    (ri.importlib_import_module, "importlib"),
    (ri.dunder_import_in_call, "ctypes"),
    (ri.module_from_sys_modules, "sys"),
    (ri.sys_modules_through_attribute, "socket"),
    (ri.importlib_reached_as_attribute_in_call, "xmlrpc"),
], ids=["importlib.import_module", "__import__-in-call", "from-torch-import-sys", "sys.modules-global",
        "importlib-attribute-finder"])
def test_an_import_the_original_does_not_make_is_rejected(ln, monkeypatch, make, module):
    gs.runtime_checks_only(monkeypatch)
    gate, cap, _ = ln
    verdict = gate.evaluate(Candidate(source=make(cap.source), proposer=f"redteam:{make.__name__}"))
    assert "import_not_allowed" in [f.check for f in verdict.failures], verdict.reasons
    assert verdict.status == "rejected_global_state", verdict.reasons
    message = " ".join(f.message for f in verdict.failures if f.check == "import_not_allowed")
    assert module in message and "allow-list" in message, message


def test_the_original_as_a_candidate_passes_the_guard(ln):
    gate, cap, _ = ln
    verdict = gate.evaluate(Candidate(source=cap.source, proposer="control"))
    assert "import_not_allowed" not in [f.check for f in verdict.failures], verdict.reasons
    assert verdict.status != "rejected_global_state", verdict.reasons
