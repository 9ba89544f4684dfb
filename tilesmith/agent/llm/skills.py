"""Trusted skills: Markdown files the user adds to the LLM agent's system prompt (``TILESMITH_SKILLS``).

* ``TILESMITH_SKILLS`` set: its paths (``os.pathsep``-separated; a folder stands for its ``SKILL.md``), every one
  must be a readable file; ``TILESMITH_SKILLS=""`` means no skills.
* unset: :data:`DEFAULT_SKILL_PATHS` (tilesmith-ai 0.1.4's default list, under the user's home), those that exist.
* all skills together at most :data:`MAX_SKILL_BYTES` (8 MiB, 0.1.4's cap).

Skill text goes into the system prompt, so it reaches the private proxy (and the model behind it) and nothing
else: the track's ``track.json`` lists skills by :attr:`Skill.name` and :attr:`Skill.sha256` only, and per-turn
traces (``TILESMITH_DEBUG``) show a placeholder instead of the text (:meth:`Skill.placeholder`).

Errors: :class:`~tilesmith.errors.SettingsError` naming ``TILESMITH_SKILLS``, the path and the remedy.
``tilesmith.compile`` reads the skills once up front, so a bad value fails there.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tilesmith import settings
from tilesmith.errors import SettingsError

MAX_SKILL_BYTES = 8 * 1024 * 1024
"""Bytes of all skills together (tilesmith-ai 0.1.4's ``MAX_SKILL_BYTES``)."""

DEFAULT_SKILL_PATHS = (
    "~/.codex/skills/check-normal/SKILL.md",
    "~/.codex/skills/high-performance-triton/SKILL.md",
    "~/Documents/kernel-design-agents/skills/KernelWiki/SKILL.md",
    "~/.codex/skills/high-performance-cuda/SKILL.md",
    "~/.codex/skills/high-performance-cuda/references/core-principles.md",
    "~/.codex/skills/high-performance-cuda/references/autotuning-and-benchmarking.md",
    "~/.codex/skills/high-performance-cuda/references/numerical-correctness.md",
    "~/.codex/skills/high-performance-cuda/references/triton-and-codegen.md",
)
"""Read when ``TILESMITH_SKILLS`` is unset, in this order, skipping files that do not exist (0.1.4's list)."""


@dataclass(frozen=True)
class Skill:
    """One loaded skill. ``name``: ``<parent folder>/<file name>``; ``sha256``: of the file's bytes."""

    name: str
    sha256: str
    size: int
    text: str

    def metadata(self) -> dict[str, object]:
        """What ``track.json`` records (never the text or the full path)."""
        return {"name": self.name, "sha256": self.sha256, "bytes": self.size}

    def placeholder(self) -> str:
        """What traces show instead of the text."""
        return f"[skill {self.name} sha256={self.sha256[:16]} ({self.size} bytes), text not recorded]"


def _home(environ: Mapping[str, str]) -> Path:
    home = environ.get("HOME")
    return Path(home) if home else Path.home()


def _expand(path: str, environ: Mapping[str, str]) -> Path:
    if path == "~" or path.startswith("~/"):
        return _home(environ) / path[2:]
    return Path(path)


def skill_paths(environ: Mapping[str, str] | None = None) -> tuple[tuple[Path, ...], bool]:
    """``(paths, explicit)``: the files to read and whether ``TILESMITH_SKILLS`` named them."""
    env = os.environ if environ is None else environ
    if "TILESMITH_SKILLS" in env:
        raw = settings.get("TILESMITH_SKILLS", dict(env))
        paths = []
        for entry in raw:
            path = _expand(entry, env)
            paths.append(path / "SKILL.md" if path.is_dir() else path)
        return tuple(paths), True
    return tuple(p for p in (_expand(d, env) for d in DEFAULT_SKILL_PATHS) if p.is_file()), False


def load_skills(environ: Mapping[str, str] | None = None) -> tuple[Skill, ...]:
    """Read the skills (module docstring) and return them in order.

    Raises:
        SettingsError: a ``TILESMITH_SKILLS`` path is not a readable regular file (or not UTF-8), or the skills
            together exceed :data:`MAX_SKILL_BYTES`.
    """
    paths, explicit = skill_paths(environ)
    skills: list[Skill] = []
    total = 0
    for path in paths:
        try:
            if not path.is_file():
                raise OSError("not a regular file")
            size = path.stat().st_size
            if total + size > MAX_SKILL_BYTES:
                raise SettingsError(f"TILESMITH_SKILLS: the skills exceed {MAX_SKILL_BYTES} bytes in all at {path} "
                                    f"({total + size} bytes). Remedy: list fewer or shorter skill files.")
            data = path.read_bytes()[:MAX_SKILL_BYTES - total + 1]
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            where = "TILESMITH_SKILLS" if explicit else "default skill"
            raise SettingsError(f"{where}: cannot read skill {path} ({exc}). Remedy: fix the path in "
                                "TILESMITH_SKILLS, or set TILESMITH_SKILLS='' for no skills.") from None
        total += len(data)
        if total > MAX_SKILL_BYTES:  # the file grew after stat()
            raise SettingsError(f"TILESMITH_SKILLS: the skills exceed {MAX_SKILL_BYTES} bytes in all at {path}. "
                                "Remedy: list fewer or shorter skill files.")
        skills.append(Skill(name=f"{path.parent.name}/{path.name}", sha256=hashlib.sha256(data).hexdigest(),
                            size=len(data), text=text))
    return tuple(skills)
