"""Loading a native kernel build that Tilesmith made earlier: what a candidate wrapper calls at import.

A candidate that uses a native kernel carries two lines (written by the ``native_kernels`` generator)::

    from tilesmith.kernels.runtime import native_module
    _tilesmith_native_softmax = native_module("softmax", "<64 hex digits>")

:func:`native_module` never builds, never writes and never starts a process: it reads
``<kernel dir>/<key>/manifest.json``, checks that the build is complete and made for this torch, Python ABI
and GPU, and imports the extension library the manifest names (a pybind11 module whose functions take and
return tensors). The build itself happens earlier, in the host process (:mod:`tilesmith.kernels.build`,
under a file lock). Because the reads happen in this library's frames, a gate worker's audit hook sees a
library reading Tilesmith's kernel directory; the worker allows exactly that directory for reading
(``TILESMITH_KERNEL_DIR``, passed to workers by :func:`tilesmith.gate.host.process.worker_environment`), and the
gate's static scan allows exactly this import (``docs/gate.md``, "Native kernels").

Errors: :class:`KernelUnavailable` (an ``ImportError``) names the family, the key, what is missing or
mismatched and the remedy; the candidate then fails to import, which the gate reports as ``load_error``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import sysconfig
from pathlib import Path
from typing import Any

#: The kernel families Tilesmith builds (``tilesmith/kernels/csrc/<family>.cu``).
FAMILIES = ("int8_linear", "softmax", "norm", "group_norm")
_KEY = re.compile(r"[0-9a-f]{64}")
_LIBRARY = re.compile(r"build/[A-Za-z0-9_]+\.so")


class KernelUnavailable(ImportError):
    """No usable build of a kernel family for this key on this machine (message names the remedy)."""


def kernel_dir(environ: dict[str, str] | None = None) -> Path:
    """Folder of native kernel builds: ``TILESMITH_KERNEL_DIR``, else ``<TILESMITH cache root>/kernels``."""
    from tilesmith import settings

    env = os.environ if environ is None else environ
    explicit = settings.get("TILESMITH_KERNEL_DIR", env)
    return Path(explicit).expanduser() if explicit else settings.cache_root(env) / "kernels"


def module_name(family: str, key: str) -> str:
    """Python module (and ``TORCH_EXTENSION_NAME``) of one build: ``tilesmith_native_<family>_<key[:16]>``."""
    return f"tilesmith_native_{family}_{key[:16]}"


def python_abi() -> str:
    """The interpreter's extension ABI tag (``sysconfig`` ``SOABI``, e.g. ``cpython-312-x86_64-linux-gnu``)."""
    return str(sysconfig.get_config_var("SOABI") or f"py{sys.version_info[0]}{sys.version_info[1]}")


def native_module(family: str, key: str) -> Any:
    """The extension module of build ``key`` of ``family`` (imported once per process).

    Raises:
        KernelUnavailable: unknown family, malformed key, no complete build under :func:`kernel_dir`, or a
            build made for another torch, Python ABI or GPU architecture.
    """
    if family not in FAMILIES or not isinstance(key, str) or not _KEY.fullmatch(key):
        raise KernelUnavailable(f"tilesmith native kernels: unknown family {family!r} or malformed build key "
                                f"{str(key)[:80]!r}")
    name = module_name(family, key)
    loaded = sys.modules.get(name)
    if loaded is not None:
        return loaded
    folder = kernel_dir() / key
    manifest = read_manifest(folder)
    if manifest is None:
        raise KernelUnavailable(f"tilesmith native kernels: no complete build of {family!r} with key {key[:16]} in "
                                f"{folder} (it is built on first use by the built-in agent's 'native_kernels' "
                                "generator; re-run the optimization, or point TILESMITH_KERNEL_DIR at the folder "
                                "that holds it)")
    problem = manifest_problem(manifest, family, key)
    if problem:
        raise KernelUnavailable(f"tilesmith native kernels: build {key[:16]} of {family!r} in {folder} is not usable "
                                f"here: {problem}")
    return import_library(name, folder / manifest["library"])


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The parsed ``manifest.json`` of a build folder, or ``None`` when absent or unreadable (incomplete build)."""
    try:
        data = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def manifest_problem(manifest: dict[str, Any], family: str, key: str) -> str | None:
    """Why a manifest does not describe a build this process can load (``None``: it can)."""
    import torch

    if manifest.get("family") != family or manifest.get("key") != key:
        return f"the manifest describes {manifest.get('family')!r} / {str(manifest.get('key'))[:16]}"
    library = manifest.get("library")
    if not isinstance(library, str) or not _LIBRARY.fullmatch(library):
        return f"the manifest names no library in the build folder ({str(library)[:80]!r})"
    if manifest.get("torch") != torch.__version__:
        return f"built for torch {manifest.get('torch')}, this process runs torch {torch.__version__}"
    if manifest.get("python_abi") != python_abi():
        return f"built for Python ABI {manifest.get('python_abi')}, this process is {python_abi()}"
    if not torch.cuda.is_available():
        return "no CUDA device in this process"
    capability = list(torch.cuda.get_device_capability())
    if manifest.get("capability") != capability:
        return f"built for compute capability {manifest.get('capability')}, the current device has {capability}"
    return None


def import_library(name: str, path: Path) -> Any:
    """Import the extension library at ``path`` as module ``name`` and register it in ``sys.modules``."""
    spec = importlib.util.spec_from_file_location(name, str(path))
    if spec is None or spec.loader is None:
        raise KernelUnavailable(f"tilesmith native kernels: {path} is not an importable extension library")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        raise KernelUnavailable(f"tilesmith native kernels: importing {path} failed: {exc}") from None
    sys.modules[name] = module
    return module
