"""Building Tilesmith's native CUDA C++ kernels once per machine, and finding the builds again.

Each kernel family (``int8_linear``, ``softmax``, ``norm``, ``group_norm``) is one PyTorch extension built with
``torch.utils.cpp_extension.load`` from ``csrc/<family>.cu`` (the kernels, CUDA headers only) and
``csrc/<family>_bind.cpp`` (argument checks and the pybind11 module). A build lives in
``<kernel dir>/<key>/`` (:func:`tilesmith.kernels.runtime.kernel_dir`):

- ``key`` = SHA-256 of the family's source files (names and bytes), the nvcc version line, the host C++
  compiler's version line, the target architecture and its flags, torch's version / CUDA version / git
  commit and the Python extension ABI. Any of them changing gives a new key, so an old build is never
  loaded by a process it was not made for.
- Machine code for the device's own architecture, not PTX for the driver to JIT: ``sm_90a`` on Hopper
  (compute capability 9.0; ``-gencode=arch=compute_90a,code=sm_90a``), ``sm_<major><minor>`` elsewhere
  (the kernels use nothing Hopper-only; the tensor-core path needs sm_80).
- Built under a file lock (``<kernel dir>/<key>.lock``, :mod:`filelock`), so concurrent processes build
  once; ``manifest.json`` is written last (atomically), so a folder without it is an interrupted build and
  is rebuilt; ``build.log`` keeps the compiler output of a failed build.

A failed build raises :class:`KernelBuildError` (message: family, key, the compiler's last lines, the log
path and the remedy); callers turn it into a diagnostic. Within one process a failed key is not retried.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tilesmith._atomic import write_json_atomic
from tilesmith.kernels.runtime import (FAMILIES, KernelUnavailable, import_library, kernel_dir, manifest_problem,
                                       module_name, python_abi, read_manifest)

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"

#: Files of each family: compiled sources first, then the headers they include (all hashed into the key).
FAMILY_FILES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "int8_linear": (("int8_linear.cu", "int8_linear_bind.cpp"), ("common.cuh", "int8_linear.h", "bind_util.h")),
    "softmax": (("softmax.cu", "softmax_bind.cpp"), ("common.cuh", "softmax.h", "bind_util.h")),
    "norm": (("norm.cu", "norm_bind.cpp"), ("common.cuh", "norm.h", "bind_util.h")),
    "group_norm": (("group_norm.cu", "group_norm_bind.cpp"), ("common.cuh", "group_norm.h", "bind_util.h")),
}

#: nvcc flags besides the architecture (no --use_fast_math: the kernels pick their fast intrinsics one by one).
CUDA_FLAGS = ("-O3", "-std=c++17", "-lineinfo")
CXX_FLAGS = ("-O3", "-std=c++17")
#: Seconds a process waits for another process's build of the same key before giving up.
LOCK_TIMEOUT_S = 900.0


class KernelBuildError(RuntimeError):
    """A native kernel family could not be built (or its toolchain is missing); the message says why."""

    def __init__(self, family: str, message: str, log_path: Path | None = None):
        super().__init__(message)
        self.family = family
        self.log_path = log_path


@dataclass(frozen=True)
class Toolchain:
    """The compilers ``torch.utils.cpp_extension`` will use (CUDA_HOME's nvcc, ``$CXX`` or ``c++``)."""

    cuda_home: str
    nvcc_version: str
    cxx: str
    cxx_version: str


@dataclass(frozen=True)
class BuildKey:
    """Everything a build depends on, and its SHA-256 (``key``, 64 hex digits)."""

    family: str
    key: str
    source_sha256: str
    nvcc_version: str
    cxx_version: str
    arch: str
    capability: tuple[int, int]
    cuda_flags: tuple[str, ...]
    torch_version: str
    python_abi: str

    def manifest(self, library: str, build_s: float) -> dict[str, Any]:
        return {"family": self.family, "key": self.key, "library": library, "source_sha256": self.source_sha256,
                "nvcc": self.nvcc_version, "cxx": self.cxx_version, "arch": self.arch,
                "capability": list(self.capability), "cuda_flags": list(self.cuda_flags), "torch": self.torch_version,
                "python_abi": self.python_abi, "build_s": round(build_s, 3)}


@dataclass(frozen=True)
class Build:
    """A loaded build: ``built`` when this call compiled it, ``seconds`` the compile or the cached-load time."""

    key: BuildKey
    module: Any
    built: bool
    seconds: float
    directory: Path


def source_digest(family: str, source_dir: Path = SOURCE_DIR) -> str:
    """SHA-256 over the names and bytes of ``family``'s sources and headers."""
    sources, headers = FAMILY_FILES[family]
    digest = hashlib.sha256()
    for name in sorted(sources + headers):
        digest.update(name.encode() + b"\0" + (source_dir / name).read_bytes() + b"\0")
    return digest.hexdigest()


def arch_for(capability: tuple[int, int]) -> tuple[str, tuple[str, ...]]:
    """Target name and nvcc flags for a compute capability: machine code for exactly that GPU."""
    major, minor = int(capability[0]), int(capability[1])
    if (major, minor) == (9, 0):
        return "sm_90a", ("-gencode=arch=compute_90a,code=sm_90a",)
    cc = f"{major}{minor}"
    return f"sm_{cc}", (f"-gencode=arch=compute_{cc},code=sm_{cc}",)


def build_key(family: str, *, capability: tuple[int, int], toolchain: Toolchain, torch_version: str,
              torch_build: str = "", abi: str | None = None, source_dir: Path = SOURCE_DIR) -> BuildKey:
    """The :class:`BuildKey` of ``family`` for this toolchain, GPU and torch (pure: no compiler runs).

    ``torch_version`` is ``torch.__version__`` (checked again when a build is loaded); ``torch_build`` adds
    what else identifies the torch binary (its CUDA version and git commit) to the hash.
    """
    if family not in FAMILY_FILES:
        raise KeyError(f"unknown kernel family {family!r} (known: {', '.join(FAMILY_FILES)})")
    arch, arch_flags = arch_for(capability)
    sha = source_digest(family, source_dir)
    flags = CUDA_FLAGS + arch_flags
    abi = abi or python_abi()
    payload = json.dumps({"family": family, "sources": sha, "nvcc": toolchain.nvcc_version,
                          "cxx": toolchain.cxx_version, "arch": arch, "flags": flags, "cxx_flags": CXX_FLAGS,
                          "torch": torch_version, "torch_build": torch_build, "abi": abi}, sort_keys=True)
    return BuildKey(family=family, key=hashlib.sha256(payload.encode()).hexdigest(), source_sha256=sha,
                    nvcc_version=toolchain.nvcc_version, cxx_version=toolchain.cxx_version, arch=arch,
                    capability=(int(capability[0]), int(capability[1])), cuda_flags=flags,
                    torch_version=torch_version, python_abi=abi)


def _torch_build_text() -> str:
    import torch

    return f"cuda{torch.version.cuda}+git{getattr(torch.version, 'git_version', '')}"


_TOOLCHAIN: Toolchain | None = None
_TOOLCHAIN_ERROR: KernelBuildError | None = None
_LOCK = threading.Lock()
_BUILT: dict[str, Build] = {}
_FAILED: dict[str, KernelBuildError] = {}


def _first_line(cmd: list[str], *, contains: str = "") -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    picked = [ln for ln in lines if contains in ln] if contains else lines
    if not picked:
        raise RuntimeError(f"{cmd[0]} printed no version line")
    return picked[-1] if contains else picked[0]


def find_toolchain(refresh: bool = False) -> Toolchain:
    """The toolchain ``cpp_extension`` would use, with version lines (cached per process).

    Raises:
        KernelBuildError: no CUDA toolkit (``CUDA_HOME`` unset and no ``nvcc`` on ``PATH``), nvcc or the host
            compiler does not run, or ninja is missing.
    """
    global _TOOLCHAIN, _TOOLCHAIN_ERROR
    with _LOCK:
        if not refresh and _TOOLCHAIN is not None:
            return _TOOLCHAIN
        if not refresh and _TOOLCHAIN_ERROR is not None:
            raise _TOOLCHAIN_ERROR
        try:
            _TOOLCHAIN = _probe_toolchain()
            _TOOLCHAIN_ERROR = None
            return _TOOLCHAIN
        except KernelBuildError as exc:
            _TOOLCHAIN_ERROR = exc
            raise


def _probe_toolchain() -> Toolchain:
    from torch.utils import cpp_extension

    cuda_home = getattr(cpp_extension, "CUDA_HOME", None)
    if not cuda_home:
        raise KernelBuildError("*", "no CUDA toolkit found: torch.utils.cpp_extension has no CUDA_HOME (set "
                               "CUDA_HOME to the toolkit folder, or put nvcc on PATH)")
    nvcc = str(Path(cuda_home) / "bin" / "nvcc")
    try:
        nvcc_version = _first_line([nvcc, "--version"], contains="release")
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        raise KernelBuildError("*", f"nvcc at {nvcc} does not run ({type(exc).__name__}: {exc}); set CUDA_HOME to a "
                               "working CUDA toolkit") from None
    cxx = os.environ.get("CXX", "c++")
    try:
        cxx_version = _first_line([cxx, "--version"])
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        raise KernelBuildError("*", f"the host C++ compiler {cxx!r} does not run ({type(exc).__name__}: {exc}); set "
                               "CXX to a working g++ or clang++") from None
    if not cpp_extension.is_ninja_available():
        raise KernelBuildError("*", "ninja is not available (torch.utils.cpp_extension builds with it): "
                               "pip install ninja")
    return Toolchain(cuda_home=str(cuda_home), nvcc_version=nvcc_version, cxx=cxx, cxx_version=cxx_version)


def key_for(family: str, device: Any = None) -> BuildKey:
    """The build key of ``family`` for ``device`` (default: the current CUDA device) on this machine.

    Raises:
        KernelBuildError: the toolchain is missing (see :func:`find_toolchain`).
    """
    import torch

    toolchain = find_toolchain()
    capability = tuple(torch.cuda.get_device_capability(device))
    return build_key(family, capability=capability, toolchain=toolchain, torch_version=str(torch.__version__),
                     torch_build=_torch_build_text())


def ensure_built(family: str, device: Any = None, *, builder: Callable[..., Any] | None = None,
                 root: Path | None = None) -> Build:
    """Load ``family``'s build for ``device``, compiling it first if this machine has none.

    Args:
        family: one of :data:`tilesmith.kernels.runtime.FAMILIES`.
        device: CUDA device whose architecture the build targets (default: the current one).
        builder: ``torch.utils.cpp_extension.load``-compatible callable (tests substitute a failing one).
        root: kernel directory (default :func:`tilesmith.kernels.runtime.kernel_dir`).

    Raises:
        KernelBuildError: no toolchain, the compiler failed (``log_path`` has its output), or another
            process held the build lock for longer than :data:`LOCK_TIMEOUT_S`.
    """
    key = key_for(family, device)
    return ensure_built_key(key, builder=builder, root=root)


def ensure_built_key(key: BuildKey, *, builder: Callable[..., Any] | None = None, root: Path | None = None) -> Build:
    """:func:`ensure_built` for an already computed key (the testable core: no device query)."""
    with _LOCK:
        if key.key in _BUILT:
            return _BUILT[key.key]
        if key.key in _FAILED:
            raise _FAILED[key.key]
    root = Path(root) if root is not None else kernel_dir()
    try:
        build = _load_or_build(key, builder, root)
    except KernelBuildError as exc:
        with _LOCK:
            _FAILED[key.key] = exc
        raise
    with _LOCK:
        _BUILT[key.key] = build
    return build


def ensure_built_many(families: Iterable[str], device: Any = None) -> dict[str, Build | KernelBuildError]:
    """Build (or load) several families in parallel threads; each value is a Build or the error it raised."""
    names = list(families)

    def one(name: str) -> Build | KernelBuildError:
        try:
            return ensure_built(name, device)
        except KernelBuildError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=max(1, len(names))) as pool:
        return dict(zip(names, pool.map(one, names), strict=True))


