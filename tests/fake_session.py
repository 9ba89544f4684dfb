"""A test implementation of :class:`tilesmith.agent.protocol.Session` with a deterministic gate.

:class:`FakeSession` keeps the track layout of docs/layout.md (``attempts/attempt_00.py … _04.py``
ring, ``profiles/<eval-id>.json|.txt``, ``program.fx.txt``) in a temporary folder and answers
:meth:`FakeSession.evaluate` with :func:`marker_rule`: a source declares its own "speed" with a line
``# speed: <x>`` (default 1.0). Relative to the incumbent's speed ``s``: ``x >= s * 1.02`` is
accepted, ``x < s`` is ``rejected_slower``, in between ``rejected_marginal``; a ``# broken`` line is
``rejected_incorrect``. Sources identical to an earlier evaluated one are ``rejected_duplicate``
without running the rule, as the protocol requires.

Stop rule: ``loops`` accepted, ``max_turns`` turns used, or ``stop_after_s`` seconds.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from tilesmith.agent.protocol import StopOptimization
from tilesmith.records import CapturedGraph, CheckFailure, Diagnostic, TensorSpec, Timing, Verdict

RING = 5
_SPEED = re.compile(r"^#\s*speed:\s*([0-9.]+)\s*$", re.MULTILINE)

SAMPLE_WRAPPER = '''\
from torch._inductor.async_compile import AsyncCompile
async_compile = AsyncCompile()

triton_poi_fused_add_0 = async_compile.triton('triton_poi_fused_add_0', """
@triton.jit
def triton_poi_fused_add_0(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:]
    tmp0 = tl.load(in_ptr0 + (xindex), None)
    tl.store(out_ptr0 + (xindex), tmp0 + 1.0, None)
""")

triton_poi_fused_mul_1 = async_compile.triton('triton_poi_fused_mul_1', """
@triton.jit
def triton_poi_fused_mul_1(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:]
    tmp0 = tl.load(in_ptr0 + (xindex), None)
    tl.store(out_ptr0 + (xindex), tmp0 * 2.0, None)
