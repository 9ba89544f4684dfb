"""Small helpers for the sentences of diagnostics and error messages."""

from __future__ import annotations


def sentence(text: str) -> str:
    """``text`` with trailing spaces removed and exactly one closing ``.`` (kept when it already ends in
    ``.``, ``!``, ``?`` or ``…``), so that joined messages never read ``confirm.. The`` or ``hint The``."""
    text = text.rstrip()
    while text.endswith(".."):
        text = text[:-1]
    return text if not text or text.endswith((".", "!", "?", "…")) else text + "."
