"""Generator ``launch_config``: per-Triton-kernel launch-configuration search, pinned into the kernel source.

Mechanism (torch 2.11 ``torch/_inductor/runtime/triton_heuristics.py``): each Inductor kernel is decorated
with a heuristic (``pointwise``, ``reduction``, ``persistent_reduction``) that expands into a list of
``triton.Config`` s and autotunes among them at the first launch. The search and the pin both replace that
decorator, never the ``@triton.jit`` body:

- **search** (in a worker process on the graph's GPU, :mod:`tilesmith.agent.builtin.search_worker`): the
  decorator becomes ``triton_heuristics.cached_autotune(configs=[...])`` listing Inductor's own default
  configs, the configs Inductor itself would try under max-autotune (the same heuristic called with
  ``max_autotune=True``) and ``num_warps`` / block-size neighbours of the defaults, at most
  :data:`MAX_CONFIGS` per kernel. Inductor's ``CachingAutotuner.benchmark_all_configs`` times them on the
  kernel's real arguments (it clones in-place arguments, flushes L2 and reports the minimum, in ms).
- **pin** (the candidate): the decorator becomes ``triton_heuristics.fixed_config(config={...})``, Inductor's
  own "configuration already decided" path (``HeuristicType.FIXED``: no autotuning, no coordinate descent,
  no dynamic R-block scaling), for every kernel whose best measured configuration beats the best of
  Inductor's defaults by at least :data:`MIN_KERNEL_GAIN`.

Block sizes stay powers of two no larger than ``TRITON_MAX_BLOCK`` (Inductor's kernels may omit masks when a
size is a multiple of that maximum, which every such block then divides). "Persistent vs looped"
reductions: a looped (``triton_red_``) kernel is offered ``R0_BLOCK`` = the whole reduction (one loop
iteration, i.e. persistent behaviour) when Inductor's heuristics allow it; turning a persistent kernel into
a looped one needs Inductor codegen and is not done here. Skipped kernels: templates, user kernels,
foreach/combo/split-scan/cooperative and mix-order reductions, tiled (``y``) reductions, several reduction
dimensions, dynamic-shape kernels.
"""

from __future__ import annotations

import ast
import copy
from dataclasses import dataclass
from typing import Any

from tilesmith.agent.builtin.base import GraphContext, KernelTiming, Proposal, Skip
from tilesmith.agent.builtin.wrapper_text import KernelDef, kernel_function, triton_kernels

NAME = "launch_config"
TUNABLE = {"pointwise": "POINTWISE", "reduction": "REDUCTION", "persistent_reduction": "PERSISTENT_REDUCTION"}
#: Most configurations timed per kernel (Inductor's defaults are always kept).
MAX_CONFIGS = 16
#: A kernel is pinned only when its best configuration is this much faster than Inductor's best default.
MIN_KERNEL_GAIN = 0.03
#: ... and at least this many milliseconds faster (below it, timing noise dominates).
MIN_KERNEL_GAIN_MS = 0.0005
#: Largest XBLOCK*YBLOCK*R0_BLOCK tried beyond Inductor's own lists (register pressure; Inductor's persistent
#: reductions stop at 4096 elements, ``_persistent_reduction_configs``).
MAX_BLOCK_ELEMENTS = 8192
_MAX_GRID_Y = 65535  # CUDA gridDim.y limit


@dataclass(frozen=True)
class Decorator:
    """The heuristic decorator of one kernel source: kind, keyword texts and 1-based line span."""

    kind: str
    keywords: dict[str, str]
    first_line: int
    last_line: int


@dataclass(frozen=True)
class KernelPlan:
    """Configurations to time for one kernel; the first ``n_default`` are Inductor's defaults."""

    var: str
    kind: str
    configs: tuple[dict[str, Any], ...]
    n_default: int


def decorator_of(kernel_source: str) -> Decorator | None:
    """The ``@triton_heuristics.<kind>(...)`` decorator of ``kernel_source`` (``None`` if absent)."""
    fn = kernel_function(kernel_source)
    if fn is None:
        return None
    for dec in fn.decorator_list:
        if isinstance(dec, ast.Call) and ast.unparse(dec.func).startswith("triton_heuristics."):
            kind = ast.unparse(dec.func).split(".", 1)[1]
            keywords = {kw.arg: ast.get_source_segment(kernel_source, kw.value) or ast.unparse(kw.value)
                        for kw in dec.keywords if kw.arg}
            return Decorator(kind, keywords, dec.lineno, dec.end_lineno or dec.lineno)
    return None


