"""The attempt ring: ``attempts/attempt_00.py … attempt_04.py`` (docs/layout.md).

``attempt_00.py`` starts as the canonical Inductor wrapper (with the FX program as comments). Each new
turn writes the next slot with a copy of the most recently evaluated source; once all five slots exist,
the oldest is discarded and the others shift down, so ``attempt_04.py`` is then always the newest.
"""

from __future__ import annotations

import os
from pathlib import Path

CAPACITY = 5


class AttemptRing:
    """Five rolling attempt files in ``folder`` (created on first write)."""

    def __init__(self, folder: Path, capacity: int = CAPACITY):
        self.folder = Path(folder)
        self.capacity = capacity

    def path(self, slot: int) -> Path:
        return self.folder / f"attempt_{slot:02d}.py"

    def paths(self) -> list[Path]:
        """Existing attempt files, oldest first."""
        return [p for p in (self.path(i) for i in range(self.capacity)) if p.exists()]

    def newest(self) -> Path | None:
        existing = self.paths()
        return existing[-1] if existing else None

    def push(self, text: str) -> Path:
        """Write ``text`` as the newest attempt (shifting when full) and return its path."""
        self.folder.mkdir(parents=True, exist_ok=True)
        existing = self.paths()
        if len(existing) < self.capacity:
            target = self.path(len(existing))
        else:
            existing[0].unlink()
            for i in range(1, self.capacity):
                os.replace(self.path(i), self.path(i - 1))
            target = self.path(self.capacity - 1)
        _write_atomic(target, text)
        return target

    def slot_of(self, path: Path) -> int | None:
        try:
            return int(Path(path).stem.rsplit("_", 1)[1])
        except (IndexError, ValueError):
            return None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
