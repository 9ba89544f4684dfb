"""Generator ``native_kernels``: replace a whole graph that one hand-written CUDA C++ kernel computes.

When the captured FX program is exactly one of the patterns :mod:`.native_match` recognizes (int8 decode
GEMV with scale/bias/residual, row softmax with pre-ops or the sum of two, residual + RMSNorm/LayerNorm,
GroupNorm (+ SiLU) over NCHW), the candidate keeps Inductor's module, its ``call(args)`` ABI, the argument unpacking and every
``assert_size_stride`` / ``assert_alignment`` of the body, and replaces the rest of the body with one call of
the native kernel (:mod:`tilesmith.kernels`) inside Inductor's device guard; the Triton kernels nothing
references any more are dropped from the module, so importing it compiles nothing. The extension is built
in this (the host) process before the candidate is proposed — once per machine, cached in Tilesmith's kernel
directory — and the candidate loads that build read-only with ``tilesmith.kernels.runtime.native_module``.

Not applicable (reason in the summary): CPU graphs, ``agency="low"``, ``TILESMITH_NATIVE_KERNELS=0``, no
pattern match (the matcher's reason), no CUDA toolchain. Skipped at proposal time: a failed build (the
build's diagnostic, with its log path), a wrapper of another shape (several devices, CUDA-graph partitions,
C++ wrapper, inputs or outputs that do not line up with the FX program).

Expected gain (ordering only; the gate measures what is installed): ``1 − predicted / eager_ms`` with
``predicted = bytes_moved / copy_bandwidth / EFFICIENCY + HOST_MS``; bytes from the FX annotations, the copy
bandwidth from :func:`tilesmith.roofline.measure_device_limits` (measured in this process), ``eager_ms`` from
the search worker's profile of the original; ``None`` without a profile.
"""

from __future__ import annotations

import ast
import hashlib
import logging
import re
from typing import Any

from tilesmith import settings
from tilesmith.agent.builtin.base import GraphContext, Proposal, Skip
from tilesmith.agent.builtin.native_match import NativePlan, NoMatch, match_program
from tilesmith.agent.builtin.wrapper_text import rewritable_entry, triton_kernels

log = logging.getLogger("tilesmith")

NAME = "native_kernels"
#: Fraction of the measured copy bandwidth the native kernels are assumed to reach (an estimate for ordering:
#: the issue's target is within 1.3x of the floor; bench/kernels.py measures the real figure).
EFFICIENCY = 0.8
#: Host cost of one native call in milliseconds (Python call, pybind11 dispatch, allocation, launch: ~6 µs,
#: an estimate).
HOST_MS = 0.006
BEGIN = "# ---- Tilesmith built-in agent, generator 'native_kernels' ----"
END = "# ---- end of generator 'native_kernels' ----"
_KEEP = ("assert_size_stride", "assert_alignment")


