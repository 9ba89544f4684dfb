"""A fake :class:`tilesmith.agent.protocol.Session` for the built-in agent's loop tests.

It follows ``tilesmith.session.GraphSession``'s contract: ``new_turn`` copies the most recently evaluated
text (FX header included) into a new attempt file and raises ``StopOptimization`` once the stop rule is
set; ``evaluate`` reads the current attempt, answers ``rejected_duplicate`` for a text seen before and
otherwise asks ``decide(proposer, wrapper_text)`` for the verdict status; an accepted candidate becomes the
incumbent. Everything it saw is kept in ``evaluations`` and ``notes`` for assertions.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tilesmith.agent.protocol import StopOptimization
from tilesmith.capture.source import strip_fx_header, with_fx_header
from tilesmith.records import CapturedGraph, Diagnostic, TensorSpec, Verdict


def captured_graph(source: str, *, device: str = "cuda:0", mutated: tuple[int, ...] = (),
                   constants: tuple[str, ...] = ()) -> CapturedGraph:
    """A ``CapturedGraph`` around ``source`` (input specs are placeholders: the loop never reads them)."""
    spec = TensorSpec(shape=(4,), stride=(1,), dtype="torch.float32", device=device)
    return CapturedGraph(name="0_inference", kind="inference", source=source, canonical_source=source,
                         fx_program="graph():\n    return (x,)", inputs=(spec,), output_strides=(("1",),),
                         mutated_input_idxs=mutated, inputs_to_check=(), device=device, inductor_key=None,
                         constant_names=constants)


class FakeSession:
    """Session double; ``decide(proposer, text) -> status`` plays the gate."""

    def __init__(self, graph: CapturedGraph, workspace: Path, *, decide: Callable[[str, str], str],
                 loops: int = 1, agency: str = "medium", max_turns: int = 40):
        self.graph = graph
        self.graph_key = "ab" * 32
        self.workspace = workspace
        self.agency = agency
        self.loops = loops
        self.decide = decide
        self.max_turns = max_turns
        self.evaluations: list[tuple[str, str, str, str]] = []
        """(proposer, status, wrapper text, note) per evaluation."""
        self.notes: list[Diagnostic] = []
        self.incumbent: str | None = None
        self._turns = 0
        self._attempts: list[Path] = []
        self._last = with_fx_header(graph.fx_program, graph.canonical_source)
        self._seen = {graph.canonical_source.strip()}
        (workspace / "attempts").mkdir(parents=True, exist_ok=True)
        self._push(self._last)

    @property
    def accepted_loops(self) -> int:
        return sum(1 for e in self.evaluations if e[1] == "accepted")

    @property
    def turns_used(self) -> int:
        return self._turns

    def stop_reason(self) -> str | None:
        if self.accepted_loops >= self.loops:
            return f"loops_done: {self.accepted_loops} of {self.loops}"
        if self._turns >= self.max_turns:
            return f"turn_limit: {self._turns}"
        return None

    def current_attempt(self) -> Path:
        return self._attempts[-1]

    def new_turn(self) -> Path:
        reason = self.stop_reason()
        if reason:
            raise StopOptimization(reason)
        self._turns += 1
        return self._push(self._last)

    def evaluate(self, source: str | None = None, *, proposer: str, note: str = "") -> Verdict:
        text = self.current_attempt().read_text() if source is None else source
        wrapper = strip_fx_header(text)
        if wrapper.strip() in self._seen:
            status = "rejected_duplicate"
        else:
            status = self.decide(proposer, wrapper)
            self._seen.add(wrapper.strip())
        self._last = text
        self.evaluations.append((proposer, status, text, note))
        if status == "accepted":
            self.incumbent = wrapper
        return Verdict(accepted=status == "accepted", status=status, reasons=())  # type: ignore[arg-type]

    def incumbent_source(self) -> str:
        return self.incumbent if self.incumbent is not None else self.graph.canonical_source

    def note(self, kind: str, message: str) -> Diagnostic:
        diagnostic = Diagnostic(kind, message, self.graph_key, self.graph.name)
        self.notes.append(diagnostic)
        return diagnostic

    def _push(self, text: str) -> Path:
        path = self.workspace / "attempts" / f"attempt_{len(self._attempts):02d}.py"
        path.write_text(text)
        self._attempts.append(path)
        return path
