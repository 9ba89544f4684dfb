"""Generator ``config``: the same graph compiled again under a portfolio of Inductor configurations.

A user who can type ``mode="max-autotune"`` gets Inductor's best configuration for a *whole model*; the built-in
agent picks one *per graph*, and composes it with its own rewrites (a whole-call CUDA graph on top of a
max-autotune wrapper is ``mode="max-autotune"`` without CUDA-graph trees' per-call overhead). The variants
(:func:`portfolio`) are Inductor's own code: the search worker (:mod:`.config_screen`) compiles each one from the
FX graph :mod:`tilesmith.capture.fxgraph` serialized, warms it up (runtime autotuning and coordinate descent run
there), pins the launch configurations the autotuners chose, and screens it against the original — paired
rounds, alternating order. Only the most promising one or two then go to the gate (:mod:`.optimizer` ranks them
with the other generators' proposals by predicted time per call).

Options are read defensively: a patch key this torch's ``torch._inductor.config`` does not have is dropped in the
worker and named in the screen record (``dropped_options``); a variant with no option left fails with that
message. ``freezing`` is never proposed: it bakes parameter values into the wrapper, and a wrapper must read its
parameters at every call (the gate varies them and would reject it; it also changes the argument list).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tilesmith.agent.builtin import aten_wrapper

NAME = "config"

_GEMM = re.compile(r"aten\.(mm|addmm|bmm|baddbmm|convolution|_scaled_mm|_int_mm|_weight_int8pack_mm|"
                   r"_convolution)\b|extern_kernels\.(mm|addmm|bmm|baddbmm|convolution)\b")
_REDUCTION = re.compile(r"aten\.(sum|amax|amin|max|min|mean|var_mean|var|std|prod|argmax|argmin|_softmax|"
                        r"_log_softmax|native_layer_norm|native_group_norm|native_batch_norm|logsumexp|any|all|"
                        r"cumsum|norm|linalg_vector_norm|_native_batch_norm_legit_no_training)\b|triton_(red|per)_")
_KERNEL = re.compile(r"async_compile\.(triton|cpp_pybinding|cpp)\(")


@dataclass(frozen=True)
class Variant:
    """One Inductor configuration to compile the graph under: ``patches`` are ``torch._inductor.config`` keys
    (dotted for sub-configs, e.g. ``"triton.persistent_reductions"``) and values; ``why`` says what it is for."""

    name: str
    patches: tuple[tuple[str, Any], ...]
    why: str

    def request(self) -> dict[str, Any]:
        return {"name": self.name, "patches": dict(self.patches)}


@dataclass(frozen=True)
class VariantScreen:
    """What the search worker measured for one variant (times in ms per call, ``compile_s`` in seconds).

    ``status``: ``ok`` (compiled, correct on the screen inputs, timed), ``identical`` (the configuration produced
    the original wrapper), ``incorrect``, ``failed`` (compile or run raised: ``error``), ``skipped`` (the graph's
    time budget ran out first). ``ratio``: median over paired rounds of original time / variant time (> 1: the
    variant is faster). ``graph_ms``: per replay of the variant captured into one CUDA graph (CUDA only).
    ``source``: the canonical wrapper with the autotuned launch configurations pinned (``ok`` only).
    """

    name: str
    status: str
    patches: dict[str, Any] = field(default_factory=dict)
    compile_s: float | None = None
    ratio: float | None = None
    original_ms: float | None = None
    eager_ms: float | None = None
    graph_ms: float | None = None
    capture_error: str | None = None
    pinned_kernels: int = 0
    unpinned_kernels: int = 0
    screen_rel_l2: float | None = None
    dropped_options: tuple[str, ...] = ()
    error: str | None = None
    source: str | None = field(default=None, repr=False)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> VariantScreen:
        def num(key: str) -> float | None:
            value = data.get(key)
            return None if value is None else float(value)

        return cls(name=str(data.get("name", "?")), status=str(data.get("status", "failed")),
                   patches=dict(data.get("patches") or {}), compile_s=num("compile_s"), ratio=num("ratio"),
                   original_ms=num("original_ms"), eager_ms=num("eager_ms"), graph_ms=num("graph_ms"),
                   capture_error=data.get("capture_error"), pinned_kernels=int(data.get("pinned_kernels") or 0),
                   unpinned_kernels=int(data.get("unpinned_kernels") or 0), screen_rel_l2=num("screen_rel_l2"),
                   dropped_options=tuple(data.get("dropped_options") or ()), error=data.get("error"),
                   source=data.get("source"))

    def summary(self) -> dict[str, Any]:
        """The record without its source, for the track's screen report."""
        return {k: v for k, v in self.__dict__.items() if k != "source"}


def graph_features(fx_program: str, source: str) -> dict[str, Any]:
    """What decides which variants apply: matrix products/convolutions, reductions, number of kernels."""
    text = fx_program + "\n" + source
    return {"gemm": bool(_GEMM.search(text)), "reductions": bool(_REDUCTION.search(text)),
            "kernels": len(_KERNEL.findall(source))}


