"""Scripted optimizers for tests: plug into the optimizer protocol like the real agents do."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Edit = Callable[[str], str]


@dataclass
class ScriptedFactory:
    """An ``OptimizerFactory`` whose optimizer applies ``edits`` in order, one turn each.

    Each edit maps the attempt text (FX header + wrapper) to a new text. The optimizer stops when the
    session's stop rule says so or the edits run out. ``sessions`` records every session it saw.
    """

    edits: list[Edit] = field(default_factory=list)
    name: str = "scripted"
    sessions: list[Any] = field(default_factory=list)
    verdicts: list[Any] = field(default_factory=list)
    closed: bool = False
    session_dir: str | None = None
    """When set, every session also leaves a file ``<graph key>.<pid>.<n>`` there, so that tests count
    sessions across processes (torchrun ranks)."""

    def for_graph(self, session: Any) -> ScriptedOptimizer:
        self.sessions.append(session)
        if self.session_dir is not None:
            import os
            from pathlib import Path

            folder = Path(self.session_dir)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{session.graph_key}.{os.getpid()}.{len(self.sessions)}").write_text(session.graph.name)
        return ScriptedOptimizer(self)

    def close(self) -> None:
        self.closed = True


class ScriptedOptimizer:
    name = "scripted"

    def __init__(self, factory: ScriptedFactory):
        self.factory = factory

    def optimize(self, session: Any) -> None:
        for edit in self.factory.edits:
            if session.stop_reason():
                return
            path = session.new_turn()
            path.write_text(edit(path.read_text()))
            self.factory.verdicts.append(session.evaluate(proposer="scripted"))


def replace_once(old: str, new: str) -> Edit:
    """An edit replacing the first ``old`` by ``new``; fails loudly when ``old`` is absent."""

    def edit(text: str) -> str:
        assert old in text, f"{old!r} not in the attempt"
        return text.replace(old, new, 1)

    return edit


def comment(marker: str) -> Edit:
    """A harmless edit: append a comment line (changes the text, not the behaviour)."""
    return lambda text: text + f"\n# {marker}\n"
