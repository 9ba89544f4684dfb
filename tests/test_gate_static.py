"""Static scan: accepts every real Inductor wrapper, rejects each cheating construct with its rule id."""

from __future__ import annotations

from pathlib import Path

import pytest

from tilesmith.gate.host.static_scan import RULE_RATIONALE, findings_to_failures, scan

FIXTURES = sorted((Path(__file__).parent / "fixtures" / "inductor-h200").glob("*.wrapper.py"))
CPU_FIXTURES = sorted((Path(__file__).parent / "fixtures" / "wrappers").glob("*.py"))
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


@pytest.mark.parametrize("path", CPU_FIXTURES, ids=lambda p: p.stem)
def test_stored_cpu_inductor_wrappers_pass(path):
    assert scan(path.read_text()) == []


def _cpu_models():
    import torch

    from tests import gate_support as gs
    from tests.models import MulSum

    return {"linear_ln": (gs.LinearLN(), (torch.randn(32, 64),), False),
            "linear_ln_train": (gs.LinearLN(), (torch.randn(32, 64, requires_grad=True),), True),
            "log_scale": (gs.LogScale(), (torch.rand(32, 64) + 0.5,), False),
            "embed": (gs.Embed(), (torch.randint(0, 50, (8, 16)), torch.tensor(2.0)), False),
            "mul_sum": (MulSum(), (torch.randn(64, 512),), False)}


@pytest.mark.parametrize("name", ["linear_ln", "linear_ln_train", "log_scale", "embed", "mul_sum"])
def test_real_cpu_wrappers_pass(name):
    pytest.importorskip("torch")
    from tests import gate_support as gs

    model, args, grad = _cpu_models()[name]
    caps = gs.capture(model, *args, grad=grad)
    assert caps
    for cap in caps:
        assert scan(cap.source) == [], (cap.graph.kind, [(f.rule, f.detail) for f in scan(cap.source)])


def test_builtin_agent_candidates_pass():
    from tilesmith.agent.builtin import cleanup, launch_config
    from tilesmith.agent.builtin.base import Skip
    from tilesmith.agent.builtin.cudagraph import cudagraph_source
    from tilesmith.agent.builtin.wrapper_text import triton_kernels

    from tilesmith.capture.source import canonicalize

    made = 0
    for path in FIXTURES:
        src = canonicalize(path.read_text(), ("/tmp/torchinductor_root",))
        builders = [cudagraph_source, lambda s: cleanup.cleanup_source(s)[0],
                    lambda s: launch_config.search_source(s, launch_config.plan_search(s)[0]),
                    lambda s: launch_config.pin_source(s, {triton_kernels(s)[0].var: {"XBLOCK": 512, "num_warps": 4,
                                                                                      "num_stages": 1}})]
        for build in builders:
            try:
                out = build(src)
            except (Skip, IndexError):  # a generator that does not apply to this wrapper
                continue
            made += 1
            assert scan(out) == [], (path.name, [(f.rule, f.detail) for f in scan(out)])
    assert made >= 3 * len(FIXTURES)


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
    ("import tilesmith.gate.worker.core", "static_introspection"),
    ("open('/etc/passwd').read()", "static_file_access"),
    ("os.listdir('/')", "static_file_access"),
    ("k = os.environ['OPENAI_API_KEY']", "static_file_access"),
    ("k = os.getenv('OPENAI_API_KEY')", "static_file_access"),
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


# Cheats and faults of the runtime suites that the hardened scan now also rejects (they hid their names with
# getattr/vars and concatenated strings, the red team's bypass); their suites evaluate them with the scan
# switched off (tests.gate_support.runtime_checks_only) so every runtime check keeps its regression test.
OBFUSCATED_NOW_STATIC = {
    "tf32_flip_hidden": "static_global_state", "rng_reseed_hidden": "static_global_state",
    "background_thread_hidden": "static_concurrency", "timer_patch_hidden": "static_dynamic_access",
    "harness_patch": "static_introspection", "baseline_sabotage": "static_introspection",
    "tf32_flip_hidden_cuda": "static_global_state", "event_timer_patch_hidden": "static_dynamic_access",
    "segfault": "static_process_control", "os_exit": "static_process_control",
    "native_thread_at_first_call": "static_concurrency",
}
#: Runtime-check cheats whose plain spelling the scan refuses (their tests run with the scan off).
PLAIN_NOW_STATIC = {"native_thread_at_import": "static_concurrency"}


def test_cuda_cheats_and_faults_get_past_the_scan_unless_they_hide_names():
    from tests.cheats.gpu import GPU_CHEATS, GPU_FAULTS, deferred_side_work

    src = next(p for p in FIXTURES if p.name.startswith("softmax_bias")).read_text()
    for cheat in [*GPU_CHEATS, *GPU_FAULTS]:
        edited = cheat.make(src)
        assert edited != src
        found = rules(edited)
        if cheat.name in OBFUSCATED_NOW_STATIC:
            assert {OBFUSCATED_NOW_STATIC[cheat.name], "static_dynamic_access"} <= found, cheat.name
        else:
            assert found == set(), (cheat.name, found)
    assert scan(deferred_side_work(src)) == []