def portfolio(fx_program: str, source: str, device: str, agency: str) -> tuple[list[Variant], dict[str, str]]:
    """The variants to compile for this graph, in the order the worker compiles them (most promising first),
    and why each other variant does not apply.

    CUDA: ``max_autotune`` (``mode="max-autotune-no-cudagraphs"``: GEMM/conv templates — Triton, ATen, and
    CUTLASS where Inductor has it — with epilogue fusion, wider reduction/pointwise configurations, coordinate
    descent), ``coordinate_descent`` alone, the reduction variants (``no_persistent_reductions``,
    ``no_split_reductions``, ``multi_kernel``) where the graph reduces, ``combo_kernels`` where it has several
    kernels, and ``aten`` (:mod:`.aten_wrapper`: no Inductor kernel at all) unless the graph draws random numbers.
    CPU (test mode): ``cpp_wrapper`` (Inductor's C++ host wrapper) and, where the graph has matrix
    products, ``max_autotune`` (the C++ GEMM template) and both together.

    ``agency="low"`` keeps kernel boundaries: only ``coordinate_descent`` (pure tuning) remains.
    """
    feats = graph_features(fx_program, source)
    out: list[Variant] = []
    skipped: dict[str, str] = {}

    def add(name: str, patches: dict[str, Any], why: str, reason: str | None = None) -> None:
        if reason is None and agency == "low" and name != "coordinate_descent":
            reason = "agency 'low' keeps kernel boundaries (only coordinate-descent tuning)"
        if reason is None:
            out.append(Variant(name, tuple(patches.items()), why))
        else:
            skipped[name] = reason

    if device.startswith("cuda"):
        add("max_autotune", _mode("max-autotune-no-cudagraphs"),
            "mode max-autotune-no-cudagraphs: GEMM/conv templates, epilogue fusion, wider configurations")
        add("coordinate_descent", {"coordinate_descent_tuning": True}, "coordinate-descent launch tuning",
            None if feats["kernels"] else "no Triton kernels to tune")
        no_red = None if feats["reductions"] else "the graph has no reductions"
        add("no_persistent_reductions", {"triton.persistent_reductions": False},
            "looped instead of persistent reductions (long rows)", no_red)
        add("no_split_reductions", {"split_reductions": False}, "no split reductions", no_red)
        add("multi_kernel", {"triton.multi_kernel": 1},
            "persistent and looped reduction kernels, chosen by measurement at the first call", no_red)
        add("combo_kernels", {"combo_kernels": True}, "independent kernels launched as one",
            None if feats["kernels"] >= 2 else "fewer than two kernels")
        add(aten_wrapper.NAME, {aten_wrapper.MARKER: True},
            "the graph's ATen operations run one by one (ATen's kernels where they beat Inductor's)",
            aten_wrapper.applies(fx_program))
        skipped.setdefault("cpp_wrapper", "CUDA C++ wrappers load their kernels' cubins from Inductor's cache "
                                          "folder, outside the candidate: not proposed on CUDA")
    else:
        add("cpp_wrapper", {"cpp_wrapper": True}, "Inductor's C++ host wrapper (less Python per call)")
        gemm = None if feats["gemm"] else "the graph has no matrix products"
        add("max_autotune", _mode("max-autotune-no-cudagraphs"), "C++ GEMM template autotuning", gemm)
        add("max_autotune_cpp_wrapper", {**_mode("max-autotune-no-cudagraphs"), "cpp_wrapper": True},
            "C++ GEMM templates and the C++ host wrapper", gemm)
    return out, skipped


def _mode(mode: str) -> dict[str, Any]:
    try:
        import torch._inductor

        return dict(torch._inductor.list_mode_options(mode))
    except Exception:  # noqa: BLE001 - renamed or missing: the documented contents of that mode on torch 2.11
        return {"max_autotune": True, "coordinate_descent_tuning": True}


def write_screen_report(profiles_dir: Path | None, screens: tuple[VariantScreen, ...], *, skipped: dict[str, str],
                        chosen: list[str], original_ms: float | None, wall_s: float | None) -> Path | None:
    """``profiles/screen.json`` (+ ``.txt``): every variant tried, its screen numbers and what went to the gate.

    Returns the JSON path, or ``None`` when there is no folder or it cannot be written (never raises)."""
    if profiles_dir is None:
        return None
    data = {"format": 1, "generator": NAME, "original_ms": original_ms, "search_wall_s": wall_s,
            "variants": [s.summary() for s in screens], "not_applicable": skipped, "sent_to_gate": chosen}
    lines = [f"configuration screen (original {original_ms if original_ms is None else f'{original_ms:.4f}'} ms/call)"]
    for s in screens:
        ratio = "" if s.ratio is None else f" speedup {s.ratio:.3f}x"
        graph = "" if s.graph_ms is None else f", graph replay {s.graph_ms:.4f} ms"
        comp = "" if s.compile_s is None else f" compile {s.compile_s:.1f} s"
        lines.append(f"- {s.name}: {s.status}{ratio}{graph}{comp}{'; ' + s.error if s.error else ''}")
    lines += [f"- {name}: not applicable: {why}" for name, why in skipped.items()]
    lines.append(f"sent to the gate: {', '.join(chosen) or 'none'}")
    try:
        profiles_dir.mkdir(parents=True, exist_ok=True)
        path = profiles_dir / "screen.json"
        path.write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")
        (profiles_dir / "screen.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        return path
    except OSError:
        return None
