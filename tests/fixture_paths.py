"""Where test fixtures live (one copy of each file).

- ``fixtures/inductor-h200/``: the 13 real Inductor CUDA wrappers captured on the H200 (``*.wrapper.py``), the
  FX graphs that produced them (``*.fx.txt``) and ``index.json`` (metadata); see its README.md.
- ``fixtures/wrappers/``: CPU Inductor wrappers of a small MLP (the built-in agent's runtime tests).
- ``fixtures/roofline/``: FX graphs captured on CPU or written by hand for the roofline parser.
- ``fixtures/native-cuda/``: FX programs of GroupNorm (+ SiLU) captured on CUDA (an H100, torch 2.11): their
  decomposition differs from the CPU capture's (weight and bias broadcast by ``unsqueeze`` after the centred view).
"""

from __future__ import annotations

from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"
H200 = FIXTURES / "inductor-h200"
NATIVE_CUDA = FIXTURES / "native-cuda"
_SEARCH = (FIXTURES / "wrappers", FIXTURES / "roofline", H200)


def fixture(name: str) -> Path:
    """Path of fixture file ``name`` from whichever fixture folder holds it."""
    for folder in _SEARCH:
        if (folder / name).exists():
            return folder / name
    raise FileNotFoundError(f"no fixture named {name} in {', '.join(str(f) for f in _SEARCH)}")
