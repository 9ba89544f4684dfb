"""Static scan: accepts every real Inductor wrapper, rejects each cheating construct with its rule id."""

from __future__ import annotations

from pathlib import Path

import pytest

from tilesmith.gate.static_scan import RULE_RATIONALE, findings_to_failures, scan

FIXTURES = sorted((Path(__file__).parent / "fixtures" / "inductor-h200").glob("*.wrapper.py"))
HEAD = "import torch\nimport os\nimport time\nfrom ctypes import c_void_p, c_long, c_int\n"


def rules(source: str) -> set[str]:
    return {f.rule for f in scan(source)}


def body(*lines: str) -> str:
    return HEAD + "def call(args):\n" + "".join(f"    {line}\n" for line in lines)


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.name.split(".")[0])
def test_real_inductor_cuda_wrappers_pass(path):
    assert scan(path.read_text()) == []


def test_fixtures_are_present():
    assert len(FIXTURES) >= 10


def test_real_cpu_wrapper_passes():
    torch = pytest.importorskip("torch")
    from tests import gate_support as gs

    cap = gs.capture(gs.LinearLN(), torch.randn(32, 64))[0]
    assert scan(cap.source) == []


@pytest.mark.parametrize("snippet, rule", [
    ("import threading", "static_concurrency"),
    ("from concurrent.futures import ThreadPoolExecutor", "static_concurrency"),
    ("import subprocess", "static_concurrency"),
    ("t = torch.cuda.threading.Thread(target=print)", "static_concurrency"),
    ("import ctypes", "static_native_memory"),
    ("from ctypes import CDLL", "static_native_memory"),
    ("import gc", "static_introspection"),
    ("import sys", "static_introspection"),
    ("m = torch.sys.modules", "static_introspection"),
    ("f = call.__globals__", "static_introspection"),
    ("exec('x = 1')", "static_introspection"),
    ("import tilesmith.gate.worker_core", "static_introspection"),
    ("open('/etc/passwd').read()", "static_file_access"),
    ("os.listdir('/')", "static_file_access"),
    ("k = os.environ['OPENAI_API_KEY']", "static_file_access"),
    ("torch.load('cache.pt')", "static_file_access"),
    ("import socket", "static_network"),
    ("os.kill(os.getpid(), 9)", "static_process_control"),
    ("os._exit(0)", "static_process_control"),
    ("time.perf_counter = lambda: 0.0", "static_monkeypatch"),
    ("torch.cuda.Event.elapsed_time = lambda a, b: 0.0", "static_monkeypatch"),
    ("setattr(torch, 'mm', None)", "static_monkeypatch"),
    ("torch.backends.cuda.matmul.allow_tf32 = True", "static_global_state"),
    ("torch.set_float32_matmul_precision('high')", "static_global_state"),
    ("torch.manual_seed(0)", "static_global_state"),
    ("torch.cuda.memory._set_allocator_settings('expandable_segments:True')", "static_global_state"),
    ("torch.cuda.set_stream(torch.cuda.Stream())", "static_global_state"),
])
def test_forbidden_construct_is_reported_with_its_rule(snippet, rule):
    assert rule in rules(body(snippet))


def test_broad_exception_handlers_are_rejected_but_specific_ones_pass():
    assert "static_try_except" in rules(body("try:", "    pass", "except Exception:", "    pass"))
    assert "static_try_except" in rules(body("try:", "    pass", "except:", "    pass"))
    assert "static_try_except" in rules(body("try:", "    pass", "except (ValueError, RuntimeError):", "    pass"))
    assert rules(body("try:", "    pass", "except KeyError:", "    pass")) == set()


def test_python_hidden_in_a_triton_kernel_string_is_scanned():
    src = body("pass") + ("k = async_compile.triton('k', '''\nimport triton\nimport threading\n"
                          "@triton.jit\ndef k(x):\n    pass\n''', device_str='cuda')\n")
    found = scan(src)
    assert "static_concurrency" in {f.rule for f in found}
    assert any(f.line > 5 for f in found)


def test_native_source_strings_are_scanned_but_openmp_is_fine():
    ok = "cpp_fused = async_compile.cpp_pybinding(['float*'], r'''\n#pragma omp parallel num_threads(2)\n" \
         "extern \"C\" void kernel(float* x) { x[0] = 1; }\n''')\n"
    bad = "cpp_fused = async_compile.cpp_pybinding(['float*'], r'''\n#include <thread>\n" \
          "extern \"C\" void kernel(float* x) { std::thread t([]{}); t.detach(); }\n''')\n"
    assert rules(body("pass") + ok) == set()
    assert "static_concurrency" in rules(body("pass") + bad)


def test_allowed_wrapper_idioms_pass():
    assert rules(body("async_compile.wait(globals())", "p = os.path.join('a', 'b')",
                      "torch.cuda.set_device(0)", "with torch.cuda.stream(torch.cuda.Stream()):", "    pass")) == set()


def test_missing_entry_point_and_syntax_errors():
    assert rules("import torch\n") == {"static_entry_point"}
    assert rules("def call(args):\n    return (\n") == {"static_syntax"}
    runner = "class Runner:\n    def call(self, args):\n        pass\nrunner = Runner()\ncall = runner.call\n"
    assert rules(runner) == set()


def test_failures_carry_line_and_reason():
    [failure] = findings_to_failures(scan(body("import gc")))
    assert failure.check == "static_introspection"
    assert failure.message.startswith("line 6:") and RULE_RATIONALE["static_introspection"] in failure.message


def test_cuda_cheats_and_faults_get_past_the_scan_so_runtime_checks_must_catch_them():
    from tests.cheats.gpu import GPU_CHEATS, GPU_FAULTS, deferred_side_work

    src = next(p for p in FIXTURES if p.name.startswith("softmax_bias")).read_text()
    for cheat in [*GPU_CHEATS, *GPU_FAULTS]:
        edited = cheat.make(src)
        assert edited != src
        assert scan(edited) == [], cheat.name
    assert scan(deferred_side_work(src)) == []


def test_hidden_cpu_cheats_get_past_the_scan_and_plain_ones_do_not():
    torch = pytest.importorskip("torch")
    from tests import gate_support as gs
    from tests.cheats.cpu import CHEATS

    cap = gs.capture(gs.LinearLN(), torch.randn(32, 64))[0]
    train = [c for c in gs.capture(gs.LinearLN(), torch.randn(32, 64, requires_grad=True), grad=True)
             if c.graph.kind == "forward"][0]
    for cheat in CHEATS:
        found = rules(cheat.make((train if cheat.graph == "train" else cap).source))
        if cheat.status == "rejected_static":
            assert cheat.check in found, cheat.name
        else:
            assert found == set(), (cheat.name, found)
