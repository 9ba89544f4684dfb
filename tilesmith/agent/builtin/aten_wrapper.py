"""The configuration generator's ``aten`` variant: the graph's own ATen operations, run one by one.

Inductor's generated kernel is not always the fastest choice for a graph, and a user can only get ATen's kernels
back by not compiling at all; the built-in agent can try them per graph, and the screen and the gate say whether
they pay. On the H200 (2026-12-04, docs/benchmarks/results-2026-12-04.md) eager PyTorch was the fastest arm end to
end on two cases: LayerNorm + residual over 32768×4096 bf16 (0.431 ms vs 0.439 ms for max-autotune-no-cudagraphs)
and ``x.permute(1, 0, 2).sum(1)`` over 2048×32×1024 fp32 (0.112 ms vs ≥ 0.150 ms in every mode). For the second,
the search worker timed Inductor's wrapper at 0.061 ms (at the 0.065 ms bandwidth floor), so that gap is per-call
overhead outside the wrapper, which this variant does not remove; whether the variant wins anywhere on the H200 has
not been measured yet.

:func:`wrapper_source` turns the FX graph Inductor received (post-AOTAutograd ATen IR, from
:mod:`tilesmith.capture.fxgraph`) into a wrapper module with Inductor's ``call(args)`` ABI whose body is the graph's
code as ``torch.fx`` prints it: ``torch.ops.aten.*`` calls, nothing else. It is screened like every other variant
(correct on the screen inputs, same output strides as the original, paired timing) and then judged by the gate.
Not produced for graphs with random operations (ATen's generator stream is not Inductor's, so the outputs would
differ) or whose code needs names other than ``torch``, ``device``, ``inf`` and ``nan``, or whose inputs are named like the
wrapper's own names.
"""

from __future__ import annotations

import re
from typing import Any

NAME = "aten"
#: Patch key that marks the ``aten`` variant in a variant request (never a ``torch._inductor.config`` option).
MARKER = "tilesmith.aten_ops"

_RANDOM = re.compile(r"\b(?:rand|randn|randint|randperm|rand_like|randn_like|randint_like|bernoulli|native_dropout|"
                     r"multinomial|normal|uniform|exponential|geometric|cauchy|log_normal|random|poisson|binomial|"
                     r"_standard_gamma|_sample_dirichlet|rrelu_with_noise|philox_rand|inductor_random|inductor_seeds|"
                     r"seed|seeds)(?:_|\b)")
_ALLOWED_GLOBALS = {"torch", "device", "inf", "nan"}
#: Names the generated module defines itself: a graph input of one of these names would shadow them.
_RESERVED = _ALLOWED_GLOBALS | {"call", "args", "_graph"}
HEADER = ("# Tilesmith built-in agent, configuration variant 'aten': the FX graph's ATen operations run one by one\n"
          "# (ATen's kernels; no Inductor-generated kernel). Same call(args) ABI as Inductor's wrapper.\n")


class NotApplicable(RuntimeError):
    """The graph cannot be run as plain ATen calls (the message says why)."""


def applies(fx_program: str) -> str | None:
    """``None`` when the variant applies to a graph whose FX program text is ``fx_program``, else why not."""
    if _RANDOM.search(fx_program):
        return "the graph draws random numbers (ATen's generator stream is not Inductor's)"
    return None


def wrapper_source(gm: Any) -> str:
    """The wrapper module source for FX ``GraphModule`` ``gm``.

    Raises:
        NotApplicable: the graph reads module attributes (``get_attr``), uses random operations, or its code
            needs globals other than ``torch``, ``device``, ``inf``, ``nan``.
    """
    graph = gm.graph
    if any(n.op in ("get_attr", "call_module") for n in graph.nodes):
        raise NotApplicable("the graph reads module attributes or calls submodules, which a wrapper cannot rebuild")
    params = [str(n.name) for n in graph.nodes if n.op == "placeholder"]
    clash = sorted(set(params) & _RESERVED)
    if clash:
        raise NotApplicable(f"graph inputs named {', '.join(clash)} would shadow the wrapper's own names")
    code = graph.python_code(root_module="self")
    extra = sorted(set(code.globals) - _ALLOWED_GLOBALS)
    used = [name for name in extra if re.search(rf"\b{re.escape(name)}\b", code.src)]
    if used:
        raise NotApplicable(f"the graph's code needs {', '.join(used)}")
    reason = applies(code.src)
    if reason:
        raise NotApplicable(reason)
    src = code.src.strip("\n")
    match = re.search(r"^def forward\(self(?:, )?(.*?)\):", src, re.M)
    if match is None or [p.strip() for p in match.group(1).split(",") if p.strip()] != params:
        raise NotApplicable("the graph's code has no forward(self, <its inputs>) function")
    body = src[match.end():].rstrip()
    unpack = (f"    {', '.join(params)}{',' if len(params) == 1 else ''} = args\n" if params else "")
    return (HEADER + "import torch\nfrom torch import device\n\ninf = float('inf')\nnan = float('nan')\n\n\n"
            f"def _graph({', '.join(params)}):{body}\n\n\n"
            "def call(args):\n" + unpack + "    args.clear()\n"
            f"    return _graph({', '.join(params)})\n")


def strides_differ(expected: Any, got: Any) -> str | None:
    """Why ``got``'s tensor outputs do not have ``expected``'s shapes and significant strides, or ``None``."""
    import torch

    exp = list(expected) if isinstance(expected, (list, tuple)) else [expected]
    out = list(got) if isinstance(got, (list, tuple)) else [got]
    if len(exp) != len(out):
        return f"{len(out)} outputs, the original has {len(exp)}"
    for i, (e, g) in enumerate(zip(exp, out)):
        if isinstance(e, torch.Tensor) and isinstance(g, torch.Tensor):
            if e.shape != g.shape:
                return f"output {i} has shape {list(g.shape)}, the original's is {list(e.shape)}"
            if any(size > 1 and a != b for size, a, b in zip(e.shape, e.stride(), g.stride())):
                return f"output {i} has strides {list(g.stride())}, the original's are {list(e.stride())}"
    return None