def native_source(source: str, plan: NativePlan, key: Any, *, device: str = "cuda:0",
                  input_count: int | None = None, allow_cpu: bool = False) -> str:
    """``source`` with the body of ``call`` replaced by the native call of ``plan``.

    Args:
        source: the incumbent wrapper (Inductor's, or an earlier accepted candidate).
        plan: what to call (from :func:`~tilesmith.agent.builtin.native_match.match_program`).
        key: the build's :class:`~tilesmith.kernels.build.BuildKey` (``family``, ``key``, ``arch``,
            ``nvcc_version``, ``torch_version``).
        device: the graph's device, for the device guard when the body has none.
        input_count: number of FX placeholders (checked against the unpacked arguments).
        allow_cpu: tests only: rewrite a CPU wrapper (the call then runs without a device guard).

    Raises:
        Skip: the wrapper's shape does not allow the rewrite (the message says which rule).
    """
    if BEGIN in source:
        raise Skip("the source already calls a native kernel")
    entry = rewritable_entry(source, partitions="the wrapper runs CUDA-graph partitions (mode='reduce-overhead')")
    names = entry.input_names
    if input_count is not None and len(names) != input_count:
        raise Skip(f"the body unpacks {len(names)} arguments, the FX program has {input_count} inputs")
    if entry.return_items is None or len(entry.return_items) != len(plan.returns):
        raise Skip(f"the body returns {len(entry.return_items or ())} values, the pattern {len(plan.returns)}")
    if any(a.input is not None and a.input >= len(names) for a in plan.args):
        raise Skip("the plan names an input the body does not unpack")
    cpu = not entry.device_indices and not device.startswith("cuda")
    if cpu and not allow_cpu:
        raise Skip("CPU graph: the native kernels are CUDA C++")
    index = None if cpu else entry.device_indices[0] if entry.device_indices else _device_index(device)
    tree = ast.parse(source)
    body = _body(tree, entry.form)
    lines = source.splitlines(keepends=True)
    first = body.body[0]
    indent = " " * first.col_offset
    kept = []
    for stmt in body.body:
        text = ast.get_source_segment(source, stmt) or ""
        is_unpack = (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Name) and stmt.value.id == "args")
        is_clear = text.strip() == "args.clear()"
        is_assert = (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
                     and ast.unparse(stmt.value.func) in _KEEP)
        if is_unpack or is_clear or is_assert:
            kept.append(indent + text.strip() + "\n")
    module = f"_tilesmith_native_{plan.family}"
    call_args = ", ".join(names[a.input] if a.input is not None else str(a.literal) for a in plan.args)
    inner = indent + "    " if index is not None else indent
    guard = [f"{indent}with torch.cuda._DeviceGuard({index}):\n", f"{inner}torch.cuda.set_device({index})\n"]
    new_body = kept + (guard if index is not None else []) + [
        f"{inner}# Tilesmith native kernel ({plan.family}.{plan.function}): {plan.description}\n",
        f"{inner}buf_native = {module}.{plan.function}({call_args})\n",
    ]
    used = sorted({names[a.input] for a in plan.args if a.input is not None}, key=names.index)
    if used:
        new_body.append(f"{inner}del {', '.join(used)}\n")
    items = ["buf_native" if r is None else f"buf_native[{r}]" for r in plan.returns]
    new_body.append(f"{indent}return ({', '.join(items)}, )\n")
    start, end = first.lineno - 1, body.end_lineno or first.lineno
    text = "".join(lines[:start] + new_body + lines[end:])
    text = _drop_unused_kernels(text)
    block = _import_block(plan, key, module)
    anchor = re.search(r"^class Runner\b" if entry.form == "runner" else r"^def call\(", text, re.MULTILINE)
    if anchor is None:  # pragma: no cover - parse_entry found the entry
        raise Skip("could not place the native import")
    return text[:anchor.start()] + block + text[anchor.start():]


def _device_index(device: str) -> int:
    match = re.fullmatch(r"cuda(?::(\d+))?", device)
    if not match:
        raise Skip(f"not a CUDA device: {device}")
    return int(match.group(1) or 0)


def _body(tree: ast.Module, form: str) -> ast.FunctionDef:
    if form == "runner":
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Runner")
        return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "call")
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "call")


def _drop_unused_kernels(text: str) -> str:
    """Remove ``async_compile.triton`` definitions no code references any more (with their comment block)."""
    for kernel in reversed(triton_kernels(text)):
        def_start = text.rfind("\n", 0, kernel.src_start) + 1
        def_end = text.find("\n", kernel.src_end)
        def_end = len(text) if def_end < 0 else def_end + 1
        if re.search(rf"\b{re.escape(kernel.var)}\b", text[:def_start] + text[def_end:]):
            continue
        cut = def_start  # the comment block directly above (kernel path, source nodes, graph fragment)
        while cut > 0:
            prev = text.rfind("\n", 0, cut - 1) + 1
            if not text[prev:cut].startswith("#"):
                break
            cut = prev
        while text.startswith("\n", def_end):
            def_end += 1
        text = text[:cut] + text[def_end:]
    return text


def _import_block(plan: NativePlan, key: Any, module: str) -> str:
    return (
        f"{BEGIN}\n"
        "# The whole call runs one hand-written CUDA C++ kernel instead of Inductor's kernels:\n"
        f"#   {plan.description}\n"
        f"# Source: tilesmith/kernels/csrc/{plan.family}.cu, built once per machine into Tilesmith's kernel\n"
        f"# directory (build {key.key[:16]}: {key.arch}, {key.nvcc_version}, torch {key.torch_version}) and\n"
        "# loaded here read-only; the module's Triton kernels that nothing calls any more were removed.\n"
        "from tilesmith.kernels.runtime import native_module\n"
        f"{module} = native_module({plan.family!r}, {key.key!r})\n"
        f"{END}\n\n\n"
    )


