"""Process-global state a candidate must not change, and the numeric flags the worker copies from the host.

Used on both sides:

- the host reads :func:`numeric_flags` when a :class:`~tilesmith.gate.Gate` is built (the user's TF32,
  matmul-precision, reduced-precision, cuDNN, determinism and SDPA settings) and sends them to every
  worker, which applies them with :func:`apply_flags` so that the original wrapper and the candidate
  compute with exactly the user's settings;
- the worker takes :func:`state_snapshot` and :func:`identity_snapshot` after loading the trusted
  original wrapper and before importing any candidate code, and compares after every candidate import
  and call (:func:`diff_state`, :func:`diff_identities`).

Torch internals are read defensively: a flag this torch version lacks is simply absent.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

from tilesmith.gate import modes

# fp32 precision knobs (torch ≥ 2.9 API). Parents first: applying in this order reproduces children
# whose value is "none" (inherit).
_FP32_PRECISION_PATHS = (
    "fp32_precision",
    "cuda.matmul.fp32_precision",
    "cudnn.fp32_precision",
    "cudnn.conv.fp32_precision",
    "cudnn.rnn.fp32_precision",
    "mkldnn.fp32_precision",
    "mkldnn.matmul.fp32_precision",
    "mkldnn.conv.fp32_precision",
    "mkldnn.rnn.fp32_precision",
)

# Boolean attributes under torch.backends that change numerics or algorithm choice.
_BOOL_PATHS = (
    "cuda.matmul.allow_fp16_reduced_precision_reduction",
    "cuda.matmul.allow_bf16_reduced_precision_reduction",
    "cuda.matmul.allow_fp16_accumulation",
    "cudnn.enabled",
    "cudnn.benchmark",
    "cudnn.deterministic",
)

_SDP = ("flash", "mem_efficient", "math", "cudnn")


def _resolve(path: str) -> tuple[Any, str]:
    obj: Any = torch.backends
    *parents, leaf = path.split(".")
    for part in parents:
        obj = getattr(obj, part)
    return obj, leaf


def _read(path: str) -> Any:
    try:
        obj, leaf = _resolve(path)
        return getattr(obj, leaf)
    except Exception:  # noqa: BLE001 - absent in this torch version or not readable in this mode
        return None


# The legacy precision API (torch ≤ 2.8 style). Reading it raises once the new API has been used in the
# same process, so the worker applies flags through the legacy setters whenever the host's legacy values
# are readable, and through the new API only for what is still different (apply_flags).
_LEGACY: dict[str, Callable[[], Any]] = {
    "legacy.float32_matmul_precision": lambda: str(torch.get_float32_matmul_precision()),
    "legacy.cuda.matmul.allow_tf32": lambda: bool(torch.backends.cuda.matmul.allow_tf32),
    "legacy.cudnn.allow_tf32": lambda: bool(torch.backends.cudnn.allow_tf32),
}


def numeric_flags() -> dict[str, Any]:
    """The settings that decide how the wrapper computes: precision, determinism, SDPA backends, threads.

    Values are JSON-able (str/bool/int). Absent or unreadable knobs are omitted.
    """
    flags: dict[str, Any] = {}
    for path in _FP32_PRECISION_PATHS + _BOOL_PATHS:
        value = _read(path)
        if value is not None:
            flags[path] = value if isinstance(value, (bool, str)) else str(value)
    for name in _SDP:
        getter = getattr(torch.backends.cuda, f"{name}_sdp_enabled", None)
        if getter is not None:
            try:
                flags[f"sdp.{name}"] = bool(getter())
            except Exception:  # noqa: BLE001
                pass
    for key, getter in _LEGACY.items():
        try:
            flags[key] = getter()
        except Exception:  # noqa: BLE001 - unreadable once the new fp32_precision API was mixed in
            pass
    flags["deterministic_algorithms"] = bool(torch.are_deterministic_algorithms_enabled())
    flags["deterministic_warn_only"] = bool(torch.is_deterministic_algorithms_warn_only_enabled())
    flags["default_dtype"] = str(torch.get_default_dtype())
    flags["num_threads"] = int(torch.get_num_threads())
    return flags


def apply_flags(flags: dict[str, Any]) -> list[str]:
    """Apply :func:`numeric_flags` output in this process (only what differs); returns names not set."""
    failed: list[str] = []
    current = numeric_flags()
    legacy_setters: dict[str, Callable[[Any], None]] = {
        "legacy.float32_matmul_precision": torch.set_float32_matmul_precision,
        "legacy.cuda.matmul.allow_tf32": lambda v: setattr(torch.backends.cuda.matmul, "allow_tf32", bool(v)),
        "legacy.cudnn.allow_tf32": lambda v: setattr(torch.backends.cudnn, "allow_tf32", bool(v)),
    }
    for key, setter in legacy_setters.items():
        if key in flags and key in current and flags[key] != current[key]:
            try:
                setter(flags[key])
            except Exception:  # noqa: BLE001
                failed.append(key)
    current = numeric_flags()
    for path in _FP32_PRECISION_PATHS + _BOOL_PATHS:
        if path not in flags or current.get(path) == flags[path]:
            continue
        try:
            obj, leaf = _resolve(path)
            setattr(obj, leaf, flags[path])
        except Exception:  # noqa: BLE001
            failed.append(path)
    for name in _SDP:
        key = f"sdp.{name}"
        setter = getattr(torch.backends.cuda, f"enable_{name}_sdp", None)
        if key in flags and setter is not None:
            try:
                setter(bool(flags[key]))
            except Exception:  # noqa: BLE001
                failed.append(key)
    try:
        torch.use_deterministic_algorithms(bool(flags.get("deterministic_algorithms", False)),
                                           warn_only=bool(flags.get("deterministic_warn_only", False)))
    except Exception:  # noqa: BLE001
        failed.append("deterministic_algorithms")
    if "default_dtype" in flags:
        try:
            torch.set_default_dtype(getattr(torch, str(flags["default_dtype"]).removeprefix("torch.")))
        except Exception:  # noqa: BLE001
            failed.append("default_dtype")
    if "num_threads" in flags:
        try:
            torch.set_num_threads(int(flags["num_threads"]))
        except Exception:  # noqa: BLE001
            failed.append("num_threads")
    return failed


#: Setters of global state that has no getter (names under ``torch._C``; dotted: in a submodule). The worker
#: replaces them (before its baselines) with pass-through wrappers that count calls, so a candidate changing
#: allocator settings is seen, or MKL's and oneDNN's verbose modes (process-wide; while on, every MKL call
#: times and prints itself: a 32×64×64 ``addmm`` 5.6 → 22.9 µs on the CI VM, red team 17).
_TRIPWIRES = ("_accelerator_setAllocatorSettings", "_cuda_changeCurrentAllocator", "_cuda_setMemoryFraction",
              "_set_default_mobile_cpu_allocator", "_verbose.mkl_set_verbose", "_verbose.mkldnn_set_verbose")
_TRIPPED: dict[str, int] = {}


def install_tripwires() -> list[str]:
    """Wrap the :data:`_TRIPWIRES` setters of ``torch._C`` (worker only); returns the names wrapped."""
    wrapped = []
    for name in _TRIPWIRES:
        *path, leaf = name.split(".")
        owner: Any = torch._C
        for part in path:
            owner = getattr(owner, part, None)
        original = getattr(owner, leaf, None)
        if original is None or getattr(original, "_tilesmith_tripwire", False):
            continue

        def wire(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            _TRIPPED[_name] = _TRIPPED.get(_name, 0) + 1
            return _original(*args, **kwargs)

        wire._tilesmith_tripwire = True  # type: ignore[attr-defined]
        setattr(owner, leaf, wire)
        wrapped.append(name)
    return wrapped


def state_snapshot(device: str) -> dict[str, Any]:
    """Flags plus the state that is not a numeric flag: grad mode, streams, allocator, environment, and the
    thread's interposition state (:func:`tilesmith.gate.modes.mode_state`: the dispatch- and function-mode stacks,
    autocast, the saved-tensors default hooks), which would make a wrapper and the original it is compared with
    wrong in the same way."""
    state = numeric_flags()
    state["grad_enabled"] = bool(torch.is_grad_enabled())
    state["inference_mode"] = bool(torch.is_inference_mode_enabled())
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING"):
        state[f"env.{var}"] = os.environ.get(var)
    if device.startswith("cuda"):
        index = torch.device(device).index or 0
        try:
            state["cuda.current_device"] = int(torch.cuda.current_device())
            state["cuda.current_stream"] = int(torch.cuda.current_stream(index).cuda_stream)
            state["cuda.default_stream"] = int(torch.cuda.default_stream(index).cuda_stream)
        except Exception:  # noqa: BLE001
            pass
        getter = getattr(torch._C, "_cuda_getAllocatorBackend", None)
        if getter is not None:
            try:
                state["cuda.allocator_backend"] = str(getter())
            except Exception:  # noqa: BLE001
                pass
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if fraction is not None:
            try:
                state["cuda.memory_fraction"] = float(fraction(index))
            except Exception:  # noqa: BLE001
                pass
    for name, count in _TRIPPED.items():
        state[f"called torch._C.{name}"] = count
    state.update(modes.mode_state())  # dispatch/function mode stacks, autocast, saved-tensors hooks
    state["sys.trace"] = sys.gettrace() is not None
    state["sys.profile"] = sys.getprofile() is not None
    state["threading.trace"] = getattr(threading, "_trace_hook", None) is not None
    state["threading.profile"] = getattr(threading, "_profile_hook", None) is not None
    return state


def diff_state(before: dict[str, Any], after: dict[str, Any]) -> dict[str, list[Any]]:
    """Keys whose value differs, as ``{key: [before, after]}``."""
    keys = set(before) | set(after)
    return {k: [before.get(k), after.get(k)] for k in sorted(keys) if before.get(k) != after.get(k)}


# Namespaces whose callables a candidate must not replace. Modules are looked up in sys.modules only
# (nothing is imported here), so a namespace absent at snapshot time is simply not watched.
_WATCHED_MODULES = (
    "builtins", "time", "os", "json", "gc", "threading", "random", "math",
    "torch", "torch.cuda", "torch.cuda.memory", "torch.cuda.streams", "torch.cuda.graphs", "torch.random",
    "torch.backends.cuda", "torch.backends.cudnn", "torch.nn.functional", "torch.serialization",
    "torch.testing", "torch.utils.benchmark",
    "torch._C", "torch._C._dynamo.guards", "torch._inductor.utils", "torch._inductor.codecache",
    "torch._inductor.async_compile", "torch._inductor.select_algorithm",
    "torch._inductor.runtime.triton_heuristics", "torch._inductor.runtime.benchmarking",
    "triton", "triton.testing", "triton.runtime.jit", "triton.compiler.compiler", "numpy",
)
#: (label, getter, whether added attributes count as a patch). Additions are tracked only where nothing
#: legitimate adds them; for the Inductor/Triton runtime classes only replaced attributes count.
_WATCHED_CLASSES: tuple[tuple[str, Callable[[], Any], bool], ...] = (
    ("torch.Tensor", lambda: torch.Tensor, True),
    ("torch._C.TensorBase", lambda: torch._C.TensorBase, True),
    ("torch.cuda.Event", lambda: torch.cuda.Event, True),
    ("torch.cuda.Stream", lambda: torch.cuda.Stream, True),
    ("torch.cuda.CUDAGraph", lambda: torch.cuda.CUDAGraph, False),
    ("CachingAutotuner", lambda: sys.modules["torch._inductor.runtime.triton_heuristics"].CachingAutotuner, False),
    ("JITFunction", lambda: sys.modules["triton.runtime.jit"].JITFunction, False),
    ("CompiledKernel", lambda: sys.modules["triton.compiler.compiler"].CompiledKernel, False),
)
#: Attributes Python itself caches on classes (pickling) — never a patch.
_IGNORED_ADDITIONS = {"__slotnames__"}


def identity_snapshot(extra: Iterable[tuple[str, dict[str, Any]]] = ()) -> dict[str, Any]:
    """``{"module.attr": obj}`` for every callable or class in the watched namespaces.

    The snapshot holds the objects themselves (not their ``id``), so a replaced function cannot hide
    behind a recycled id. ``extra`` adds ``(label, namespace_dict)`` pairs (the worker's own globals,
    the trusted modules' globals). Class namespaces record every attribute plus their attribute count
    (a method added to ``torch.Tensor`` is a patch too); module namespaces record callables only.
    """
    objs: dict[str, Any] = {}
    for name in _WATCHED_MODULES:
        module = sys.modules.get(name)
        if module is None:
            continue
        objs[f"sys.modules[{name}]"] = module
        try:
            items = list(vars(module).items())
        except TypeError:
            continue
        for attr, value in items:
            if callable(value) and not isinstance(value, type(sys)):
                objs[f"{name}.{attr}"] = value
    for label, getter, additions in _WATCHED_CLASSES:
        try:
            cls = getter()
        except Exception:  # noqa: BLE001
            continue
        for attr, value in list(vars(cls).items()):
            objs[f"{label}.{attr}"] = value
        if additions:
            objs[f"{label}.<attributes>"] = _Names(set(vars(cls)) - _IGNORED_ADDITIONS)
    for label, namespace in extra:
        for attr, value in list(namespace.items()):
            if callable(value) and not isinstance(value, type(sys)):
                objs[f"{label}.{attr}"] = value
    objs["sys.gettrace()"] = sys.gettrace()
    objs["sys.getprofile()"] = sys.getprofile()
    return objs


class _Names(frozenset):
    """A class's attribute names inside an identity snapshot (compared by value, not identity)."""


_MISSING = object()


def diff_identities(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Names whose object changed or disappeared (new module attributes are ignored: lazy imports add them)."""
    changed = []
    for key, value in before.items():
        now = after.get(key, _MISSING)
        if isinstance(value, _Names):
            if isinstance(now, _Names) and now != value:
                cls = key.removesuffix(".<attributes>")
                changed += [f"{cls}.{name} (added)" for name in sorted(now - value)]
                changed += [f"{cls}.{name} (removed)" for name in sorted(value - now)]
        elif now is not value:
            changed.append(key)
    return sorted(changed)


def wrapper_namespaces(source: str) -> list[str]:
    """Dotted names of the namespaces a wrapper's source uses, for the worker's attribute snapshot
    (:mod:`tilesmith.gate.sidefx`): every imported module (``import triton.language``), every name imported
    from one (``from torch._inductor.select_algorithm import extern_kernels`` gives
    ``torch._inductor.select_algorithm`` and ``torch._inductor.select_algorithm.extern_kernels``; the worker
    watches a name only when it resolves to a module or a namespace object), and every ``torch.ops.<ns>`` it
    reaches. Source that does not parse gives ``[]`` (the worker then watches its fixed list only)."""
    import ast

    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    names: dict[str, None] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.name] = None
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names[node.module] = None
            for alias in node.names:
                if alias.name != "*":
                    names[f"{node.module}.{alias.name}"] = None
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "ops" and isinstance(node.value.value, ast.Name) and node.value.value.id == "torch":
            names[f"torch.ops.{node.attr}"] = None
    return list(names)
