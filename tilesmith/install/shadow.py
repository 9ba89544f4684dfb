"""Helpers of production verification (:mod:`tilesmith.install.verify`): output facts in the gate's form, the
unchanged-input test, the rounding-sensitivity perturbation, RNG states and the TF32 rule."""

from __future__ import annotations

import re
from typing import Any

import torch

from tilesmith.gate.layout import plain_sequence
from tilesmith.track.snapshot import copy_input

PERTURB_ULPS = 4
"""Relative size (in units of the dtype's epsilon) of the input perturbation that measures the original's own
rounding sensitivity, the gate's figure (:func:`tilesmith.gate.inputs.perturbed`)."""


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, getattr(torch, "OutOfMemoryError", ())) or "out of memory" in str(exc).lower()


def output_facts(outputs: Any, inputs: list[Any]) -> list[dict[str, Any]]:
    """Layout and aliasing of each output, in the form :func:`tilesmith.gate.host.compare.compare_structure` reads."""
    items = plain_sequence(outputs)
    if items is None:
        return [{"kind": "not_a_sequence", "type": type(outputs).__qualname__}]
    facts: list[dict[str, Any]] = []
    ptrs: list[int | None] = []
    for out in items:
        if out is None:
            facts.append({"kind": "none"})
            ptrs.append(None)
        elif type(out) in (int, float, bool):
            facts.append({"kind": "scalar", "value": out})
            ptrs.append(None)
        elif type(out) is torch.Tensor or (isinstance(out, torch.Tensor) and any(a is out for a in inputs)):
            # an input returned as it is (a saved parameter) keeps the caller's type (nn.Parameter); the copies
            # the original ran on are plain tensors
            ptr = out.untyped_storage().data_ptr() if out.numel() else None
            facts.append({"kind": "tensor", "shape": list(out.shape), "stride": list(out.stride()),
                          "dtype": str(out.dtype), "device": str(out.device),
                          "input_identity": next((j for j, a in enumerate(inputs) if a is out), None),
                          "input_storage": next((j for j, a in enumerate(inputs) if isinstance(a, torch.Tensor)
                                                 and a.numel() and a.untyped_storage().data_ptr() == ptr), None)})
            ptrs.append(ptr)
        else:
            facts.append({"kind": "other", "type": f"{type(out).__module__}.{type(out).__qualname__}"})
            ptrs.append(None)
    for i, fact in enumerate(facts):
        if ptrs[i] is not None:
            fact["shares_outputs"] = [j for j, p in enumerate(ptrs) if j != i and p == ptrs[i]]
    return facts


def to_caller(out: Any, shadow: Any) -> Any:
    """An output of the original on the copies, re-pointed at the caller's tensor where it aliases an input."""
    if not isinstance(out, torch.Tensor) or not out.numel():
        return out
    ptr = out.untyped_storage().data_ptr()
    for r, c in zip(shadow.real, shadow.copies):
        if isinstance(c, torch.Tensor) and isinstance(r, torch.Tensor):
            if c is out:
                return r
            if c.numel() and c.untyped_storage().data_ptr() == ptr:
                return r.as_strided(out.size(), out.stride(), out.storage_offset())
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    if a.is_floating_point() or a.is_complex():  # NaN != NaN: equal only if they sit at the same places
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return bool(torch.equal(a, b))


def perturbed(value: Any) -> Any:
    """A copy of ``value`` with each floating element scaled by ``1 ± PERTURB_ULPS·eps`` (random sign)."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or not value.numel():
        return value
    out = copy_input(value)
    gen = torch.Generator(device=value.device).manual_seed(0x5EED)
    sign = torch.randint(0, 2, tuple(value.shape), generator=gen, device=value.device).mul_(2).sub_(1)
    eps = torch.finfo(value.dtype).eps
    try:
        out.copy_((value.double() * (1 + PERTURB_ULPS * eps * sign)).to(value.dtype))
    except RuntimeError:
        pass  # an overlapping input: keep the plain copy
    return out


def rng_state(device: torch.device) -> tuple[Any, Any]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def rng_restore(state: tuple[Any, Any], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def rng_equal(a: tuple[Any, Any], b: tuple[Any, Any]) -> bool:
    return torch.equal(a[0], b[0]) and (a[1] is None or b[1] is None or torch.equal(a[1], b[1]))


_MATMUL = re.compile(r"extern_kernels\.(mm|addmm|bmm|baddbmm)|triton_tem_|aten\.(mm|addmm|bmm)|_scaled_mm")


def tf32_in_effect(device: torch.device, source: str) -> bool:
    """Whether the gate's ``tf32`` row applies: a CUDA graph whose matmuls or convolutions run in TF32 under the
    user's flags (the gate's rule, docs/gate.md "Tolerances")."""
    if device.type != "cuda":
        return False

    def tf32(backend: Any, legacy: str) -> bool:
        precision = getattr(backend, "fp32_precision", None)
        if precision in ("tf32", "ieee"):
            return precision == "tf32"
        return bool(getattr(backend, legacy, False))

    cuda_mm = getattr(getattr(torch.backends, "cuda", None), "matmul", None)
    cudnn = getattr(torch.backends, "cudnn", None)
    return bool((_MATMUL.search(source) and tf32(cuda_mm, "allow_tf32"))
                or ("convolution" in source and tf32(getattr(cudnn, "conv", cudnn), "allow_tf32")))
