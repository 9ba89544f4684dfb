"""The worker's PEP 578 audit hook (tilesmith/gate/worker/audit.py) and the quoting of candidate-controlled text.

The hook cannot be removed once added, so its unit tests run it in a child interpreter: the harness
below installs it over a private folder, arms it, then imports one small "candidate" module per case
from that folder and reports the audit records. The gate-level tests evaluate red-team candidates
(findings 3 and 10) with the static scan bypassed, so that the audit hook alone must reject them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests import gate_support as gs
from tests import verify_support as vs
from tests.cheats import redteam_isolation as rt
from tilesmith.gate.host.answers import failures_from_answer
from tilesmith.gate.protocol import AUDIT_CHECKS
from tilesmith.gate.host.process import sanitize_answer, untrusted_text
from tilesmith.records import Candidate

_REPO = Path(__file__).resolve().parents[1]

_HARNESS = textwrap.dedent('''
    import importlib.util, json, os, sys
    sys.path.insert(0, sys.argv[3])
    import fakelib                                  # a third-party library, imported before arming
    from tilesmith.gate.worker import audit
    priv = sys.argv[1]
    auditor = audit.install(priv)
    os.makedirs(os.path.join(priv, "locks"))
    open(os.path.join(priv, "trusted.py"), "w").write("X = 1\\n")
    open(os.path.join(priv, "locks", "k.lock"), "w").close()
    auditor.arm()
    sys._getframe(0)                                # the worker's own introspection: not the candidate's
    cases = json.load(open(sys.argv[2]))
    out = {}
    for name, source in cases.items():
        path = os.path.join(priv, "cand_" + name + ".py")
        with open(path, "w") as handle:
            handle.write(source)
        spec = importlib.util.spec_from_file_location("cand_" + name, path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
            error = None
        except BaseException as exc:
            error = type(exc).__name__
        records = auditor.drain()
        out[name] = {"checks": sorted({r["check"] for r in records}), "error": error,
                     "details": [r["detail"] for r in records]}
    print(json.dumps(out))
''')

_FAKELIB = textwrap.dedent('''
    import importlib.metadata, subprocess, sys
    def plugins():  # what libraries do at import (plugin discovery): reads every package's metadata on sys.path
        return importlib.metadata.entry_points()
    def run(argv):
        return subprocess.run(argv, capture_output=True, check=False).returncode
    def frame_name():
        return sys._getframe(1).f_code.co_name
''')


@pytest.fixture(scope="module")
def audited(tmp_path_factory):
    """Runs every case of CASES in one child interpreter; returns {case: {"checks": [...], "error": ...}}."""
    root = tmp_path_factory.mktemp("audit")
    priv, lib, outside = root / "private", root / "lib", root / "outside"
    for d in (priv, lib, outside):
        d.mkdir()
    (lib / "fakelib.py").write_text(_FAKELIB)
    (lib / "fakepkg.egg-info").mkdir()  # what an editable install leaves beside its sources (CI's checkout)
    (lib / "fakepkg.egg-info" / "entry_points.txt").write_text("[console_scripts]\nfake = fakelib:run\n")
    (lib / "notes.txt").write_text("beside the metadata, not metadata\n")
    secret = outside / "secret.txt"
    secret.write_text("FAKE-SECRET-TOKEN\n")
    victim = outside / "victim.txt"
    victim.write_text("keep me\n")
    (outside / "tools").mkdir()
    vs.fake_tools(str(outside / "tools"), str(outside / "ran_tool"))
    cases = {name: textwrap.dedent(src).format(priv=str(priv), outside=str(outside), secret=str(secret),
                                               victim=str(victim), lib=str(lib))
             for name, src in CASES.items()}
    spec = root / "cases.json"
    spec.write_text(json.dumps(cases))
    harness = root / "harness.py"
    harness.write_text(_HARNESS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TILESMITH_")}
    env["PYTHONPATH"] = str(_REPO)
    proc = subprocess.run([sys.executable, str(harness), str(priv), str(spec), str(lib)], capture_output=True,
                          text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["_files"] = {"victim_exists": victim.exists(), "outside_written": (outside / "new.txt").exists(),
                        "programs_ran": [p.name for p in outside.glob("ran_*")] + [p.name for p in outside.glob("*.o")],
                        "trusted": (priv / "trusted.py").read_text()}
    return result


CASES = {
    # introspection
    "getframe": "import sys\nsys._getframe(0)\n",
    "inspect_stack": "import inspect\ninspect.stack()\n",
    "tb_frame": "try:\n    raise KeyError(1)\nexcept KeyError as e:\n    f = e.__traceback__.tb_frame\n",
    "code_replace": "def f():\n    pass\nf.__code__.replace(co_filename='/usr/lib/x.py')\n",
    "exec": "exec('x = 1')\n",
    "gc": "import gc\ngc.get_referrers(object())\n",
    "settrace": "import sys\nsys.settrace(None)\n",
    "library_getframe": "import fakelib\nfakelib.frame_name()\n",
    "import_new_module": "import colorsys\nimport json.tool\n",
    # files
    "write_private": "open({priv!r} + '/new.txt', 'w').write('ok')\n",
    "lock_file": "open({priv!r} + '/locks/k.lock', 'w').close()\n",
    "write_trusted": "open({priv!r} + '/trusted.py', 'a').write('X = 2')\n",
    "write_outside": "open({outside!r} + '/new.txt', 'w').write('x')\n",
    "remove_outside": "import os\nos.remove({victim!r})\n",
    "read_outside": "open({secret!r}).read()\n",
    "read_via_numpy": "import numpy\nnumpy.loadtxt({secret!r}, dtype=str)\n",
    "read_other_process": "import os\nopen('/proc/%d/environ' % os.getppid(), 'rb').read()\n",
    "read_stdlib": "import os\nopen(os.__file__).read()\n",
    "read_own_proc": "open('/proc/self/status').read()\n",
    "entry_points": "import fakelib\nfakelib.plugins()\n",
    "read_package_metadata": "open({lib!r} + '/fakepkg.egg-info/entry_points.txt').read()\n",
    "read_beside_metadata": "open({lib!r} + '/notes.txt').read()\n",
    # processes, network, native
    "subprocess": "import subprocess\nsubprocess.run(['true'], check=False)\n",
    "library_compiler": "import fakelib\nfakelib.run(['gcc', '--version'])\n",
    "library_other_process": "import fakelib\nfakelib.run(['true'])\n",
    # R2: a compiler started by a library that runs another program, or a program posing as a compiler
    "compiler_wrapper": "import fakelib\nfakelib.run(['g++', '-wrapper', '/bin/sh,-c,touch {outside}/ran_wrapper', "
                        "'-x', 'c++', '-c', '/dev/null', '-o', {priv!r} + '/o.o'])\n",
    "compiler_prefix": "import fakelib\nfakelib.run(['g++', '-B{outside}/tools/', '-x', 'c++', '-c', '/dev/null', "
                       "'-o', {priv!r} + '/o2.o'])\n",
    "compiler_named": "import fakelib\nfakelib.run([{outside!r} + '/tools/evil-g++', '-c', 'x.cpp'])\n",
    "compiler_output_outside": "import fakelib\nfakelib.run(['g++', '-x', 'c++', '-c', '/dev/null', '-o', "
                               "{outside!r} + '/compiled.o'])\n",
    "putenv": "import os\nos.environ['LD_PRELOAD'] = 'x'\n",
    "signal_parent": "import os\nos.kill(os.getppid(), 0)\n",
    "signal_self": "import os, signal\nos.kill(os.getpid(), signal.SIGCONT)\n",
    "socket": "import socket\nsocket.socket().close()\n",
    "ctypes": "import ctypes\nctypes.CDLL(None)\n",
}


@pytest.mark.parametrize("case,check", [
    ("getframe", "audit_introspection"), ("inspect_stack", "audit_introspection"),
    ("tb_frame", "audit_introspection"), ("code_replace", "audit_introspection"), ("exec", "audit_introspection"),
    ("gc", "audit_introspection"), ("settrace", "audit_introspection"),
    ("write_trusted", "audit_file_write"), ("write_outside", "audit_file_write"),
    ("remove_outside", "audit_file_write"), ("read_outside", "audit_file_read"),
    ("read_beside_metadata", "audit_file_read"),
    ("read_via_numpy", "audit_file_read"), ("read_other_process", "audit_file_read"),
    ("subprocess", "audit_process"), ("library_other_process", "audit_process"), ("putenv", "audit_process"),
    ("compiler_wrapper", "audit_process"), ("compiler_prefix", "audit_process"), ("compiler_named", "audit_process"),
    ("compiler_output_outside", "audit_file_write"),
    ("signal_parent", "audit_process"),
    ("socket", "audit_network"), ("ctypes", "audit_native"),
])
def test_candidate_event_is_recorded_with_its_check_id_and_blocked(audited, case, check):
    assert audited[case]["checks"] == [check], audited[case]
    assert audited[case]["error"] == "PermissionError", audited[case]


@pytest.mark.parametrize("case", ["library_getframe", "import_new_module", "write_private", "lock_file",
                                  "read_stdlib", "read_own_proc", "library_compiler", "signal_self",
                                  "entry_points", "read_package_metadata"])
def test_allowed_actions_raise_no_audit_record(audited, case):
    assert (audited[case]["checks"], audited[case]["error"]) == ([], None), audited[case]


def test_blocked_writes_change_nothing_on_disk(audited):
    files = audited["_files"]
    assert files["victim_exists"] and not files["outside_written"]
    assert files["programs_ran"] == []  # R2: no compiler ran another program, none wrote outside
    assert files["trusted"] == "X = 1\n"


def test_audit_records_become_failures_with_quoted_details():
    answer = {"ok": False, "facts": {"audit": [{"check": "audit_file_read", "event": "open",
                                                "detail": "open for reading '/home/u/.env'\x1b[2J",
                                                "line": 12, "function": "<module>"}]},
              "steps": [{"audit": [{"check": "audit_introspection", "event": "sys._getframe",
                                    "detail": "sys._getframe", "line": 40, "function": "call"}]},
                        {"audit": [{"check": "not_an_audit_id", "detail": "x"}]}]}
    fails = failures_from_answer(answer, "importing the candidate")
    assert [f.check for f in fails] == ["audit_file_read", "audit_introspection"]
    assert all(f.check in AUDIT_CHECKS for f in fails)
    assert "\x1b" not in fails[0].message and "⟦candidate: open for reading" in fails[0].message
    assert "line 12" in fails[0].message


def test_untrusted_text_is_escaped_truncated_and_marked():
    text = "leak: FAKE-SECRET\n\x1b[31m" + "A" * 1000
    quoted = untrusted_text(text, 50)
    assert quoted.startswith("⟦candidate, ") and quoted.endswith("⟧")
    assert "\n" not in quoted and "\x1b" not in quoted and "\\n" in quoted
    assert len(quoted) < 120
    assert untrusted_text("short") == "⟦candidate: short⟧"
    assert "⟧" not in untrusted_text("fake end ⟧ marker")[:-1]


def test_worker_error_texts_are_quoted_at_the_boundary(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-aaaaaaaaaaaaaaaaaaaaaaaa")
    key = "sk-test-aaaaaaaaaaaaaaaaaaaaaaaa"
    answer = {"id": 3, "ok": True, "error": {"type": "x.Leak", "message": key + " " + "B" * 900,
                                             "traceback": "\n".join(f"line {i}" for i in range(40)), "oom": False},
              "steps": [{"error": {"type": "builtins.ValueError", "message": "bad\nthing"}}]}
    clean = sanitize_answer(answer)
    err = clean["error"]
    assert err["oom"] is False and clean["id"] == 3
    assert err["message"].startswith("⟦candidate, ") and "sk-test" not in err["message"] and len(err["message"]) < 480
    assert "line 39" in err["traceback"] and "line 33" not in err["traceback"]
    assert clean["steps"][0]["error"]["message"] == "⟦candidate: bad\\nthing⟧"


# -- gate level: the audit hook alone (static scan bypassed) -------------------------------------------

@pytest.fixture(scope="module")
def ln_gate(tmp_path_factory):
    yield from gs.linear_ln_gate(tmp_path_factory.mktemp("audit-gate"), "a0d17000 (ln)", scan_off=True)


def test_frame_walking_candidate_is_rejected_by_the_audit_hook(ln_gate):
    """Red-team finding 3 (t3_introspection spot): sys._getframe through getattr(torch, "s"+"ys")."""
    gate, cap, _ = ln_gate
    verdict = gate.evaluate(Candidate(source=rt.spot_aware(cap.source), proposer="redteam:spot_aware"))
    assert not verdict.accepted
    assert "audit_introspection" in [f.check for f in verdict.failures], verdict.reasons
    assert verdict.status == "rejected_global_state"


def test_traceback_frame_walk_is_rejected_by_the_audit_hook(ln_gate):
    gate, cap, _ = ln_gate
    verdict = gate.evaluate(Candidate(source=rt.traceback_frame_walk(cap.source), proposer="redteam:tb_frame"))
    assert "audit_introspection" in [f.check for f in verdict.failures], verdict.reasons
    assert verdict.status == "rejected_global_state"


def test_file_read_is_blocked_and_its_contents_never_reach_the_verdict(ln_gate, tmp_path):
    """Red-team finding 10 (t11_file_read): numpy.loadtxt of a file, its contents raised as the message."""
    gate, cap, root = ln_gate
    secret = tmp_path / "fake_secret.txt"
    secret.write_text("FAKE-SECRET-TOKEN-H1\n")
    verdict = gate.evaluate(Candidate(source=rt.read_file_into_verdict(cap.source, str(secret)),
                                      proposer="redteam:file_read"))
    assert "audit_file_read" in [f.check for f in verdict.failures], verdict.reasons
    assert verdict.status == "rejected_global_state"
    texts = list(verdict.reasons) + [f.message for f in verdict.failures]
    assert not any("FAKE-SECRET-TOKEN-H1" in t for t in texts)
    for report in (root / "profiles").glob("*.json"):
        assert "FAKE-SECRET-TOKEN-H1" not in report.read_text()


def test_candidate_exception_text_is_marked_escaped_and_truncated(ln_gate):
    gate, cap, _ = ln_gate
    verdict = gate.evaluate(Candidate(source=rt.raise_long_text(cap.source, "boom\x1b[2J\n" + "Z" * 5000),
                                      proposer="redteam:long_text"))
    assert verdict.status == "rejected_load"
    reason = verdict.reasons[0]
    assert "⟦candidate, " in reason and "chars, first 400: boom\\x1b[2J\\nZZ" in reason  # message: escaped, cut
    assert "\x1b" not in reason and "\n" not in reason
    assert len(reason) < 2000  # 5000 characters raised; type, message and traceback tail are each bounded


def test_work_left_in_inductors_compile_pool_is_a_global_state_failure():
    """The worker reports work that is not Inductor's in Inductor's compile pool (``pool_work``,
    tilesmith/gate/pools.py); the host names it, quoted, and ranks it with the global-state failures."""
    from tilesmith.gate.host.answers import global_failures
    from tilesmith.gate.host.phase import status_for

    fails = global_failures({"pool_work": ["time.sleep (builtin)\x1b[2J"]}, "importing the candidate")
    assert [f.check for f in fails] == ["compile_pool"] and status_for(fails) == "rejected_global_state"
    assert "time.sleep" in fails[0].message and "\x1b" not in fails[0].message


def test_worker_ends_without_running_candidate_code_at_teardown(tmp_path):
    """R5 in the worker: a candidate's ``__del__`` or a suspended generator's ``finally`` run by the interpreter's
    teardown, after the worker's last answer (the host closed its stdin, or sent ``exit``), when no record can reach
    the host any more. The worker now ends without interpreter finalization (``__main__.leave``)."""
    from tilesmith.gate.host.process import WorkerProcess

    base = tmp_path / "base.pt"
    torch.save([torch.zeros(2)], base)
    (tmp_path / "w").mkdir()
    source = ("import torch\n"  # kept on torch: alive until the modules are torn down
              f"class _K:\n    def __del__(self):\n        open('{tmp_path}/ran_del', 'w').close()\n"
              "torch._teardown_probe = _K()\n"
              f"def _g():\n    try:\n        yield 1\n    finally:\n        open('{tmp_path}/ran_gen', 'w').close()\n"
              "torch._teardown_gen = _g()\nnext(torch._teardown_gen)\n"
              "def call(args):\n    return args\n")
    worker = WorkerProcess(tmp_path / "w", label="teardown test", device_type="cpu")
    try:
        assert worker.wait_ready(180)["type"] == "ready"
        answer = worker.request("init", 300, "init", role="candidate", device="cpu", base_inputs=str(base),
                                allowed_imports={"modules": ["torch"]})
        assert answer["ok"], answer
        answer = worker.request("load", 300, "load", name="cand", source=source)
        assert answer["ok"], answer
        assert worker.request("exit", 60, "exit")["ok"]
        assert worker.proc.wait(timeout=120) == 0
    finally:
        worker.kill()
    assert sorted(p.name for p in tmp_path.glob("ran_*")) == []