def untunable_reason(kernel: KernelDef) -> str | None:
    """Why ``kernel`` is left alone (``None`` when its launch configuration can be searched)."""
    dec = decorator_of(kernel.source)
    if dec is None:
        return "no triton_heuristics decorator"
    if dec.kind not in TUNABLE:
        return f"@triton_heuristics.{dec.kind} kernels are not re-tuned"
    meta = dec.keywords.get("inductor_meta", "")
    for token, why in (("RSPLIT_SIZE", "mix-order reduction"), ("combo_grid_meta", "combo kernel"),
                       ("'native_matmul': True", "native matmul")):
        if token in meta or token in dec.keywords.get("triton_meta", ""):
            return why
    try:
        size_hints = ast.literal_eval(dec.keywords.get("size_hints", ""))
    except (ValueError, SyntaxError):
        return "size_hints is not a literal"
    if not isinstance(size_hints, dict) or "x" not in size_hints:
        return "unexpected size_hints"
    reductions = [k for k in size_hints if k.startswith("r")]
    if len(reductions) > 1:
        return "several reduction dimensions"
    if reductions and "y" in size_hints:
        return "tiled reduction"
    if not reductions and "z" in size_hints:
        return "3-D pointwise tiling"
    if any(p.startswith("ks") for p in kernel.params):
        return "dynamic-shape kernel"
    return None


def plan_search(source: str, max_configs: int = MAX_CONFIGS) -> tuple[list[KernelPlan], dict[str, str]]:
    """Plans for every tunable kernel of ``source`` and the reason each other kernel is skipped.

    Needs ``torch`` (Inductor's heuristics compute the default lists). Run it where the search runs: the
    defaults consult ``torch.cuda.is_available()``.
    """
    plans: list[KernelPlan] = []
    skipped: dict[str, str] = {}
    for kernel in triton_kernels(source):
        reason = untunable_reason(kernel)
        if reason is None:
            try:
                plans.append(plan_kernel(kernel, max_configs))
                continue
            except Exception as exc:  # noqa: BLE001 - an unexpected decorator shape: leave the kernel alone
                reason = f"could not compute configurations ({type(exc).__name__}: {exc})"
        skipped[kernel.var] = reason
    return plans, skipped


def plan_kernel(kernel: KernelDef, max_configs: int = MAX_CONFIGS) -> KernelPlan:
    """Inductor's default configs, then its max-autotune configs, then neighbours (module docstring)."""
    from torch._inductor.runtime import triton_heuristics

    dec = decorator_of(kernel.source)
    assert dec is not None
    kwargs = {k: _evaluate(v) for k, v in dec.keywords.items() if k != "filename"}
    heuristic = getattr(triton_heuristics, dec.kind)
    defaults = heuristic(**copy.deepcopy(kwargs), return_configs=True)
    wide = dict(copy.deepcopy(kwargs))
    wide["inductor_meta"] = {**wide.get("inductor_meta", {}), "max_autotune": True, "max_autotune_pointwise": True}
    broad = heuristic(**wide, return_configs=True)
    params = set(kernel.params)
    size_hints = kwargs["size_hints"]
    default_dicts = _unique([_as_dict(c, params) for c in defaults])
    extra: list[dict[str, Any]] = [_as_dict(c, params) for c in broad]
    for cfg in default_dicts:
        extra.extend(_neighbours(cfg, params))
    extra = [c for c in _unique(extra) if c not in default_dicts and _valid(c, size_hints, params)]
    budget = max(0, max_configs - len(default_dicts))
    return KernelPlan(kernel.var, dec.kind, tuple(default_dicts + extra[:budget]), len(default_dicts))


def search_source(source: str, plans: list[KernelPlan]) -> str:
    """``source`` with each planned kernel autotuning among its plan's configurations (search only)."""
    by_var = {p.var: p for p in plans}
    return _rewrite_kernels(source, {k.var: _search_decorator(k, by_var[k.var]) for k in triton_kernels(source)
                                     if k.var in by_var})


def pin_source(source: str, pins: dict[str, dict[str, Any]]) -> str:
    """``source`` with each kernel in ``pins`` (kernel variable → config dict) fixed to that configuration.

    Config dicts look like ``{"XBLOCK": 256, "num_warps": 4, "num_stages": 1}``. Kernels absent from
    ``pins`` and everything outside the decorators are left byte for byte.

    Raises:
        Skip: a pinned kernel is missing or has no tunable decorator.
    """
    kernels = {k.var: k for k in triton_kernels(source)}
    missing = sorted(set(pins) - set(kernels))
    if missing:
        raise Skip(f"kernels {missing} are not in the source")
    return _rewrite_kernels(source, {var: _pinned_decorator(kernels[var], cfg) for var, cfg in pins.items()})