""")

async_compile.wait(globals())
del async_compile

def call(args):
    arg0_1, = args
    args.clear()
    buf0 = empty_strided_cuda((1024, ), (1, ), torch.float32)
    stream0 = get_raw_stream(0)
    triton_poi_fused_add_0.run(arg0_1, buf0, 1024, stream=stream0)
    buf1 = empty_strided_cuda((1024, ), (1, ), torch.float32)
    triton_poi_fused_mul_1.run(buf0, buf1, 1024, stream=stream0)
    return (buf1, )
'''

SAMPLE_FX = ("graph():\n    %arg0_1 : [num_users=1] = placeholder[target=arg0_1]\n    %add : add(arg0_1, 1)\n"
             "    %mul : mul(add, 2)\n    return (mul,)\n")


def speed_of(source: str) -> float:
    match = _SPEED.search(source)
    return float(match.group(1)) if match else 1.0


def marker_rule(source: str, incumbent: str, min_improvement: float = 0.02) -> tuple[str, tuple[str, ...], float]:
    """``(status, reasons, speedup)`` for ``source`` against ``incumbent`` (see the module docstring)."""
    if re.search(r"^#\s*broken\s*$", source, re.MULTILINE):
        return "rejected_incorrect", ("output 0 differs from the original on the normal variant",), 1.0
    ratio = speed_of(source) / speed_of(incumbent)
    if ratio >= 1.0 + min_improvement:
        return "accepted", (), ratio
    if ratio < 1.0:
        return "rejected_slower", (f"candidate is slower: speedup {ratio:.3f}",), ratio
    return "rejected_marginal", (f"speedup {ratio:.3f} is below the required {1 + min_improvement:.2f}",), ratio


class FakeSession:
    """Session protocol implementation for tests (see the module docstring)."""

    def __init__(self, workspace: Path, *, source: str = SAMPLE_WRAPPER, fx_program: str = SAMPLE_FX,
                 agency: str = "medium", loops: int = 1, max_turns: int = 10, stop_after_s: float = 600.0,
                 graph_key: str = "ab" * 32,
                 rule: Callable[[str, str], tuple[str, tuple[str, ...], float]] | None = None,
                 on_evaluate: Callable[[str], None] | None = None) -> None:
        self.workspace = Path(workspace)
        self.graph_key = graph_key
        self.agency = agency
        self.loops = loops
        self.max_turns = max_turns
        self.stop_after_s = stop_after_s
        self.rule = rule or marker_rule
        self.on_evaluate = on_evaluate
        fx_comment = "".join(f"# {line}\n" for line in fx_program.splitlines())
        canonical = fx_comment + source
        self.graph = CapturedGraph(
            name="0_inference", kind="inference", source=canonical, canonical_source=canonical,
            fx_program=fx_program,
            inputs=(TensorSpec(shape=(1024,), stride=(1,), dtype="torch.float32", device="cpu"),),
            output_strides=(("1",),), mutated_input_idxs=(), inputs_to_check=(0,), device="cpu", inductor_key=None)
        (self.workspace / "attempts").mkdir(parents=True, exist_ok=True)
        (self.workspace / "profiles").mkdir(exist_ok=True)
        (self.workspace / "program.fx.txt").write_text(fx_program)
        (self.workspace / "attempts" / "attempt_00.py").write_text(canonical)
        self._slots = 1
        self._turns = 0
        self._accepted = 0
        self._incumbent = canonical
        self._last_evaluated = canonical
        self._seen: set[str] = {canonical}
        self._t0 = time.monotonic()
        self.verdicts: list[Verdict] = []
        self.notes: list[Diagnostic] = []
        self.evaluated_sources: list[str] = []
        self.proposers: list[str] = []

    # -- protocol -------------------------------------------------------------------------------
    @property
    def accepted_loops(self) -> int:
        return self._accepted

    @property
    def turns_used(self) -> int:
        return self._turns

    def stop_reason(self) -> str | None:
        if self._accepted >= self.loops:
            return "loops_done"
        if self._turns >= self.max_turns:
            return "max_turns"
        if time.monotonic() - self._t0 > self.stop_after_s:
            return "time_limit"
        return None

    def current_attempt(self) -> Path:
        return self.workspace / "attempts" / f"attempt_{self._slots - 1:02d}.py"

    def new_turn(self) -> Path:
        if self.stop_reason():
            raise StopOptimization(self.stop_reason())
        attempts = self.workspace / "attempts"
        if self._slots == RING:
            (attempts / "attempt_00.py").unlink()
            for i in range(1, RING):
                shutil.move(attempts / f"attempt_{i:02d}.py", attempts / f"attempt_{i - 1:02d}.py")
            self._slots -= 1
        path = attempts / f"attempt_{self._slots:02d}.py"
        path.write_text(self._last_evaluated)
        self._slots += 1
        self._turns += 1
        return path

    def evaluate(self, source: str | None = None, *, proposer: str, note: str = "") -> Verdict:
        text = self.current_attempt().read_text() if source is None else source
        if self.on_evaluate is not None:
            self.on_evaluate(text)
        self.evaluated_sources.append(text)
        self.proposers.append(proposer)
        eid = f"e{len(self.verdicts) + 1:04d}"
        report = self.workspace / "profiles" / f"{eid}.json"
        self._last_evaluated = text
        if text in self._seen:
            verdict = Verdict(False, "rejected_duplicate", ("identical to an earlier evaluated source",),
                              report_path=str(report), evaluation_id=eid)
        else:
            self._seen.add(text)
            status, reasons, ratio = self.rule(text, self._incumbent)
            failures = (CheckFailure("value_mismatch", reasons[0], output_index=0, variant="normal"),) \
                if status == "rejected_incorrect" else ()
            timing = None if failures else Timing("host_clock", 10, (1.0,) * 5, (1.0 / ratio,) * 5, ratio, ratio, ratio)
            verdict = Verdict(status == "accepted", status, reasons, failures, timing,
                              timing if status == "accepted" else None, str(report), eid)
            if verdict.accepted:
                self._accepted += 1
                self._incumbent = text
        report.write_text(json.dumps({"id": eid, "status": verdict.status, "reasons": list(verdict.reasons),
                                      "proposer": proposer, "note": note}))
        report.with_suffix(".txt").write_text(verdict.summary() + "\n")
        self.verdicts.append(verdict)
        return verdict

    def incumbent_source(self) -> str:
        return self._incumbent

    def note(self, kind: str, message: str) -> Diagnostic:
        diagnostic = Diagnostic(kind=kind, message=message, graph_key=self.graph_key, graph_name=self.graph.name)
        self.notes.append(diagnostic)
        return diagnostic

    def note_kinds(self) -> list[str]:
        return [d.kind for d in self.notes]
