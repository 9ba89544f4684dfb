"""Plain-text tables and the number/size/duration forms the command line prints and accepts."""

from __future__ import annotations

import re
import shutil
from collections.abc import Sequence

_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
               "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_duration(text: str) -> float:
    """Seconds from ``"90"``, ``"90s"``, ``"30m"``, ``"12h"``, ``"7d"``, ``"2w"`` (one unit).

    Raises:
        ValueError: naming the accepted forms.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text.lower())
    if not m:
        raise ValueError(f"invalid duration {text!r}: use a number with s, m, h, d or w (e.g. 7d, 12h)")
    return float(m[1]) * _DURATION_UNITS[m[2] or "s"]


def parse_size(text: str) -> int:
    """Bytes from ``"500M"``, ``"2G"``, ``"1.5GiB"``, ``"1000"`` (decimal K/M/G/T, binary KiB/MiB/GiB/TiB).

    Raises:
        ValueError: naming the accepted forms.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", text.lower())
    if not m or m[2] not in _SIZE_UNITS:
        raise ValueError(f"invalid size {text!r}: use a number with K, M, G, T (powers of 1000) or KiB, MiB, "
                         f"GiB, TiB (powers of 1024), e.g. 500M or 2GiB")
    return int(float(m[1]) * _SIZE_UNITS[m[2]])


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def human_age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def ms(value: float | None) -> str:
    """Milliseconds with 3 significant decimals, ``-`` when absent."""
    if value is None:
        return "-"
    return f"{value:.4f}" if value < 0.1 else f"{value:.3f}"


def speedup(value: float | None, ci: Sequence[float] | None = None) -> str:
    if value is None:
        return "-"
    text = f"{value:.2f}x"
    if ci and len(ci) == 2 and all(isinstance(v, (int, float)) and v == v for v in ci):
        text += f" [{ci[0]:.2f}, {ci[1]:.2f}]"
    return text


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns separated by two spaces; the last column is not padded."""
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [c.ljust(widths[i]) if i < len(row) - 1 else c for i, c in enumerate(row)]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def wrap(text: str, indent: str = "    ") -> str:
    """Wrap a long message to the terminal width (at least 60 columns) with ``indent``."""
    import textwrap

    width = max(60, shutil.get_terminal_size((100, 20)).columns)
    return textwrap.fill(text, width=width, initial_indent=indent, subsequent_indent=indent,
                         break_long_words=False, break_on_hyphens=False)