def choose_pins(profile_kernels: dict[str, tuple[KernelTiming, ...]], min_gain: float = MIN_KERNEL_GAIN
                ) -> dict[str, tuple[dict[str, Any], float, float]]:
    """Kernels worth pinning: ``var -> (config, best default ms, best ms)``.

    A kernel qualifies when its fastest configuration is not one of Inductor's defaults and beats the
    fastest default by ``min_gain`` (fraction) and by :data:`MIN_KERNEL_GAIN_MS`.
    """
    chosen: dict[str, tuple[dict[str, Any], float, float]] = {}
    for var, timings in profile_kernels.items():
        finite = [t for t in timings if t.ms == t.ms and t.ms != float("inf") and t.ms > 0]
        defaults = [t for t in finite if t.default]
        if not finite or not defaults:
            continue
        best = min(finite, key=lambda t: t.ms)
        base = min(t.ms for t in defaults)
        if not best.default and best.ms <= base * (1.0 - min_gain) and base - best.ms >= MIN_KERNEL_GAIN_MS:
            chosen[var] = (dict(best.config), base, best.ms)
    return chosen


class LaunchConfigGenerator:
    """Generator 2 (see the module docstring). Needs the search worker's :class:`Profile`."""

    name = NAME

    def inapplicable(self, source: str, ctx: GraphContext) -> str | None:
        if not ctx.is_cuda:
            return "CPU graph: Triton launch configurations do not apply"
        if not triton_kernels(source):
            return "no Triton kernels in the wrapper"
        if ctx.profile is None:
            return f"no launch-configuration measurements ({ctx.profile_error or 'search not run'})"
        return None

    def expected_gain(self, source: str, ctx: GraphContext) -> float | None:
        """Kernel time saved by the pins, relative to the call time it can show in.

        A call runs at max(host time, GPU time). Once the call replays from a CUDA graph (an incumbent from
        the ``cudagraph`` generator) or when the profile says it is GPU-bound, saved kernel time is saved
        call time; while the host is the bottleneck (eager time well above graph-replay time), faster
        kernels hide behind launch overhead and the expected gain is 0.
        """
        profile = ctx.profile
        if profile is None or not profile.eager_ms:
            return None
        saved = sum(base - best for _, base, best in choose_pins(profile.kernels).values())
        gpu = profile.graph_ms if profile.graph_ms is not None else profile.eager_ms
        if "class _TilesmithCUDAGraphCall" in source:
            return saved / gpu if gpu > 0 else 0.0
        if profile.eager_ms > 1.05 * gpu:
            return 0.0
        return saved / profile.eager_ms

    def propose(self, source: str, ctx: GraphContext) -> Proposal:
        assert ctx.profile is not None
        chosen = choose_pins(ctx.profile.kernels)
        present = {k.var for k in triton_kernels(source)}
        chosen = {var: v for var, v in chosen.items() if var in present}
        if not chosen:
            measured = sum(1 for t in ctx.profile.kernels.values() if t)
            raise Skip(f"the search timed {measured} kernels and found no configuration at least "
                       f"{MIN_KERNEL_GAIN:.0%} faster than Inductor's defaults")
        new = pin_source(source, {var: cfg for var, (cfg, _, _) in chosen.items()})
        parts = [f"{var}: {_config_text(cfg)} ({base:.4f} -> {best:.4f} ms)"
                 for var, (cfg, base, best) in sorted(chosen.items())]
        return Proposal(NAME, new, f"pinned {len(chosen)} kernel launch configurations: " + "; ".join(parts))


# -- helpers ----------------------------------------------------------------------------------------
def _evaluate(text: str) -> Any:
    from torch._inductor.runtime.hints import AutotuneHint, DeviceProperties, ReductionHint, TileHint

    names = {"AutotuneHint": AutotuneHint, "DeviceProperties": DeviceProperties, "ReductionHint": ReductionHint,
             "TileHint": TileHint, "set": set, "True": True, "False": False, "None": None}
    return eval(text, {"__builtins__": {}}, names)  # noqa: S307 - Inductor-generated literals, no builtins


def _as_dict(cfg: Any, params: set[str]) -> dict[str, Any]:
    out = {k: v for k, v in dict(cfg.kwargs).items() if k in params or not k.endswith("BLOCK")}
    out["num_warps"] = int(cfg.num_warps)
    out["num_stages"] = int(cfg.num_stages)
    return out


