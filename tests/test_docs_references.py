"""Docs and docstrings cite only what exists: every file they name is in the repository, every relative
Markdown link resolves, and nothing points at a document that is not shipped (the project spec, research
notes, a machine-local path). Public sources are cited by URL, which this check leaves alone.

The check is pattern based: a ``*.md`` name anywhere, and a path that starts with one of the repository's
top-level folders (``tilesmith/...``, ``docs/...``, ``tests/...``), must exist; paths of other projects
(``torch/_inductor/graph.py``, CLIProxyAPI's ``cmd/server/main.go``) do not start with one and are skipped.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOP = ("tilesmith", "docs", "tests", "bench", "examples", "scripts", "constraints")
SKIP_DIRS = {"fixtures", "__pycache__"}

URL = re.compile(r"(?:https?://|file://|(?<![\w/.-])(?:www\.)?(?:github\.com|[\w-]+\.(?:com|org|io|ai|dev|net|html)/))"
                 r"[^\s)>\]`'\"]*")
MD_NAME = re.compile(r"(?<![\w./-])((?:\.{1,2}/)?[\w.-]+(?:/[\w.-]+)*\.md)\b")
REPO_PATH = re.compile(r"(?<![\w./<{*-])((?:%s)/[\w./-]*[\w/])" % "|".join(TOP))
NOT_PATHS = {"tilesmith/builtin", "tilesmith/bultin"}  # the built-in agent's model name, and a misspelling the API refuses
#: File names that are conventions, not files of this repository: a skill folder's SKILL.md (docs/agent.md).
NOT_FILES = {"SKILL.md"}
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
# Built from parts so that this file does not match its own patterns.
FORBIDDEN = {
    "spec " + "\u00a7": "the project spec is not in the repository: cite docs/*.md or the code instead",
    "/wo" + "rk/": "a machine-local path: cite a repository file or a public URL instead",
    "research" + "/": "research notes are not in the repository: cite the public source (URL) instead",
}


def _sources() -> list[Path]:
    files = [REPO / "README.md", REPO / "Makefile", REPO / "pyproject.toml"]
    for top in TOP:
        for path in sorted((REPO / top).rglob("*")):
            if path.is_file() and path.suffix in {".py", ".md", ".sh", ".toml", ".txt"} \
                    and not SKIP_DIRS & set(path.relative_to(REPO).parts):
                files.append(path)
    # This file's own examples of stale references are test data.
    return [f for f in files if f.is_file() and f != Path(__file__).resolve()]


def _basenames() -> set[str]:
    names = set()
    for top in TOP:
        names.update(p.name for p in (REPO / top).rglob("*") if p.is_file())
    names.update(p.name for p in REPO.iterdir() if p.is_file())
    return names


def _problems(path: Path, names: set[str], text: str | None = None) -> list[str]:
    """Stale references in ``path`` (its ``text`` when given: the file need not exist)."""
    text = path.read_text(encoding="utf-8", errors="replace") if text is None else text
    rel = path.relative_to(REPO)
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for needle, why in FORBIDDEN.items():
            if needle in line:
                out.append(f"{rel}:{lineno}: {needle!r}: {why}")
        bare = URL.sub(" ", line)
        for m in MD_NAME.finditer(bare):
            ref = m.group(1)
            if ref in NOT_FILES or (rel.parts[0] == "tests" and path.suffix == ".py" and "/" not in ref):
                continue  # a convention, or a file a test makes in its temporary folder
            if "/" in ref:
                ok = (REPO / ref).exists() or (path.parent / ref).exists() or ref.split("/")[0] not in TOP + (".", "..")
                ok = ok and not (ref.split("/")[0] in (".", "..") and not (path.parent / ref).exists())
            else:
                ok = ref in names
            if not ok:
                out.append(f"{rel}:{lineno}: cites {ref}, which is not in the repository")
        for m in REPO_PATH.finditer(bare):
            ref = m.group(1).rstrip(".")
            following = bare[m.end():m.end() + 1]
            if ref in NOT_PATHS or ref.endswith(".md") or following in ("*", "<", "{"):
                continue  # a model name, an .md name (checked above), or a pattern such as tests/test_gate_*.py
            if not (REPO / ref).exists():
                out.append(f"{rel}:{lineno}: names {ref}, which is not in the repository")
        if path.suffix == ".md":
            for m in MD_LINK.finditer(line):
                target = m.group(1).split("#")[0]
                if target and not re.match(r"^[a-z]+:", target) and not (path.parent / target).exists():
                    out.append(f"{rel}:{lineno}: link ({target}) does not resolve from {rel.parent}/")
    return out


def test_docs_and_docstrings_cite_only_files_in_the_repository():
    names = _basenames()
    problems = [p for f in _sources() for p in _problems(f, names)]
    assert not problems, "stale references:\n" + "\n".join(problems)


@pytest.mark.parametrize(("line", "expected"), [
    ("see anchors" + ".md §5", "cites anchors.md"),
    ("(research" + "/inductor.md §2)", "research notes"),
    ("``tilesmith/gate/nope.py``", "names tilesmith/gate/nope.py"),
    ("[x](docs/missing.md)", "link (docs/missing.md)"),
    ("(spec " + "\u00a7" + "3)", "project spec"),
])
def test_the_check_catches_each_kind_of_stale_reference(line, expected):
    problems = _problems(REPO / "tests" / "probe.md", _basenames(), text=line)
    assert any(expected in p for p in problems), problems


def test_the_check_leaves_urls_and_other_projects_paths_alone():
    text = ("torch/_inductor/graph.py, cmd/server/main.go, https://github.com/x/y/blob/main/NOTES.md, "
            "github.com/x/y/OTHER.md, docs/gate.md, tilesmith/gate/host/stats.py, [gate](../docs/gate.md)")
    assert _problems(REPO / "tests" / "probe.md", _basenames(), text=text) == []


def test_cli_doc_states_the_doctor_settings_count_and_model_severity():
    """docs/cli.md's sample `doctor` output counts the registry, and its table calls a missing model a warning."""
    from tilesmith import settings
    from tilesmith.cli import doctor

    text = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    assert f"{len(settings.REGISTRY)} TILESMITH_* settings parse" in text, "update docs/cli.md's doctor sample"
    checks: list = []
    doctor._model_check(checks, None)
    row = next(line for line in text.splitlines() if line.startswith("| model |"))
    assert checks[0].status == "warn" and "warning" in row