def _load_existing(key: BuildKey, folder: Path) -> Build | None:
    manifest = read_manifest(folder)
    if manifest is None or manifest_problem(manifest, key.family, key.key) is not None:
        return None
    started = time.perf_counter()
    module = import_library(module_name(key.family, key.key), folder / manifest["library"])
    return Build(key=key, module=module, built=False, seconds=time.perf_counter() - started, directory=folder)


def _load_or_build(key: BuildKey, builder: Callable[..., Any] | None, root: Path) -> Build:
    from filelock import FileLock, Timeout

    folder = root / key.key
    loaded = sys.modules.get(module_name(key.family, key.key))
    if loaded is not None:
        return Build(key=key, module=loaded, built=False, seconds=0.0, directory=folder)
    try:
        existing = _load_existing(key, folder)
    except KernelUnavailable:
        existing = None
    if existing is not None:
        return existing
    root.mkdir(parents=True, exist_ok=True)
    try:
        with FileLock(str(root / f"{key.key}.lock"), timeout=LOCK_TIMEOUT_S):
            try:
                existing = _load_existing(key, folder)  # another process finished it while we waited
            except KernelUnavailable:
                existing = None
            if existing is not None:
                return existing
            return _compile(key, builder, folder)
    except Timeout:
        raise KernelBuildError(key.family, f"native kernel {key.family!r} ({key.key[:16]}): another process has held "
                               f"the build lock {root / (key.key + '.lock')} for {LOCK_TIMEOUT_S:.0f} s; remove it if "
                               "no build is running") from None


