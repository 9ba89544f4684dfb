"""Building and finding the native kernels (tilesmith/kernels/build.py, runtime.py) without a GPU or nvcc.

- The cache key: a pure function of the sources, compilers, architecture, torch and Python ABI.
- A failing build (a fake nvcc and a fake C++ compiler that exit 1, run through the real
  ``torch.utils.cpp_extension.load``) is a :class:`KernelBuildError` naming the family, the compiler's output
  and the log file, written to ``build.log``, and not retried in the same process.
- A finished build is found again by a later "process" (per-process state dropped) without building;
  concurrent builders build once (the file lock); an interrupted build (no manifest) is rebuilt.
- The loader refuses unknown families, malformed keys, missing builds and builds for another torch.
- Gate workers get the kernel directory, and their audit hook lets candidate code read it through the
  loader, never write it (child interpreter, like tests/test_gate_audit.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tilesmith.kernels import build, runtime
from tilesmith.kernels.build import KernelBuildError, Toolchain, arch_for, build_key, ensure_built_key

_REPO = Path(__file__).resolve().parents[1]
TOOLS = Toolchain(cuda_home="/opt/cuda", nvcc_version="Cuda compilation tools, release 13.0, V13.0.88", cxx="c++",
                  cxx_version="c++ (GCC) 12.2.0")


@pytest.fixture(autouse=True)
def fresh_state():
    build.forget_process_state()
    yield
    build.forget_process_state()


def key(family="softmax", **kw):
    args = {"capability": (9, 0), "toolchain": TOOLS, "torch_version": "2.11.0+cu130", "torch_build": "cuda13.0+gitx",
            "abi": "cpython-312-x86_64-linux-gnu"}
    args.update(kw)
    return build_key(family, **args)


def test_key_changes_with_every_input_and_only_then():
    base = key()
    assert key().key == base.key and len(base.key) == 64
    variants = [key(family="norm"), key(capability=(8, 0)), key(torch_version="2.12.0"), key(torch_build="cuda12.8"),
                key(abi="cpython-311-x86_64-linux-gnu"),
                key(toolchain=Toolchain("/opt/cuda", "release 13.1, V13.1.80", "c++", TOOLS.cxx_version)),
                key(toolchain=Toolchain("/opt/cuda", TOOLS.nvcc_version, "c++", "clang version 18"))]
    assert len({v.key for v in variants} | {base.key}) == len(variants) + 1


def test_key_changes_with_the_source(tmp_path):
    src = tmp_path / "csrc"
    shutil.copytree(build.SOURCE_DIR, src)
    before = key(source_dir=src)
    assert before.key == key().key  # the copy hashes like the package
    (src / "common.cuh").write_text((src / "common.cuh").read_text() + "\n// edited\n")
    after = key(source_dir=src)
    assert after.source_sha256 != before.source_sha256 and after.key != before.key
    assert key(family="softmax", source_dir=src).key != key(family="softmax").key
    assert key(family="int8_linear", source_dir=src).key != key(family="int8_linear").key  # shared header


def test_every_family_has_its_sources_and_its_own_key(tmp_path):
    assert set(build.FAMILY_FILES) == set(runtime.FAMILIES) and "group_norm" in runtime.FAMILIES
    for family, (sources, headers) in build.FAMILY_FILES.items():
        assert sources == (f"{family}.cu", f"{family}_bind.cpp") and f"{family}.h" in headers
        assert all((build.SOURCE_DIR / name).is_file() for name in sources + headers), family
    assert len({key(family=f).key for f in runtime.FAMILIES}) == len(runtime.FAMILIES)
    src = tmp_path / "csrc"
    shutil.copytree(build.SOURCE_DIR, src)
    (src / "group_norm.cu").write_text((src / "group_norm.cu").read_text() + "\n// edited\n")
    assert key(family="group_norm", source_dir=src).key != key(family="group_norm").key
    assert key(family="softmax", source_dir=src).key == key(family="softmax").key


def test_architecture_flags_are_machine_code_for_the_device():
    assert arch_for((9, 0)) == ("sm_90a", ("-gencode=arch=compute_90a,code=sm_90a",))
    assert arch_for((8, 6)) == ("sm_86", ("-gencode=arch=compute_86,code=sm_86",))
    assert key().cuda_flags[-1] == "-gencode=arch=compute_90a,code=sm_90a"
    assert not any("compute_90a,code=compute" in f or "+PTX" in f for f in key().cuda_flags)


def _fake_tool(path: Path, version: str, counter: Path) -> None:
    path.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        case "$1" in --version|-v|-dumpversion) echo "{version}"; exit 0;; esac
        echo run >> {counter}
        echo "fake compiler: error: this toolchain cannot compile anything" >&2
        exit 1
        """))
    path.chmod(0o755)


