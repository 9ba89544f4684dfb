"""Write docs/env_vars.md from tilesmith.settings.REGISTRY (tests/test_settings.py checks it is current).

Usage: python scripts/gen_env_docs.py [--check]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tilesmith import settings  # noqa: E402

TARGET = Path(__file__).resolve().parents[1] / "docs" / "env_vars.md"


def render() -> str:
    lines = [
        "# Environment variables",
        "",
        "Generated from `tilesmith/settings.py` by `python scripts/gen_env_docs.py`; a test keeps it current.",
        "An invalid value raises `tilesmith.errors.SettingsError` (a `ValueError`) naming the variable.",
        "",
        "| variable | default | meaning |",
        "|---|---|---|",
    ]
    for s in settings.REGISTRY.values():
        default = "—" if s.default is None else f"`{s.default}`"
        lines.append(f"| `{s.name}` | {default} | {s.description} |")
    for old, new in settings.DEPRECATED.items():
        lines.append(f"| `{old}` | — | Deprecated alias of `{new}`: read only when `{new}` is unset, with a "
                     f"FutureWarning. Set `{new}` instead. |")
    if settings.ALIASES:
        lines += ["", "Aliases (tilesmith-ai 0.1.4's names): read when the variable they stand for is unset.", "",
                  "| alias | stands for |", "|---|---|"]
        lines += [f"| `{alias}` | `{target}` |" for alias, target in settings.ALIASES.items()]
    lines += ["", "Provider keys converted into the private CLIProxyAPI config (values are never logged): "
              + ", ".join(f"`{v}`" for v in settings.PROVIDER_KEY_VARIABLES) + ".", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv:
        sys.exit(0 if TARGET.exists() and TARGET.read_text() == text else 1)
    TARGET.write_text(text)
    print(f"wrote {TARGET}")
