"""Version-tolerant access to torch/Inductor internals, in one place.

Everything here reads Inductor defensively (``getattr`` with defaults) so that a field renamed between
torch releases degrades to a diagnostic instead of an exception inside the user's model call. Tested on
torch 2.11.0 (the H200's version and the one CI pins).
"""

from __future__ import annotations

import functools
import os
from typing import Any


def versions() -> dict[str, str]:
    """torch / Triton / CUDA versions and the GPU name, as strings (``"none"`` when absent)."""
    import torch

    try:
        import triton

        triton_version = str(getattr(triton, "__version__", "unknown"))
    except Exception:  # noqa: BLE001 - Triton is optional on CPU-only machines
        triton_version = "none"
    gpu = "none"
    if torch.cuda.is_available():
        try:
            gpu = torch.cuda.get_device_name(0)
        except Exception:  # noqa: BLE001
            gpu = "unknown"
    return {
        "torch": str(torch.__version__),
        "triton": triton_version,
        "cuda": str(getattr(torch.version, "cuda", None) or "none"),
        "gpu": gpu,
    }


@functools.cache
def fast_cpu_isa_probe() -> bool:
    """Trust an already-built CPU vector-ISA probe instead of re-running it in a new Python process.

    Why: with ``TORCHINDUCTOR_VEC_ISA_OK=1`` torch 2.11 still verifies the AVX-512 sub-features (bf16,
    VNNI, AMX) by building a probe ``.so`` and loading it in a fresh ``python -c "import torch ..."``
    (``torch/_inductor/cpu_vec_isa.py::VecISA.check_build``): about 2 s each, ~12 s for the first CPU
    compile of every process, gate workers included. The probe library is cached in the Inductor cache
    dir; when it already exists (it is written only after a successful build) this shim answers "ok"
    without the subprocess. Applied only when ``TORCHINDUCTOR_VEC_ISA_OK=1`` (the user already asserted
    the ISA works), i.e. in tests and CPU test mode. Returns whether the shim is active.
    """
    if os.environ.get("TORCHINDUCTOR_VEC_ISA_OK") != "1":
        return False
    try:
        from torch._inductor import cpu_vec_isa
        from torch._inductor.codecache import write
        from torch._inductor.cpp_builder import CppBuilder, CppTorchOptions, normalize_path_separator
    except Exception:  # noqa: BLE001 - other torch versions: leave Inductor alone
        return False
    vec_isa = getattr(cpu_vec_isa, "VecISA", None)
    fingerprint = getattr(cpu_vec_isa, "_get_isa_dry_compile_fingerprint", None)
    original = getattr(vec_isa, "check_build", None)
    if vec_isa is None or fingerprint is None or original is None:
        return False

    def check_build(self: Any, code: str) -> bool:
        try:
            key, input_path = write(code, "cpp", extra=fingerprint(self._arch_flags))
            builder = CppBuilder(key, [input_path], CppTorchOptions(vec_isa=self, warning_all=False),
                                 os.path.dirname(input_path))
            if os.path.isfile(normalize_path_separator(builder.get_target_file_path())):
                return True
        except Exception:  # noqa: BLE001 - fall back to Inductor's own probe
            pass
        return original(self, code)

    vec_isa.check_build = check_build
    return True


def compiled_fx_graph_type() -> type | None:
    """``torch._inductor.output_code.CompiledFxGraph`` or ``None`` when this torch lacks it."""
    try:
        from torch._inductor.output_code import CompiledFxGraph
    except Exception:  # noqa: BLE001
        return None
    return CompiledFxGraph


def module_constants(compiled: Any, gm: Any | None = None) -> dict[str, Any]:
    """Module attributes Inductor passes when loading ``compiled``'s wrapper (constants, frozen params).

    Mirrors ``CompiledFxGraph.after_deserialization`` / ``_compile_to_module_lines`` on torch 2.11:
    ``CompiledFxGraphConstantsWithGm(gm).unwrap(out)`` with a graph module, else
    ``CompiledFxGraphConstants().unwrap(out)``; falls back to ``out.constants``.
    """
    try:
        from torch._inductor import output_code as oc

        if gm is not None and hasattr(oc, "CompiledFxGraphConstantsWithGm"):
            return dict(oc.CompiledFxGraphConstantsWithGm(gm).unwrap(compiled))
        if hasattr(oc, "CompiledFxGraphConstants"):
            return dict(oc.CompiledFxGraphConstants().unwrap(compiled))
    except Exception:  # noqa: BLE001
        pass
    return dict(getattr(compiled, "constants", None) or {})