def test_failing_compiler_is_a_build_error_with_the_log_and_is_not_retried(tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    counter = tmp_path / "runs.txt"
    _fake_tool(home / "bin" / "nvcc", "Cuda compilation tools, release 13.0, V13.0.88", counter)
    _fake_tool(tmp_path / "fake-c++", "fake-c++ (GCC) 12.2.0", counter)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(home))
    monkeypatch.setenv("CXX", str(tmp_path / "fake-c++"))
    if not cpp_extension.is_ninja_available():
        pytest.skip("ninja is not installed")
    tools = build.find_toolchain(refresh=True)
    assert tools.nvcc_version.endswith("V13.0.88") and tools.cxx_version == "fake-c++ (GCC) 12.2.0"
    k = build_key("softmax", capability=(9, 0), toolchain=tools, torch_version="2.11.0")
    root = tmp_path / "kernels"
    with pytest.raises(KernelBuildError) as info:
        ensure_built_key(k, root=root)
    err = info.value
    assert err.family == "softmax" and err.log_path == root / k.key / "build.log"
    assert "native kernel 'softmax'" in str(err) and "failed to build" in str(err) and str(err.log_path) in str(err)
    assert "this toolchain cannot compile anything" in err.log_path.read_text()
    assert not (root / k.key / "manifest.json").exists()
    runs = counter.read_text().count("run")
    assert runs >= 1
    with pytest.raises(KernelBuildError):
        ensure_built_key(k, root=root)  # the same process does not try again
    assert counter.read_text().count("run") == runs


def test_missing_toolkit_is_a_build_error(monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    with pytest.raises(KernelBuildError, match="no CUDA toolkit found"):
        build.find_toolchain(refresh=True)


class _FakeBuilder:
    """Stands in for cpp_extension.load: writes the library file and returns a sentinel module."""

    def __init__(self, delay_s: float = 0.0):
        self.calls = 0
        self.delay_s = delay_s

    def __call__(self, *, name, sources, build_directory, **kwargs):
        self.calls += 1
        time.sleep(self.delay_s)
        assert all(Path(s).exists() for s in sources) and kwargs["extra_cuda_cflags"][-1].startswith("-gencode")
        Path(build_directory, f"{name}.so").write_bytes(b"\x7fELF fake")
        return f"module {name}"


@pytest.fixture
def loadable(monkeypatch):
    """Finished builds load without a GPU: the manifest check passes and the import returns a sentinel."""
    imported = []
    monkeypatch.setattr(build, "manifest_problem", lambda manifest, family, k: None)
    monkeypatch.setattr(build, "import_library", lambda name, path: imported.append(path) or f"imported {name}")
    for name in [n for n in sys.modules if n.startswith("tilesmith_native_")]:
        monkeypatch.delitem(sys.modules, name)
    return imported


def test_a_finished_build_is_reused_by_a_later_process(tmp_path, loadable):
    k, root, builder = key(), tmp_path / "kernels", _FakeBuilder()
    first = ensure_built_key(k, builder=builder, root=root)
    assert first.built and builder.calls == 1 and first.directory == root / k.key
    manifest = json.loads((root / k.key / "manifest.json").read_text())
    assert manifest["key"] == k.key and manifest["arch"] == "sm_90a" and manifest["library"].endswith(".so")
    assert sorted(p.name for p in (root / k.key / "src").iterdir()) == sorted(
        build.FAMILY_FILES["softmax"][0] + build.FAMILY_FILES["softmax"][1])
    build.forget_process_state()
    sys.modules.pop(runtime.module_name(k.family, k.key), None)
    again = ensure_built_key(k, builder=builder, root=root)
    assert not again.built and builder.calls == 1 and again.module == f"imported {runtime.module_name('softmax', k.key)}"
    assert loadable == [root / k.key / manifest["library"]]


def test_concurrent_builders_build_once(tmp_path, loadable):
    k, root, builder = key(), tmp_path / "kernels", _FakeBuilder(delay_s=0.5)
    results = []

    def one():
        build.forget_process_state()  # each thread behaves like its own process
        results.append(ensure_built_key(k, builder=builder, root=root))

    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert builder.calls == 1 and len(results) == 3
    assert sorted(r.built for r in results) == [False, False, True]


def test_an_interrupted_build_is_rebuilt(tmp_path, loadable):
    k, root, builder = key(), tmp_path / "kernels", _FakeBuilder()
    (root / k.key / "build").mkdir(parents=True)
    (root / k.key / "build" / "half-written.o").write_text("x")
    assert ensure_built_key(k, builder=builder, root=root).built and builder.calls == 1
    assert not (root / k.key / "build" / "half-written.o").exists()


def test_loader_refuses_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("TILESMITH_KERNEL_DIR", str(tmp_path))
    with pytest.raises(runtime.KernelUnavailable, match="unknown family"):
        runtime.native_module("cutlass", "a" * 64)
    with pytest.raises(runtime.KernelUnavailable, match="malformed build key"):
        runtime.native_module("softmax", "../../etc")
    with pytest.raises(runtime.KernelUnavailable, match="no complete build of 'softmax'.*native_kernels"):
        runtime.native_module("softmax", "a" * 64)
    folder = tmp_path / ("b" * 64)
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({"family": "softmax", "key": "b" * 64, "torch": "1.0",
                                                      "library": "build/x.so", "python_abi": runtime.python_abi()}))
    with pytest.raises(runtime.KernelUnavailable, match="built for torch 1.0"):
        runtime.native_module("softmax", "b" * 64)
    (folder / "manifest.json").write_text(json.dumps({"family": "softmax", "key": "b" * 64, "library": "../x.so"}))
    with pytest.raises(runtime.KernelUnavailable, match="names no library"):
        runtime.native_module("softmax", "b" * 64)


