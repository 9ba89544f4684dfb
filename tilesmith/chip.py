"""``chip=``: does a GPU name the user gave match the device this process will run on?

tilesmith-ai 0.1.4 takes ``chip="H200"`` (a ComputeSDK GPU selector) and raises ``ValueError`` when it does not
match the local execution device's name (``torch.cuda.get_device_name``). Tilesmith runs everything on the local
GPU, so ``chip`` here is a check only: it must name the local GPU's model.

Matching (case-insensitive, a trailing ``!`` ignored):

1. a *model token* — letters followed by digits and optional letters, e.g. ``h200``, ``a100``, ``l40s``,
   ``rtx4090`` — present in both names matches: ``"H200"`` ~ ``"NVIDIA H200"``, ``"h200-141gb"`` ~ ``"NVIDIA H200"``;
2. otherwise the requested words up to and including its first number (vendor words ``nvidia``, ``geforce``,
   ``tesla``, ``gpu`` dropped) must appear as consecutive words of the device name: ``"RTX 4090"`` ~
   ``"NVIDIA GeForce RTX 4090"``. A request without any number matches nothing (``"NVIDIA"`` alone names no
   model). ``"H100"`` does not match ``"NVIDIA H200"``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

_MODEL_TOKEN = re.compile(r"[a-z]+[0-9]+[a-z]*")
_WORD = re.compile(r"[a-z]+|[0-9]+[a-z]*")
_VENDOR_WORDS = frozenset({"nvidia", "geforce", "tesla", "gpu", "blackwell", "hopper", "ampere"})


def _words(name: str) -> list[str]:
    return [w for w in _WORD.findall(name) if w not in _VENDOR_WORDS]


def chip_matches(requested: str, device_name: str) -> bool:
    """Whether ``requested`` (e.g. ``"H200"``) names the model of ``device_name`` (e.g. ``"NVIDIA H200"``).

    Rules in the module docstring; both arguments are free text.
    """
    want = requested.strip().rstrip("!").lower()
    have = device_name.lower()
    if set(_MODEL_TOKEN.findall(want)) & set(_MODEL_TOKEN.findall(have)):
        return True
    wanted = _words(want)
    first_number = next((i for i, w in enumerate(wanted) if w[0].isdigit()), None)
    if first_number is None:
        return False
    model = wanted[: first_number + 1]
    present = _words(have)
    return any(present[i:i + len(model)] == model for i in range(len(present) - len(model) + 1))


def local_device_name(example_inputs: Sequence[Any] | None) -> str | None:
    """``torch.cuda.get_device_name`` of the first CUDA tensor in ``example_inputs``; ``None`` when there is none."""
    import torch

    for value in example_inputs or ():
        if isinstance(value, torch.Tensor) and value.device.type == "cuda":
            index = value.device.index if value.device.index is not None else torch.cuda.current_device()
            return str(torch.cuda.get_device_name(index))
    return None


def check_chip(chip: str, example_inputs: Sequence[Any] | None) -> None:
    """Raise unless ``chip`` names the GPU that ``example_inputs`` live on.

    Raises:
        ValueError: ``chip={chip!r} does not match local execution device {name!r}`` (0.1.4's wording), or no
            CUDA tensor in ``example_inputs`` to compare with.
    """
    name = local_device_name(example_inputs)
    if name is None:
        raise ValueError(f"chip={chip!r} cannot be checked: example_inputs hold no CUDA tensor, so there is no local "
                         "execution device to compare with. Remedy: pass CUDA example_inputs, or leave chip=None.")
    if not chip_matches(chip, name):
        raise ValueError(f"chip={chip!r} does not match local execution device {name!r}. Tilesmith optimizes on "
                         "the local GPU; pass chip=None or the local GPU's model (e.g. 'H200').")