def _compile(key: BuildKey, builder: Callable[..., Any] | None, folder: Path) -> Build:
    if folder.exists():
        shutil.rmtree(folder)  # an interrupted build (no manifest): start clean
    src = folder / "src"
    src.mkdir(parents=True)
    sources, headers = FAMILY_FILES[key.family]
    for name in sources + headers:
        shutil.copy2(SOURCE_DIR / name, src / name)
    if source_digest(key.family, src) != key.source_sha256:
        raise KernelBuildError(key.family, f"native kernel {key.family!r}: the sources changed while building; retry")
    name = module_name(key.family, key.key)
    build_dir = folder / "build"
    build_dir.mkdir()
    if builder is None:
        from torch.utils.cpp_extension import load as builder
    started = time.perf_counter()
    try:
        # (No warnings.catch_warnings() here: it swaps the process-global filter list, which is not safe with
        # the parallel builds of ensure_built_many; torch's compiler-version advisories are left alone.)
        module = builder(name=name, sources=[str(src / s) for s in sources], build_directory=str(build_dir),
                         extra_cflags=list(CXX_FLAGS), extra_cuda_cflags=list(key.cuda_flags),
                         extra_include_paths=[str(src)], with_cuda=True, verbose=False)
    except Exception as exc:  # noqa: BLE001 - any compiler/linker/import failure becomes a diagnostic
        log = folder / "build.log"
        text = f"{type(exc).__name__}: {exc}"
        try:
            log.write_text(text, encoding="utf-8")
        except OSError:
            log = None  # type: ignore[assignment]
        tail = " | ".join(ln.strip() for ln in str(exc).splitlines() if ln.strip())[-600:]
        raise KernelBuildError(key.family, f"native kernel {key.family!r} ({key.key[:16]}, {key.arch}, "
                               f"{key.nvcc_version}) failed to build: {tail}. Full output: {log}. Check CUDA_HOME / "
                               "CXX, or set TILESMITH_NATIVE_KERNELS=0 to stop trying.", log) from None
    seconds = time.perf_counter() - started
    library = f"build/{name}.so"
    if not (folder / library).exists():
        raise KernelBuildError(key.family, f"native kernel {key.family!r}: the build produced no {library}")
    sys.modules[name] = module
    write_json_atomic(folder / "manifest.json", key.manifest(library, seconds), indent=1, sort_keys=False)
    return Build(key=key, module=module, built=True, seconds=seconds, directory=folder)


def forget_process_state() -> None:
    """Drop the per-process memo of toolchain, builds and failures (tests)."""
    global _TOOLCHAIN, _TOOLCHAIN_ERROR
    with _LOCK:
        _TOOLCHAIN = _TOOLCHAIN_ERROR = None
        _BUILT.clear()
        _FAILED.clear()


__all__ = ["FAMILIES", "Build", "BuildKey", "KernelBuildError", "Toolchain", "arch_for", "build_key",
           "ensure_built", "ensure_built_many", "find_toolchain", "key_for", "source_digest"]
