"""Copies of a graph's first real inputs (and its module constants) for the gate.

The copies live in a private temporary folder (mode 0700) outside the agent's workspace, and are written
with ``torch.save``: the gate's worker processes load them into their own memory, so a candidate never
sees (or keeps) the user's tensors. Tensors keep their exact size, stride and storage offset (Inductor
wrappers ``assert_size_stride`` their inputs and may rely on alignment); only the storage span the view
touches is copied, not the whole base storage.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

INPUTS_FILE = "inputs.pt"
CONSTANTS_FILE = "constants.pt"


def new_snapshot_dir(label: str) -> Path:
    """A fresh private folder for one graph's snapshot (``tempfile.mkdtemp`` creates it 0700)."""
    safe = "".join(c if c.isalnum() else "-" for c in label)[:40]
    return Path(tempfile.mkdtemp(prefix=f"tilesmith-{safe}-"))


def copy_input(value: Any) -> Any:
    """A copy of one wrapper input: tensors with identical size/stride/offset, scalars as they are."""
    import torch

    if not isinstance(value, torch.Tensor):
        return value
    size, stride, offset = tuple(value.shape), tuple(value.stride()), value.storage_offset()
    span = 1 + sum((s - 1) * abs(st) for s, st in zip(size, stride, strict=True)) if all(size) else 0
    with torch.no_grad():
        base = torch.empty(offset + span, dtype=value.dtype, device=value.device)
        view = base.as_strided(size, stride, offset)
        if span:
            view.copy_(value.detach())
    return view


def write_snapshot(directory: Path, inputs: list[Any], constants: dict[str, Any]) -> None:
    """Save ``inputs`` (already copies, see :func:`copy_input`) and copies of ``constants`` into
    ``directory`` as ``inputs.pt`` and ``constants.pt``."""
    import torch

    torch.save(list(inputs), directory / INPUTS_FILE)
    torch.save({k: copy_input(v) for k, v in constants.items()}, directory / CONSTANTS_FILE)


def load_inputs(directory: Path, device: str | None = None) -> list[Any]:
    """Load the saved inputs (``weights_only=True``), optionally onto ``device``."""
    import torch

    return torch.load(directory / INPUTS_FILE, map_location=device, weights_only=True)


def remove(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)
