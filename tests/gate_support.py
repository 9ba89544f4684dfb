"""Helpers for the gate tests: capture real Inductor wrappers of small models and build GateProblems.

A model is compiled with ``torch.compile`` through ``compile_fx`` with an ``inner_compile`` hook (the
same interception point as the capture stage, tilesmith/capture/backend.py); the hook keeps the
``CompiledFxGraph`` and records the argument list of its first real call. The result is what the
pipeline hands the gate: a :class:`~tilesmith.records.CapturedGraph`, the first call's inputs (as
``inputs.pt`` in a snapshot folder) and the original callable as the trusted reference.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable

import torch

from tilesmith.capture.graph import static_inputs
from tilesmith.records import CapturedGraph, ScalarSpec, TensorSpec

os.environ.setdefault("TILESMITH_ALLOW_CPU", "1")


def fast_probe() -> None:
    try:
        from tilesmith import _compat

        getattr(_compat, "fast_cpu_isa_probe", lambda: None)()
    except ImportError:
        pass


@dataclass
class Captured:
    graph: CapturedGraph
    ref_fn: Callable[[list[Any]], Any]
    inputs: list[Any]
    constants: dict[str, Any] = field(default_factory=dict)

    @property
    def source(self) -> str:
        return self.graph.source


def _clone(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    from tilesmith.gate.inputs import clone_layout

    return clone_layout(value.detach())


def _device_of(args: list[Any]) -> str:
    for a in args:
        if isinstance(a, torch.Tensor) and a.device.type == "cuda":
            return f"cuda:{a.device.index or 0}"
    return "cpu"


def capture(model: Any, *args: torch.Tensor, grad: bool = False) -> list[Captured]:
    """Compile ``model`` and call it once; returns every CompiledFxGraph with its first call's inputs."""
    fast_probe()
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._inductor.output_code import CompiledFxGraph

    found: list[Captured] = []

    def inner(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        out = compile_fx_inner(gm, example_inputs, **kwargs)
        if not isinstance(out, CompiledFxGraph):
            return out
        original = out.current_callable
        record: list[Any] = []
        kind = "backward" if kwargs.get("is_backward") else ("inference" if kwargs.get("is_inference") else "forward")
        source = out.source_code
        static = static_inputs(kwargs, list(example_inputs))  # inside inner_compile: Inductor's config applies
        match = re.search(r"# AOT ID: \['([^']+)'\]", source)

        def recorder(call_args: list[Any]) -> Any:
            if not record:
                record.extend(_clone(a) for a in call_args)
                specs = tuple(TensorSpec(tuple(a.shape), tuple(a.stride()), str(a.dtype), str(a.device),
                                         a.storage_offset()) if isinstance(a, torch.Tensor) else ScalarSpec(a)
                              for a in call_args)
                graph = CapturedGraph(
                    name=match.group(1) if match else f"{len(found)}_{kind}", kind=kind, source=source,
                    canonical_source=source, fx_program="", inputs=specs,
                    output_strides=tuple(None if s is None else tuple(str(x) for x in s) for s in out.output_strides),
                    mutated_input_idxs=tuple(sorted(out.mutated_input_idxs)),
                    inputs_to_check=tuple(out.inputs_to_check), device=_device_of(call_args),
                    inductor_key=out._fx_graph_cache_key, constant_names=tuple(sorted(out.constants)),
                    static_input_idxs=static)
                found.append(Captured(graph, original, record, dict(out.constants)))
            return original(call_args)

        out.current_callable = recorder
        return out

    def backend(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, inner_compile=inner)

    compiled = torch.compile(model, backend=backend)
    if grad:
        compiled(*args)
    else:
        with torch.no_grad():
            compiled(*args)
    torch._dynamo.reset()
    return found


def make_problem(cap: Captured, folder: Path, label: str | None = None, source: str | None = None) -> Any:
    """Write ``inputs.pt``/``constants.pt`` into ``folder`` (0700) and return the GateProblem."""
    from tilesmith.gate import GateProblem

    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    torch.save([_clone(v) for v in cap.inputs], folder / "inputs.pt")
    torch.save({k: _clone(v) for k, v in cap.constants.items()}, folder / "constants.pt")
    return GateProblem(label=label or f"deadbeef ({cap.graph.name})", graph=cap.graph, snapshot_dir=folder,
                       original_source=source or cap.graph.canonical_source)


# -- models used by the gate tests --------------------------------------------------------------------

class LinearLN(torch.nn.Module):
    """Linear → ReLU → residual → LayerNorm → +0.5: one extern addmm and one fused C++ kernel on CPU.

    The constant shift keeps the output non-zero when every input (weights included) is zero.
    """

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(d, d)
        self.ln = torch.nn.LayerNorm(d)
        with torch.no_grad():
            self.ln.weight.uniform_(0.5, 1.5)
            self.ln.bias.uniform_(-0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(torch.relu(self.lin(x)) + x) + 0.5


class LogScale(torch.nn.Module):
    """``log(x) * w + b``: NaN wherever x < 0, so the random variants exercise NaN positions."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(d) + 0.5)
        self.b = torch.nn.Parameter(torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x) * self.w + self.b


class Embed(torch.nn.Module):
    """Embedding lookup of int64 indices, scaled: integer inputs must stay valid in every variant."""

    def __init__(self, n: int = 50, d: int = 16) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(n, d)

    def forward(self, idx: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.emb(idx) * scale


class Chain(torch.nn.Module):
    """``(x @ a) @ b`` with a tall x and a thin b: reassociating to ``x @ (a @ b)`` does ~50x fewer FLOPs."""

    def __init__(self, n: int = 768, k: int = 4) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(n, n) / n ** 0.5)
        self.b = torch.nn.Parameter(torch.randn(n, k) / n ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.a) @ self.b


def reassociate_chain(src: str) -> str:
    """Honest rewrite of Chain's wrapper: ``(x @ a) @ b`` → ``x @ (a @ b)`` (same math, ~n/k times fewer FLOPs).

    Inputs are told apart by their asserted shapes: a is [n, n], b is [n, k], x is [m, n] with m != n.
    """
    asserts = re.findall(r"^\s*(assert_size_stride\((\w+), \(([\d, ]+)\).*\))\s*$", src, re.M)
    shapes = {name: tuple(int(v) for v in dims.replace(" ", "").strip(",").split(",")) for _, name, dims in asserts}
    a = next(n for n, sh in shapes.items() if len(sh) == 2 and sh[0] == sh[1])
    b = next(n for n, sh in shapes.items() if n != a and sh[0] == shapes[a][0] and sh[1] < sh[0])
    x = next(n for n in shapes if n not in (a, b))
    m, k = shapes[x][0], shapes[b][1]
    alloc = "empty_strided_cuda" if "empty_strided_cuda" in src.split("args.clear()", 1)[1] else "empty_strided_cpu"
    lines = src.splitlines()
    start = next(i for i, line in enumerate(lines) if "args.clear()" in line) + 1
    end = next(i for i in range(start, len(lines)) if lines[i].strip().startswith("return ("))
    indent = lines[start][: len(lines[start]) - len(lines[start].lstrip())]
    body = [line for line, _, _ in asserts] + [
        f"buf_ab = {alloc}(({shapes[a][0]}, {k}), ({k}, 1), torch.float32)",
        f"extern_kernels.mm({a}, {b}, out=buf_ab)",
        f"buf_out = {alloc}(({m}, {k}), ({k}, 1), torch.float32)",
        f"extern_kernels.mm({x}, buf_ab, out=buf_out)",
        "return (buf_out, )"]
    lines[start: end + 1] = [indent + line.strip() for line in body]
    return "\n".join(lines) + "\n"


def runtime_checks_only(monkeypatch: Any) -> None:
    """Switch the host-side static scan off for the rest of a test (``monkeypatch`` is pytest's fixture).

    Cheats and faults written to exercise the worker's runtime checks (obfuscated names, ``getattr`` with
    concatenated names) are rejected early by the hardened static scan; with the scan off they reach the
    worker, so each runtime check keeps a regression test. Never used outside tests.
    """
    from tilesmith.gate.host import gate as gate_module

    monkeypatch.setattr(gate_module, "scan", lambda source: [])



def no_compile_caches() -> Any:
    """A context in which no FX graph or AOTAutograd cache hit happens: Inductor's ``inner_compile`` runs.

    Why: tests that read what ``inner_compile`` was passed (static_input_idxs, the FX module) would otherwise
    see an AOTAutograd cache hit on a second run over the same ``TORCHINDUCTOR_CACHE_DIR``, whose record has
    no inputs until the first real call."""
    import contextlib

    import torch

    stack = contextlib.ExitStack()
    stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False))
    stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
    return stack


def linear_ln_gate(root: Path, label: str, *, scan_off: bool = False, rows: int = 32, width: int = 64,
                   control: bool | None = None):
    """A CPU test-mode ``Gate`` on ``LinearLN`` (``rows``×``width`` fp32 input) under ``root``, for module-scoped
    fixtures: yields ``(gate, captured, root)`` and closes the gate after. ``scan_off``: the static scan passes every
    source, so a runtime check must stand on its own; ``control``: ``Gate.control`` (``None``: the gate's default)."""
    import pytest

    from tilesmith.gate import Gate

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TILESMITH_ALLOW_CPU", "1")
        mp.setenv("TILESMITH_GATE_RUN_TIMEOUT_S", "60")
        if scan_off:
            mp.setattr("tilesmith.gate.host.gate.scan", lambda source: [])
        torch.manual_seed(0)
        cap = capture(LinearLN(width), torch.randn(rows, width))[0]
        problem = make_problem(cap, root / "snapshot", label=label)
        gate = Gate(problem, reference=cap.ref_fn, profiles_dir=root / "profiles", timing_pairs=6)
        if control is not None:
            gate.control = control
        try:
            yield gate, cap, root
        finally:
            gate.close()


def evaluate_once(root: Path, label: str, make_source: Callable[[str], str], note: str, **gate_options: Any) -> Any:
    """One candidate (``make_source(original source)``) through a fresh :func:`linear_ln_gate` (``gate_options``:
    its keywords); returns the verdict."""
    from tilesmith.records import Candidate

    gen = linear_ln_gate(root, label, **gate_options)
    gate, cap, _ = next(gen)
    try:
        return gate.evaluate(Candidate(source=make_source(cap.source), proposer="redteam", note=note))
    finally:
        gen.close()


def chain_gate(chain: Captured, root: Path, label: str):
    """A CPU test-mode ``Gate`` on the captured :class:`Chain` under ``root`` (2 % threshold, 10 pairs), for
    module-scoped fixtures: yields the gate and closes it after."""
    from tilesmith.gate import Gate

    gate = Gate(make_problem(chain, root / "snapshot", label=label), reference=chain.ref_fn, min_improvement=0.02,
                profiles_dir=root / "profiles", timing_pairs=10)
    try:
        yield gate
    finally:
        gate.close()
