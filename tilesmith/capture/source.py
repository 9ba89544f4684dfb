"""Wrapper text: canonical form, FX header, graph name.

The canonical wrapper is Inductor's module text with everything machine- or process-specific removed, so
that the same graph gives the same text (and cache key) in any process and any Inductor cache dir:

- ``# kernel path: /tmp/torchinductor_<user>/ab/cab….py`` comments (they embed the cache dir);
- any other occurrence of the Inductor cache dir, replaced by ``<inductor-cache>``;
- the process-global counter in ``# AOT ID: ['3_inference']`` (the same graph compiled first or fourth in a
  process gets 0 or 3), replaced by the graph kind: ``# AOT ID: ['inference']``;
- trailing whitespace.

Everything removed is a comment or a path inside a comment on torch 2.11, so the canonical text loads and
runs exactly like the original (tests load both and compare outputs).
"""

from __future__ import annotations

import re

_KERNEL_PATH = re.compile(r"^[ \t]*# kernel path: .*\n", re.MULTILINE)
_AOT_ID = re.compile(r"^# AOT ID: \['\d+_(\w+)'\]", re.MULTILINE)
_AOT_NAME = re.compile(r"^# AOT ID: \['(\d+_\w+)'\]", re.MULTILINE)
_TRAILING_WS = re.compile(r"[ \t]+$", re.MULTILINE)

#: First line of every attempt file; the FX program follows as comments, then the wrapper.
FX_HEADER = "# ---- FX program (what this wrapper computes; comments only) ----"
FX_FOOTER = "# ---- end of FX program; the Inductor wrapper follows ----"

_TILESMITH_MARK = "# tilesmith: replaced wrapper"


def canonicalize(source: str, cache_dirs: tuple[str, ...] = ()) -> str:
    """Return ``source`` without machine-specific paths and process-specific counters (module docstring).

    Args:
        source: wrapper module text as Inductor wrote it.
        cache_dirs: absolute Inductor cache dirs to replace by ``<inductor-cache>`` (default: the current
            ``torch._inductor.runtime.cache_dir_utils.cache_dir()``).
    """
    if not cache_dirs:
        cache_dirs = (_inductor_cache_dir(),)
    text = _KERNEL_PATH.sub("", source)
    for directory in sorted({d for d in cache_dirs if d}, key=len, reverse=True):
        text = text.replace(directory.rstrip("/"), "<inductor-cache>")
    text = _AOT_ID.sub(lambda m: f"# AOT ID: ['{m.group(1)}']", text)
    text = _TRAILING_WS.sub("", text)
    return text.rstrip("\n") + "\n"


_PREPROCESSOR = ("#include", "#pragma", "#define", "#undef", "#if", "#ifdef", "#ifndef", "#else", "#elif", "#endif")


def key_text(canonical: str) -> str:
    """The part of a canonical wrapper that identifies it: every full-line ``#`` comment removed.

    Why: Inductor's provenance comments (``# Topologically Sorted Source Nodes: [linear]``, ``# Graph
    fragment:`` …) name the FX nodes of whichever model first filled the FX graph cache, so the same graph
    gets different comments in a warm and a cold cache (seen on torch 2.11: ``[input_1]`` vs ``[linear]``).
    C/C++ preprocessor lines inside CPU kernel strings (``#include``, ``#pragma``) are code and stay.
    """
    kept = [line for line in canonical.splitlines()
            if not (line.lstrip().startswith("#") and not line.lstrip().startswith(_PREPROCESSOR))]
    return "\n".join(kept) + "\n"


def graph_name(source: str) -> str | None:
    """AOT id from the wrapper's first line (``"0_inference"``), or ``None`` when absent."""
    match = _AOT_NAME.search(source)
    return match.group(1) if match else None


def with_fx_header(fx_program: str, wrapper: str) -> str:
    """Attempt text: the FX program as ``#`` comments, then the wrapper (docs/layout.md)."""
    lines = [FX_HEADER]
    lines.extend(f"# {line}".rstrip() for line in fx_program.rstrip("\n").splitlines())
    lines.append(FX_FOOTER)
    return "\n".join(lines) + "\n" + strip_fx_header(wrapper)


def strip_fx_header(text: str) -> str:
    """Inverse of :func:`with_fx_header`: the wrapper part of an attempt file (unchanged if no header)."""
    if not text.startswith(FX_HEADER):
        return text
    end = text.find(FX_FOOTER)
    if end < 0:
        return text
    return text[end + len(FX_FOOTER):].lstrip("\n")


def is_tilesmith_source(source: str) -> bool:
    """True for a wrapper Tilesmith wrote or installed (never optimized a second time)."""
    return _TILESMITH_MARK in source


def mark_installed(source: str) -> str:
    """Prefix the Tilesmith marker comment (added to every installed module's text)."""
    return source if is_tilesmith_source(source) else f"{_TILESMITH_MARK}\n{source}"


def _inductor_cache_dir() -> str:
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return cache_dir()
    except Exception:  # noqa: BLE001 - other torch versions
        return ""