class NativeKernelGenerator:
    """Generator 4 (see the module docstring).

    ``build(family, device) -> Build`` replaces :func:`tilesmith.kernels.build.ensure_built` and ``limits`` the
    measured :class:`~tilesmith.roofline.DeviceLimits` (tests); with ``build`` set no toolchain is probed.
    """

    name = NAME

    def __init__(self, *, build: Any = None, limits: Any = None):
        self._build_fn = build
        self._limits = limits
        self._plans: dict[str, NativePlan | str] = {}

    def plan(self, ctx: GraphContext) -> NativePlan | str:
        """The graph's :class:`NativePlan`, or why it has none (memoized per FX program)."""
        digest = hashlib.sha256(ctx.fx_program.encode()).hexdigest()
        if digest not in self._plans:
            try:
                self._plans[digest] = match_program(ctx.fx_program) if ctx.fx_program else "no FX program"
            except NoMatch as exc:
                self._plans[digest] = str(exc)
        return self._plans[digest]

    def inapplicable(self, source: str, ctx: GraphContext) -> str | None:
        if not ctx.is_cuda:
            return "CPU graph: the native kernels are CUDA C++"
        if ctx.agency == "low":
            return "agency 'low' keeps the wrapper's structure (only launch configurations and cleanup)"
        try:
            enabled = settings.get("TILESMITH_NATIVE_KERNELS")
        except Exception:  # noqa: BLE001 - an invalid value is reported by settings.check_all at compile()
            enabled = True
        if not enabled:
            return "disabled by TILESMITH_NATIVE_KERNELS=0"
        plan = self.plan(ctx)
        if isinstance(plan, str):
            return f"no native kernel pattern ({plan})"
        if self._build_fn is None:
            from tilesmith.kernels.build import KernelBuildError, find_toolchain

            try:
                find_toolchain()
            except KernelBuildError as exc:
                return f"no toolchain to build the native kernels: {exc}"
        return None

    def expected_gain(self, source: str, ctx: GraphContext) -> float | None:
        plan = self.plan(ctx)
        profile = ctx.profile
        if isinstance(plan, str) or profile is None or not profile.eager_ms:
            return None
        limits = self._limits
        if limits is None:
            try:
                from tilesmith.roofline import measure_device_limits

                limits = self._limits = measure_device_limits(ctx.device)
            except Exception:  # noqa: BLE001 - no bandwidth, no estimate
                log.debug("tilesmith: native_kernels: device limits unavailable", exc_info=True)
                return None
        predicted = plan.bytes_moved / (limits.copy_gbps * 1e9) * 1e3 / EFFICIENCY + HOST_MS
        return max(0.0, 1.0 - predicted / profile.eager_ms)

    def propose(self, source: str, ctx: GraphContext) -> Proposal:
        plan = self.plan(ctx)
        if isinstance(plan, str):
            raise Skip(f"no native kernel pattern ({plan})")
        build = self._build(plan, ctx)
        count = _placeholder_count(ctx.fx_program)
        new = native_source(source, plan, build.key, device=ctx.device, input_count=count)
        how = (f"built in {build.seconds:.1f} s (first build on this machine)" if build.built
               else f"cached build loaded in {build.seconds * 1e3:.0f} ms")
        return Proposal(NAME, new, f"native CUDA C++ kernel {plan.family}.{plan.function} replaces the whole call: "
                                   f"{plan.description}; build {build.key.key[:12]} ({build.key.arch}) {how}")

    def _build(self, plan: NativePlan, ctx: GraphContext) -> Any:
        from tilesmith.kernels.build import KernelBuildError, ensure_built

        try:
            return (self._build_fn or ensure_built)(plan.family, ctx.device)
        except KernelBuildError as exc:
            raise Skip(f"native kernel build failed: {exc}") from None


def _placeholder_count(fx_program: str) -> int | None:
    from tilesmith.fx_text import FxTextError, parse_fx

    try:
        return len(parse_fx(fx_program).placeholders)
    except FxTextError:
        return None