def test_hidden_cpu_cheats_get_past_the_scan_unless_they_hide_names_and_plain_ones_do_not():
    torch = pytest.importorskip("torch")
    from tests import gate_support as gs
    from tests.cheats.cpu import CHEATS
    from tests.cheats.faults import FAULTS

    cap = gs.capture(gs.LinearLN(), torch.randn(32, 64))[0]
    train = [c for c in gs.capture(gs.LinearLN(), torch.randn(32, 64, requires_grad=True), grad=True)
             if c.graph.kind == "forward"][0]
    for cheat in CHEATS:
        found = rules(cheat.make((train if cheat.graph == "train" else cap).source))
        if cheat.status == "rejected_static":
            assert cheat.check in found, cheat.name
        elif cheat.name in OBFUSCATED_NOW_STATIC:
            assert {OBFUSCATED_NOW_STATIC[cheat.name], "static_dynamic_access"} <= found, (cheat.name, found)
        elif cheat.name in PLAIN_NOW_STATIC:
            assert PLAIN_NOW_STATIC[cheat.name] in found, (cheat.name, found)
        else:
            assert found == set(), (cheat.name, found)
    for fault in FAULTS:
        found = rules(fault.make(cap.source))
        expected = {OBFUSCATED_NOW_STATIC[fault.name], "static_dynamic_access"} if fault.name in \
            OBFUSCATED_NOW_STATIC else set()
        assert expected <= found and (found == set()) == (not expected), (fault.name, found)


# -- red-team finding 10: every bypass is now reported with its check id ---------------------------------
def _redteam():
    from tests.cheats import redteam_static

    return redteam_static


@pytest.fixture(scope="module")
def cpu_wrapper():
    torch = pytest.importorskip("torch")
    from tests import gate_support as gs

    return gs.capture(gs.LinearLN(), torch.randn(32, 64))[0].source


@pytest.mark.parametrize("where", ["module", "call"])
@pytest.mark.parametrize("name", sorted(_redteam().BYPASSES))
def test_red_team_bypass_is_reported_with_its_check_id(name, where, cpu_wrapper):
    rt = _redteam()
    code, rule = rt.BYPASSES[name]
    edited = (rt.with_module_code if where == "module" else rt.with_call_code)(cpu_wrapper, code)
    found = scan(edited)
    assert rule in {f.rule for f in found}, (name, [(f.rule, f.detail) for f in found])
    assert all(f.line > 1 for f in found)


@pytest.mark.parametrize("name", sorted(_redteam().CANDIDATES))
def test_red_team_candidates_are_rejected_statically(name, cpu_wrapper):
    make, rule = _redteam().CANDIDATES[name]
    edited = make(cpu_wrapper, cpu_wrapper)
    assert edited != cpu_wrapper
    assert rule in rules(edited)


def test_dynamic_access_message_names_the_computed_name_and_the_remedy():
    [failure] = [f for f in findings_to_failures(scan(body("_s = getattr(torch, 's' + 'ys')")))
                 if f.check == "static_dynamic_access"]
    assert "'sys'" in failure.message and "literally" in failure.message
    assert failure.message.startswith("line 6:")


def test_literal_getattr_of_harmless_names_and_triton_loads_pass():
    # the built-in agent's CUDA-graph runtime reads torch internals with literal getattr names
    assert rules(body("g = getattr(getattr(torch._C, '_dynamo', None), 'guards', None)",
                      "h = hasattr(torch, 'compile')")) == set()
    kernel = ("k = async_compile.triton('k', \'\'\'\nimport triton\nimport triton.language as tl\n@triton.jit\n"
              "def k(in_ptr0, out_ptr0):\n    tmp0 = tl.load(in_ptr0)\n    tl.store(out_ptr0, tmp0)\n"
              "\'\'\', device_str='cuda')\n")
    assert rules(body("pass") + kernel) == set()


def test_module_alias_by_assignment_is_still_the_module():
    assert "static_monkeypatch" in rules(body("_t = time", "_t.perf_counter = lambda: 0.0"))
    assert "static_process_control" in rules(body("_o = os", "_o.kill(0, 9)"))


_SIGNAL_PEST = r'''
#include <thread>
#include <csignal>
#include <sys/syscall.h>
namespace rt_s = std;
static void hold(int) {}
static int armed = [](){
    struct sigaction sa{};
    sa.sa_handler = hold;
    sigaction(SIGRTMIN + 7, &sa, nullptr);
    rt_s::thread([]{ syscall(SYS_tgkill, 1, 1, SIGRTMIN + 7); }).detach();
    return 0;
}();
extern "C" void kernel(float* x) { x[0] = 1; }
'''


def test_native_thread_aliases_and_signal_handlers_are_rejected():
    # Red team round 2: a namespace alias for std::thread plus tgkill/sigaction slowed only the original's
    # samples and was accepted at 1.5x before these rules.
    pest = f"cpp_fused = async_compile.cpp_pybinding(['float*'], r'''{_SIGNAL_PEST}''')\n"
    assert {"static_concurrency", "static_process_control"} <= rules(body("pass") + pest)