def _unique(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    for cfg in configs:
        if cfg not in seen:
            seen.append(cfg)
    return seen


def _neighbours(cfg: dict[str, Any], params: set[str]) -> list[dict[str, Any]]:
    out = []
    for warps in (cfg["num_warps"] // 2, cfg["num_warps"] * 2):
        if 1 <= warps <= 16:
            out.append({**cfg, "num_warps": warps})
    for key in ("XBLOCK", "R0_BLOCK"):
        if key in cfg and key in params:
            for value in (cfg[key] // 2, cfg[key] * 2):
                if value >= 1:
                    out.append({**cfg, key: value})
    return out


def _valid(cfg: dict[str, Any], size_hints: dict[str, int], params: set[str]) -> bool:
    from torch._inductor.runtime.hints import TRITON_MAX_BLOCK

    elements = 1
    for key, value in cfg.items():
        if not key.endswith("BLOCK"):
            continue
        prefix = key[: -len("BLOCK")]
        hint = size_hints.get(prefix.lower(), 1)
        if value < 1 or value & (value - 1) or value > TRITON_MAX_BLOCK.get(prefix, 4096):
            return False
        if value > max(1, hint) or (hint == 1 and value != 1):
            return False
        elements *= value
    if "r0_" in size_hints and "R0_BLOCK" not in cfg:  # persistent reduction: the whole row per program
        elements *= size_hints["r0_"]
    if "YBLOCK" in cfg and -(-size_hints.get("y", 1) // cfg["YBLOCK"]) > _MAX_GRID_Y:
        return False
    return elements <= MAX_BLOCK_ELEMENTS and 32 * cfg["num_warps"] <= max(32, elements)


def _config_text(cfg: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in cfg.items())


def _triton_config_expr(cfg: dict[str, Any]) -> str:
    blocks = {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}
    return f"triton.Config({blocks!r}, num_warps={cfg['num_warps']}, num_stages={cfg['num_stages']})"


def _search_decorator(kernel: KernelDef, plan: KernelPlan) -> str:
    dec = decorator_of(kernel.source)
    assert dec is not None
    configs = "".join(f"        {_triton_config_expr(c)},\n" for c in plan.configs)
    meta = dec.keywords["inductor_meta"]
    return (
        "@triton_heuristics.cached_autotune(\n"
        f"    size_hints={dec.keywords['size_hints']},\n"
        f"    configs=[\n{configs}    ],\n"
        f"    triton_meta={dec.keywords['triton_meta']},\n"
        f"    inductor_meta={{**{meta}, 'autotune_local_cache': False, 'coordinate_descent_tuning': False, "
        "'dynamic_scale_rblock': False},\n"
        f"    heuristic_type=triton_heuristics.HeuristicType.{TUNABLE[dec.kind]},\n"
        "    filename=__file__,\n"
        ")"
    )


def _pinned_decorator(kernel: KernelDef, cfg: dict[str, Any]) -> str:
    dec = decorator_of(kernel.source)
    if dec is None or dec.kind not in TUNABLE:
        raise Skip(f"kernel {kernel.var} has no tunable heuristic decorator")
    return (
        f"# Tilesmith built-in agent, generator 'launch_config': launch configuration pinned after a measured\n"
        f"# search (Inductor's heuristic was @triton_heuristics.{dec.kind}).\n"
        "@triton_heuristics.fixed_config(\n"
        f"    config={dict(cfg)!r},\n"
        "    filename=__file__,\n"
        f"    triton_meta={dec.keywords['triton_meta']},\n"
        f"    inductor_meta={dec.keywords['inductor_meta']},\n"
        ")"
    )


def _rewrite_kernels(source: str, decorators: dict[str, str]) -> str:
    """Replace the heuristic decorator of each kernel in ``decorators`` (kernel var → new decorator text)."""
    pieces, pos = [], 0
    for kernel in triton_kernels(source):
        if kernel.var not in decorators:
            continue
        dec = decorator_of(kernel.source)
        if dec is None:
            raise Skip(f"kernel {kernel.var} has no heuristic decorator")
        lines = kernel.source.splitlines(keepends=True)
        new_kernel = "".join(lines[: dec.first_line - 1]) + decorators[kernel.var] + "\n" + "".join(lines[dec.last_line:])
        if "'''" in new_kernel or "\\" in decorators[kernel.var]:
            raise Skip(f"kernel {kernel.var}: the rewritten decorator cannot be embedded in the wrapper string")
        pieces.append(source[pos:kernel.src_start])
        pieces.append(new_kernel)
        pos = kernel.src_end
    pieces.append(source[pos:])
    return "".join(pieces)
