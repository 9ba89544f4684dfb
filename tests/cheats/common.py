"""Text helpers shared by the CPU and GPU cheat generators (they edit ``Runner.call`` of a wrapper)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from collections.abc import Callable

_UNPACK = re.compile(r"^[ \t]*((?:\w+, )*\w+),? = args[ \t]*$", re.M)
_RETURN = re.compile(r"^([ \t]*)return \((.*)\)[ \t]*$", re.M)


@dataclass(frozen=True)
class Cheat:
    """One cheating candidate: how to derive it, and the check id (or ids, ``|``-separated, when what the candidate
    returns depends on the allocator: any one of them) and status the gate must answer."""

    name: str
    graph: str
    make: Callable[[str], str]
    check: str
    status: str
    what: str


def arg_names(src: str) -> list[str]:
    match = _UNPACK.search(src)
    if not match:
        raise ValueError("no `... = args` line in the wrapper")
    return [a.strip() for a in match.group(1).split(",") if a.strip()]


def _call_return(src: str) -> re.Match[str]:
    """The return statement that ends ``call`` (the least-indented ``return (`` after ``args.clear()``)."""
    start = src.index("args.clear()")
    stop = src.find("\nrunner = ", start)
    matches = list(_RETURN.finditer(src, start, stop if stop != -1 else len(src)))
    if not matches:
        raise ValueError("no return line in call")
    least = min(len(m.group(1)) for m in matches)
    return [m for m in matches if len(m.group(1)) == least][-1]


def out_names(src: str) -> list[str]:
    return [a.strip() for a in _call_return(src).group(2).split(",") if a.strip()]


def body_indent(src: str) -> str:
    return _call_return(src).group(1)


def before_return(src: str, lines: list[str], new_return: str | None = None) -> str:
    """Insert ``lines`` before ``call``'s return; optionally replace the returned tuple text."""
    match = _call_return(src)
    indent = match.group(1)
    ret = f"{indent}return ({new_return if new_return is not None else match.group(2)})"
    block = "".join(f"{indent}{line}\n" for line in lines) + ret
    return src[: match.start()] + block + src[match.end():]


def after_clear(src: str, lines: list[str]) -> str:
    """Insert ``lines`` right after ``args.clear()`` (same indentation)."""
    i = src.index("args.clear()")
    line_start = src.rfind("\n", 0, i) + 1
    indent = src[line_start:i]
    end = src.index("\n", i) + 1
    return src[:end] + "".join(f"{indent}{line}\n" for line in lines) + src[end:]


def replace_body(src: str, lines: list[str]) -> str:
    """Replace everything between ``args.clear()`` and the return (inclusive) with ``lines``."""
    i = src.index("args.clear()")
    end = src.index("\n", i) + 1
    match = _call_return(src)
    indent = match.group(1)
    return src[:end] + "".join(f"{indent}{line}\n" for line in lines) + src[match.end() + 1:]


def with_kernel(src: str, kernel: str) -> str:
    """``kernel`` (a kernel definition such as ``name = async_compile.cpp_pybinding(...)``) placed just before the
    wrapper's ``async_compile.wait(globals())``, where Inductor's own kernels are defined."""
    wait = "async_compile.wait(globals())"
    return src.replace(wait, kernel + wait, 1)


#: C statements that finish row ``i`` of the ``LinearLN`` test graph (``LayerNorm(relu(x @ W.T + b) + x) + 0.5``, eps
#: 1e-5) from ``acc[D]`` (that row of ``x @ W.T + b``) into ``o``, given ``x``, ``g`` and ``be``: the red-team kernels
#: that compute the graph natively share it.
LINEAR_LN_ROW_C = """
            double mean = 0, var = 0, h[D];
            for (int j = 0; j < D; ++j) { h[j] = (acc[j] > 0 ? acc[j] : 0) + x[i * D + j]; mean += h[j]; }
            mean /= D;
            for (int j = 0; j < D; ++j) var += (h[j] - mean) * (h[j] - mean);
            double rstd = 1.0 / sqrt(var / D + 1e-5);
            for (int j = 0; j < D; ++j) o[i * D + j] = (float)((h[j] - mean) * rstd * g[j] + be[j] + 0.5);"""


def linear_ln_native(src: str, kernel: str, name: str, d: int, m: int, **fill: str) -> str:
    """The ``LinearLN`` wrapper (``m``×``d``) whose call is one native kernel ``name(w, b, x, g, be, out)`` defined by
    ``kernel`` (``@D@``, ``@M@``, ``@LN_ROW@`` (:data:`LINEAR_LN_ROW_C`) and ``@KEY@`` for each ``fill`` key filled)."""
    for key, value in {"D": str(d), "M": str(m), "LN_ROW": LINEAR_LN_ROW_C, **fill}.items():
        kernel = kernel.replace(f"@{key}@", value)
    return replace_body(with_kernel(src, kernel), [f"buf4 = empty_strided_cpu(({m}, {d}), ({d}, 1), torch.float32)",
                                                   f"{name}(arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, buf4)",
                                                   "return (buf4, )"])


def module_code(src: str, code: str) -> str:
    """Top-level code just before ``class Runner`` (it runs when the module is imported)."""
    i = src.index("class Runner")
    return src[:i] + code.strip("\n") + "\n\n\n" + src[i:]