def test_kernel_dir_follows_the_settings(tmp_path, monkeypatch):
    monkeypatch.delenv("TILESMITH_KERNEL_DIR", raising=False)
    monkeypatch.setenv("TILESMITH_CACHE_DIR", str(tmp_path / "root"))
    assert runtime.kernel_dir() == tmp_path / "root" / "kernels"
    monkeypatch.setenv("TILESMITH_KERNEL_DIR", str(tmp_path / "k"))
    assert runtime.kernel_dir() == tmp_path / "k"


def test_gate_workers_get_the_kernel_dir_and_no_other_setting(tmp_path):
    from tilesmith.gate.host.process import worker_environment

    env = {"PATH": "/usr/bin", "TILESMITH_CACHE_DIR": str(tmp_path / "root"), "TILESMITH_MODEL": "x"}
    clean = worker_environment(env)
    assert clean["TILESMITH_KERNEL_DIR"] == os.path.realpath(tmp_path / "root" / "kernels")
    assert [k for k in clean if k.startswith("TILESMITH_")] == ["TILESMITH_KERNEL_DIR"]


_HARNESS = textwrap.dedent('''
    import importlib.util, json, os, sys
    import torch                                     # imported before arming, as in the worker
    import tilesmith.kernels.runtime
    from tilesmith.gate.worker import audit
    priv, kdir, allow = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    auditor = audit.install(priv, readable=(kdir,) if allow else ())
    auditor.arm()
    out = {}
    for name, source in json.load(open(sys.argv[4])).items():
        path = os.path.join(priv, "cand_" + name + ".py")
        with open(path, "w") as handle:
            handle.write(source)
        spec = importlib.util.spec_from_file_location("cand_" + name, path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
            error = None
        except BaseException as exc:
            error = type(exc).__name__ + ": " + str(exc)[-300:]
        out[name] = {"checks": sorted({r["check"] for r in auditor.drain()}), "error": error}
    print(json.dumps(out))
''')


def _audited(tmp_path: Path, allow: bool) -> dict:
    priv, kdir = tmp_path / "private", tmp_path / "kernels"
    priv.mkdir(parents=True)
    build_dir = kdir / ("c" * 64)
    build_dir.mkdir(parents=True)
    (build_dir / "manifest.json").write_text(json.dumps({"family": "softmax", "key": "c" * 64, "torch": "0.0",
                                                         "library": "build/x.so"}))
    cases = {
        "load_through_runtime": "from tilesmith.kernels.runtime import native_module\n"
                                f"native_module('softmax', {'c' * 64!r})\n",
        "read_directly": f"open({str(build_dir / 'manifest.json')!r}).read()\n",
        "write_kernel_dir": f"open({str(build_dir / 'evil.so')!r}, 'w').write('x')\n",
    }
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps(cases))
    harness = tmp_path / "harness.py"
    harness.write_text(_HARNESS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TILESMITH_")}
    env.update(PYTHONPATH=str(_REPO), TILESMITH_KERNEL_DIR=str(kdir))
    proc = subprocess.run([sys.executable, str(harness), str(priv), str(kdir), "1" if allow else "0", str(spec)],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["_evil"] = (build_dir / "evil.so").exists()
    return result


def test_worker_audit_allows_reading_the_kernel_dir_only_when_passed_and_never_writing(tmp_path):
    allowed = _audited(tmp_path / "a", allow=True)
    assert allowed["load_through_runtime"]["checks"] == []
    assert "KernelUnavailable" in allowed["load_through_runtime"]["error"]  # reached the manifest: torch mismatch
    assert "built for torch 0.0" in allowed["load_through_runtime"]["error"]
    assert allowed["read_directly"] == {"checks": [], "error": None}
    assert allowed["write_kernel_dir"]["checks"] == ["audit_file_write"] and not allowed["_evil"]
    denied = _audited(tmp_path / "d", allow=False)
    assert denied["load_through_runtime"]["checks"] == ["audit_file_read"]
    assert denied["read_directly"]["checks"] == ["audit_file_read"]
